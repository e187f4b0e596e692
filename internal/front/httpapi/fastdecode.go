package httpapi

import (
	"bytes"
	"encoding/json"
	"slices"
	"strconv"
	"unicode/utf8"
)

// A chat request of the usual shape (known fields of the expected types,
// plain strings, each key once) is decoded by walking it once, in a third
// of the time encoding/json's reflection takes, which was a twentieth of
// the head's CPU per request (docs/benchmarks.md). Anything else (a wrong
// type, an escaped string, a key in another case, a repeated key) goes
// through encoding/json, whose errors name the field. Either way the
// request decodes to the same value: TestFastDecodeIsEncodingJSON.

// decodeChatFast decodes body into req, a zero chatRequest, and returns
// the fields it ignored, as ignoredFields would, when body has the usual
// shape; ok is false, and req to be reset, when it does not.
func decodeChatFast(body []byte, req *chatRequest) (ignored []string, ok bool) {
	if !json.Valid(body) {
		return nil, false
	}
	var unknown [8][]byte
	nUnknown := 0
	ok = fastObject(body, chatFields, func(name string, val []byte) bool {
		switch name {
		case "messages":
			return fastRawArray(val, &req.Messages)
		case "modalities":
			return fastRawArray(val, &req.Modalities)
		case "audio":
			return fastAudio(val, &req.Audio)
		case "logprobs":
			return fastBool(val, &req.Logprobs)
		case "top_logprobs":
			return fastNumber(val, &req.TopLogprobs, parseInt)
		case "tool_choice":
			return fastRaw(val, &req.ToolChoice)
		case "function_call":
			return fastRaw(val, &req.FunctionCall)
		}
		return req.samplingFields.decodeFast(name, val)
	}, func(key, val []byte) bool {
		// A repeat would need its last occurrence to count: left to
		// ignoredFields.
		if nUnknown == len(unknown) || slices.ContainsFunc(unknown[:nUnknown], func(k []byte) bool { return bytes.Equal(k, key) }) {
			return false
		}
		unknown[nUnknown] = key
		nUnknown++
		if !isNullLiteral(val) {
			ignored = append(ignored, string(key))
		}
		return true
	})
	if !ok {
		return nil, false
	}
	slices.Sort(ignored)
	return ignored, true
}

// decodeFast decodes one of commonFields.
func (f *samplingFields) decodeFast(name string, val []byte) bool {
	switch name {
	case "model":
		return fastString(val, &f.Model)
	case "stream":
		return fastBool(val, &f.Stream)
	case "stream_options":
		if isNullLiteral(val) {
			return true
		}
		f.StreamOptions = &streamOptions{}
		return fastObject(val, streamOptionsFields, func(_ string, v []byte) bool {
			return fastBool(v, &f.StreamOptions.IncludeUsage)
		}, nil)
	case "max_tokens":
		return fastNumber(val, &f.MaxTokens, parseInt)
	case "max_completion_tokens":
		return fastNumber(val, &f.MaxCompletionTokens, parseInt)
	case "temperature":
		return fastNumber(val, &f.Temperature, parseFloat)
	case "seed":
		return fastNumber(val, &f.Seed, parseInt)
	case "stop":
		return fastRaw(val, &f.Stop)
	case "ignore_eos":
		return fastBool(val, &f.IgnoreEOS)
	case "n":
		return fastNumber(val, &f.N, parseInt)
	case "response_format":
		if isNullLiteral(val) {
			return true
		}
		f.ResponseFormat = &responseFormat{}
		return fastObject(val, responseFormatFields, func(_ string, v []byte) bool {
			return fastString(v, &f.ResponseFormat.Type)
		}, nil)
	case "prompt_logprobs":
		return fastRaw(val, &f.PromptLogprobs)
	case "user":
		return fastString(val, &f.User)
	}
	return false
}

func fastAudio(val []byte, p **audioParam) bool {
	if isNullLiteral(val) {
		return true
	}
	a := &audioParam{}
	*p = a
	return fastObject(val, audioFields, func(name string, v []byte) bool {
		if name == "voice" {
			return fastRaw(v, &a.Voice)
		}
		return fastString(v, &a.Format)
	}, nil)
}

// decodeMessageFast decodes a message of the usual shape, as decodeValue
// would; ok is false, and m to be reset, when raw has another shape.
func decodeMessageFast(raw []byte, m *chatMessage) bool {
	return fastObject(raw, messageFields, func(name string, v []byte) bool {
		if name == "role" {
			return fastString(v, &m.Role)
		}
		return fastRaw(v, &m.Content)
	}, nil)
}

// The fields of the objects inside a request, as their types name them.
var (
	streamOptionsFields  = []string{"include_usage"}
	responseFormatFields = []string{"type"}
	audioFields          = []string{"voice", "format"}
	messageFields        = []string{"role", "content"}
)

// fastObject walks the JSON object obj, calling set for each of fields
// present and unknown for every other key (nil: skipped, as encoding/json
// skips keys no field has). It reports false when obj is not an object, a
// field repeats, a key has another case than its field's (encoding/json
// would match it to the field), or a callback returns false.
func fastObject(obj []byte, fields []string, set func(name string, val []byte) bool, unknown func(key, val []byte) bool) bool {
	var seen uint64 // bit i: fields[i]
	return eachField(obj, func(key, val []byte) bool {
		i := slices.IndexFunc(fields, func(f string) bool { return f == string(key) })
		if i < 0 {
			if slices.ContainsFunc(fields, func(f string) bool { return bytes.EqualFold(key, []byte(f)) }) {
				return false
			}
			return unknown == nil || unknown(key, val)
		}
		if seen&(1<<i) != 0 {
			return false
		}
		seen |= 1 << i
		return set(fields[i], val)
	})
}

// eachField calls f for each member of obj, a valid JSON value, with its
// key (unquoted) and value (without surrounding space). It reports false
// when obj is not an object, a key has escapes, or f returns false.
func eachField(obj []byte, f func(key, val []byte) bool) bool {
	i := skipSpace(obj, 0)
	if i >= len(obj) || obj[i] != '{' {
		return false
	}
	i++
	for {
		i = skipSpace(obj, i)
		if i >= len(obj) || obj[i] == '}' {
			return true
		}
		end := skipString(obj, i)
		key := obj[i+1 : end-1]
		if bytes.IndexByte(key, '\\') >= 0 {
			return false
		}
		i = skipSpace(obj, skipSpace(obj, end)+1) // past the ':'
		start := i
		i = skipValue(obj, i)
		if !f(key, obj[start:i]) {
			return false
		}
		i = skipSpace(obj, i)
		if i < len(obj) && obj[i] == ',' {
			i++
		}
	}
}

func isNullLiteral(val []byte) bool { return string(val) == "null" }

// The fast* setters decode one value as encoding/json decodes it into the
// field's type, reporting false for what they leave to encoding/json.

func fastString(val []byte, p **string) bool {
	if isNullLiteral(val) {
		return true
	}
	if val[0] != '"' {
		return false
	}
	inner := val[1 : len(val)-1]
	if bytes.IndexByte(inner, '\\') >= 0 || !utf8.Valid(inner) {
		return false
	}
	s := string(inner)
	*p = &s
	return true
}

func fastBool(val []byte, p **bool) bool {
	switch string(val) {
	case "null":
		return true
	case "true", "false":
		b := val[0] == 't'
		*p = &b
		return true
	}
	return false
}

// fastNumber decodes a number with parse, which is strconv's, as
// encoding/json parses a number for an integer or a float field.
func fastNumber[T int64 | float64](val []byte, p **T, parse func(string) (T, error)) bool {
	if isNullLiteral(val) {
		return true
	}
	if val[0] != '-' && (val[0] < '0' || val[0] > '9') {
		return false
	}
	x, err := parse(string(val))
	if err != nil {
		return false
	}
	*p = &x
	return true
}

func parseInt(s string) (int64, error)     { return strconv.ParseInt(s, 10, 64) }
func parseFloat(s string) (float64, error) { return strconv.ParseFloat(s, 64) }

// fastRaw keeps val itself (null included), as json.RawMessage does.
func fastRaw(val []byte, p *json.RawMessage) bool {
	*p = val
	return true
}

// fastRawArray splits an array into its elements, as []json.RawMessage
// does; null leaves it nil.
func fastRawArray(val []byte, p *[]json.RawMessage) bool {
	if isNullLiteral(val) {
		return true
	}
	if val[0] != '[' {
		return false
	}
	out := make([]json.RawMessage, 0, 4)
	for i := skipSpace(val, 1); i < len(val) && val[i] != ']'; {
		end := skipValue(val, i)
		out = append(out, val[i:end])
		i = skipSpace(val, end)
		if i < len(val) && val[i] == ',' {
			i = skipSpace(val, i+1)
		}
	}
	*p = out
	return true
}
