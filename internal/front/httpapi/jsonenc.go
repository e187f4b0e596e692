package httpapi

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"strconv"
	"unicode/utf8"
)

// The answers of every request (a whole chat answer, a streamed chunk) are
// encoded by hand rather than by encoding/json's reflection, a visible
// share of the head's CPU per request. The output
// is byte for byte what encoding/json writes for the same value, escaping
// included (TestAppendJSONIsEncodingJSON, whose values are drawn field by
// field from the response structs); other responses, rarer, go through
// encoding/json. A field added to a response struct must be added here:
// TestAppendJSONCoversEveryField sets every field and fails until it is.

// jsonAppender is a response that appends its own JSON encoding to dst.
type jsonAppender interface {
	appendJSON(dst []byte) []byte
}

func (c *chatCompletion) appendJSON(b []byte) []byte {
	b = appendHead(b, c.ID, c.Object, c.Created, c.Model)
	b = appendChoices(b, c.Choices, (*chatChoice).appendJSON)
	b = append(b, `,"usage":`...)
	b = c.Usage.appendJSON(b)
	return append(b, '}')
}

func (c *chatChoice) appendJSON(b []byte) []byte {
	b = append(b, `{"index":`...)
	b = strconv.AppendInt(b, int64(c.Index), 10)
	b = append(b, `,"message":{"role":`...)
	m := &c.Message
	b = appendString(b, m.Role)
	b = append(b, `,"content":`...)
	b = appendString(b, m.Content)
	b = append(b, `,"refusal":`...)
	b = appendStringPtr(b, m.Refusal)
	if a := m.Audio; a != nil {
		b = append(b, `,"audio":{"id":`...)
		b = appendString(b, a.ID)
		b = append(b, `,"data":`...)
		if a.Data == nil {
			b = append(b, "null"...)
		} else {
			b = append(b, '"')
			b = base64.StdEncoding.AppendEncode(b, a.Data)
			b = append(b, '"')
		}
		b = append(b, `,"expires_at":`...)
		b = strconv.AppendInt(b, a.ExpiresAt, 10)
		b = append(b, `,"transcript":`...)
		b = appendString(b, a.Transcript)
		b = append(b, '}')
	}
	b = append(b, `},"logprobs":`...)
	b = appendEmptyObjectPtr(b, c.Logprobs)
	b = append(b, `,"finish_reason":`...)
	b = appendString(b, c.FinishReason)
	return append(b, '}')
}

func (c *chatChunk) appendJSON(b []byte) []byte {
	b = appendHead(b, c.ID, c.Object, c.Created, c.Model)
	b = appendChoices(b, c.Choices, (*chatChunkChoice).appendJSON)
	return appendUsageField(b, c.Usage)
}

func (c *chatChunkChoice) appendJSON(b []byte) []byte {
	b = append(b, `{"index":`...)
	b = strconv.AppendInt(b, int64(c.Index), 10)
	b = append(b, `,"delta":{`...)
	d := &c.Delta
	sep := false
	field := func(b []byte, key string) []byte {
		if sep {
			b = append(b, ',')
		}
		sep = true
		return append(b, key...)
	}
	if d.Role != "" {
		b = field(b, `"role":`)
		b = appendString(b, d.Role)
	}
	if d.Content != nil {
		b = field(b, `"content":`)
		b = appendString(b, *d.Content)
	}
	if a := d.Audio; a != nil {
		b = field(b, `"audio":{"id":`)
		b = appendString(b, a.ID)
		if a.Data != "" {
			b = append(b, `,"data":`...)
			b = appendString(b, a.Data)
		}
		if len(a.pcm) > 0 { // base64 needs no escaping in a JSON string
			b = append(b, `,"data":"`...)
			b = base64.StdEncoding.AppendEncode(b, a.pcm)
			b = append(b, '"')
		}
		if a.Transcript != "" {
			b = append(b, `,"transcript":`...)
			b = appendString(b, a.Transcript)
		}
		if a.ExpiresAt != 0 {
			b = append(b, `,"expires_at":`...)
			b = strconv.AppendInt(b, a.ExpiresAt, 10)
		}
		b = append(b, '}')
	}
	b = append(b, `},"logprobs":`...)
	b = appendEmptyObjectPtr(b, c.Logprobs)
	b = append(b, `,"finish_reason":`...)
	b = appendStringPtr(b, c.FinishReason)
	return append(b, '}')
}

func (c *textCompletion) appendJSON(b []byte) []byte {
	b = appendHead(b, c.ID, c.Object, c.Created, c.Model)
	b = appendChoices(b, c.Choices, (*completionChoice).appendJSON)
	return appendUsageField(b, c.Usage)
}

func (c *completionChoice) appendJSON(b []byte) []byte {
	b = append(b, `{"index":`...)
	b = strconv.AppendInt(b, int64(c.Index), 10)
	b = append(b, `,"text":`...)
	b = appendString(b, c.Text)
	b = append(b, `,"logprobs":`...)
	b = appendEmptyObjectPtr(b, c.Logprobs)
	b = append(b, `,"finish_reason":`...)
	b = appendStringPtr(b, c.FinishReason)
	return append(b, '}')
}

func (u *usage) appendJSON(b []byte) []byte {
	if u == nil {
		return append(b, "null"...)
	}
	b = append(b, `{"prompt_tokens":`...)
	b = strconv.AppendInt(b, int64(u.PromptTokens), 10)
	b = append(b, `,"completion_tokens":`...)
	b = strconv.AppendInt(b, int64(u.CompletionTokens), 10)
	b = append(b, `,"total_tokens":`...)
	b = strconv.AppendInt(b, int64(u.TotalTokens), 10)
	if d := u.PromptTokensDetails; d != nil {
		b = append(b, `,"prompt_tokens_details":{"audio_tokens":`...)
		b = strconv.AppendInt(b, int64(d.AudioTokens), 10)
		b = append(b, `,"image_tokens":`...)
		b = strconv.AppendInt(b, int64(d.ImageTokens), 10)
		if d.VideoTokens != 0 {
			b = append(b, `,"video_tokens":`...)
			b = strconv.AppendInt(b, int64(d.VideoTokens), 10)
		}
		b = append(b, '}')
	}
	return append(b, '}')
}

// appendHead opens a response object with the fields every answer starts
// with.
func appendHead(b []byte, id, object string, created int64, model string) []byte {
	b = append(b, `{"id":`...)
	b = appendString(b, id)
	b = append(b, `,"object":`...)
	b = appendString(b, object)
	b = append(b, `,"created":`...)
	b = strconv.AppendInt(b, created, 10)
	b = append(b, `,"model":`...)
	return appendString(b, model)
}

// appendChoices appends the choices field: null when nil, as
// encoding/json writes a nil slice.
func appendChoices[T any](b []byte, choices []T, appendOne func(*T, []byte) []byte) []byte {
	b = append(b, `,"choices":`...)
	if choices == nil {
		return append(b, "null"...)
	}
	b = append(b, '[')
	for i := range choices {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendOne(&choices[i], b)
	}
	return append(b, ']')
}

// appendUsageField ends a chunk with its usage: omitted (nil), null
// (nullUsage) or the counts, as the `any` field encodes.
func appendUsageField(b []byte, u any) []byte {
	switch u := u.(type) {
	case nil:
	case *usage:
		b = append(b, `,"usage":`...)
		b = u.appendJSON(b)
	case json.RawMessage: // nullUsage
		b = append(b, `,"usage":`...)
		b = append(b, u...)
	default:
		panic("httpapi: chunk usage of unexpected type") // a bug of this package
	}
	return append(b, '}')
}

func appendStringPtr(b []byte, s *string) []byte {
	if s == nil {
		return append(b, "null"...)
	}
	return appendString(b, *s)
}

func appendEmptyObjectPtr(b []byte, p *struct{}) []byte {
	if p == nil {
		return append(b, "null"...)
	}
	return append(b, "{}"...)
}

const hexDigits = "0123456789abcdef"

// appendString appends s quoted as encoding/json quotes a string: <, > and
// & as \u003c and the like, invalid UTF-8 as \ufffd, U+2028 and U+2029
// escaped.
func appendString(b []byte, s string) []byte {
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		if c := s[i]; c < utf8.RuneSelf {
			if htmlSafe[c] {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '\\', '"':
				b = append(b, '\\', c)
			case '\b':
				b = append(b, '\\', 'b')
			case '\f':
				b = append(b, '\\', 'f')
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xF])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
			i += size
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			b = append(b, s[start:i]...)
			b = append(b, '\\', 'u', '2', '0', '2', hexDigits[r&0xF])
			i += size
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}

// htmlSafe holds the ASCII bytes that appendString writes as they are.
var htmlSafe = func() (t [utf8.RuneSelf]bool) {
	for c := 0x20; c < utf8.RuneSelf; c++ {
		t[c] = c != '"' && c != '\\' && c != '<' && c != '>' && c != '&'
	}
	return t
}()

// chunkAround is a streamed text chunk encoded around its delta: all of an
// answer's text chunks differ only there, so a token's event is the
// prefix, the quoted delta and the suffix, without building the chunk.
type chunkAround struct {
	prefix, suffix []byte
}

// splitChunk encodes chunk, whose delta text is "", and splits it around
// that "", which follows the first occurrence of key: the strings before
// it (id, object, model) are escaped, so key's quotes cannot occur in
// them.
func splitChunk(chunk jsonAppender, key string) chunkAround {
	enc := chunk.appendJSON(nil)
	i := bytes.Index(enc, []byte(key+`""`))
	if i < 0 {
		panic("httpapi: text chunk without " + key) // a bug of this package
	}
	i += len(key)
	return chunkAround{prefix: enc[:i], suffix: enc[i+2:]}
}

func (c chunkAround) appendJSON(b []byte, delta string) []byte {
	b = append(b, c.prefix...)
	b = appendString(b, delta)
	return append(b, c.suffix...)
}
