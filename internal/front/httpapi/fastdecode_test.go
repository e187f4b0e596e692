package httpapi

import (
	"encoding/json"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"
)

// jsonValue draws the JSON text of a value: mostly of the types a chat
// request's fields take, some of other types, some in unusual forms.
func jsonValue(t *rapid.T, label string, depth int) string {
	kinds := []string{"null", "bool", "int", "number", "string", "escaped", "invalid-utf8", "array", "object", "message"}
	if depth > 2 {
		kinds = kinds[:7]
	}
	switch rapid.SampledFrom(kinds).Draw(t, label+"-kind") {
	case "null":
		return "null"
	case "bool":
		return rapid.SampledFrom([]string{"true", "false"}).Draw(t, label)
	case "int":
		return rapid.SampledFrom([]string{"0", "1", "16", "-3", "-0", "9223372036854775807", "9223372036854775808", "1048577"}).Draw(t, label)
	case "number":
		return rapid.SampledFrom([]string{"0.7", "1.5", "1e3", "-2.5E-2", "2", "1e400"}).Draw(t, label)
	case "string":
		return `"` + rapid.SampledFrom([]string{"", "troupe-omni-sim", "user", "assistant", "system", "text", "audio", "alloy", "wav", "pcm16", "auto", "none", "required", "json_object", "héllo 🦊"}).Draw(t, label) + `"`
	case "invalid-utf8": // valid JSON, which encoding/json decodes with U+FFFD
		return rapid.SampledFrom([]string{"\"\xff\"", "\"us\xc3er\""}).Draw(t, label)
	case "escaped":
		return rapid.SampledFrom([]string{`"a\nb"`, `"\u0075ser"`, `"tab\there"`, `"quote\"d"`, `"\ud83e\udd8a"`}).Draw(t, label)
	case "array":
		n := rapid.IntRange(0, 3).Draw(t, label+"-len")
		els := make([]string, n)
		for i := range els {
			els[i] = jsonValue(t, label+"-el", depth+1)
		}
		return "[" + strings.Join(els, rapid.SampledFrom([]string{",", " , ", ",\n"}).Draw(t, label+"-sep")) + "]"
	case "message":
		return jsonObject(t, label, depth+1, messageKeys)
	}
	return jsonObject(t, label, depth+1, objectKeys)
}

// fieldKinds are the JSON kinds the request's fields take (from the
// structs); messageKeys and objectKeys the keys drawn for a message and
// for the other objects inside a request: their fields, in another case
// too, and keys no field has.
var (
	fieldKinds  = requestKinds()
	messageKeys = append(withOtherCase(messageDecoder.names), "name", "tool_calls", "CONTENT")
	objectKeys  = append(withOtherCase(nestedNames()), "id", "x")
)

// typedValue draws a value of kind, now and then null.
func typedValue(t *rapid.T, label, kind string, depth int) string {
	if rapid.IntRange(0, 9).Draw(t, label+"-null") == 0 {
		return "null"
	}
	switch kind {
	case "string":
		return rapid.SampledFrom([]string{`"user"`, `"troupe-omni-sim"`, `"wav"`, "\"\xff\"", `"a\nb"`, `""`}).Draw(t, label)
	case "bool", "int", "number":
		for {
			v := jsonValue(t, label, depth)
			switch {
			case kind == "bool" && (v == "true" || v == "false"),
				kind != "bool" && v != "" && (v[0] == '-' || v[0] >= '0' && v[0] <= '9'):
				return v
			}
		}
	case "messages":
		n := rapid.IntRange(0, 3).Draw(t, label+"-len")
		els := make([]string, n)
		for i := range els {
			els[i] = jsonObject(t, label+"-msg", depth+1, messageKeys)
		}
		return "[" + strings.Join(els, ",") + "]"
	case "strings":
		return rapid.SampledFrom([]string{`[]`, `["text"]`, `["text", "audio"]`, `["\u0061udio"]`}).Draw(t, label)
	}
	return jsonObject(t, label, depth+1, objectKeys)
}

// jsonObject draws an object whose keys are drawn from keys (repeats
// included) and, now and then, an escaped key.
func jsonObject(t *rapid.T, label string, depth int, keys []string) string {
	n := rapid.IntRange(0, 6).Draw(t, label+"-members")
	members := make([]string, n)
	for i := range members {
		key := `"` + rapid.SampledFrom(keys).Draw(t, label+"-key") + `"`
		if rapid.IntRange(0, 20).Draw(t, label+"-escape") == 0 {
			key = `"\u006dodel"`
		}
		space := rapid.SampledFrom([]string{"", " ", "\n\t"}).Draw(t, label+"-space")
		value := jsonValue(t, label+"-"+key, depth)
		if kind, ok := fieldKinds[strings.Trim(key, `"`)]; ok && rapid.IntRange(0, 3).Draw(t, label+"-typed") > 0 {
			value = typedValue(t, label+"-"+key, kind, depth)
		}
		members[i] = space + key + space + ":" + space + value + space
	}
	return "{" + strings.Join(members, ",") + "}"
}

// TestFastDecodeIsEncodingJSON: whenever the fast decoder takes a chat
// request (or a message), it decodes what encoding/json decodes, and
// reports the ignored fields ignoredFields reports; it never takes one
// that encoding/json refuses.
func TestFastDecodeIsEncodingJSON(t *testing.T) {
	requestKeys := append([]string{"top_p", "Model", "MESSAGES", "metadata", "frequency_penalty"}, chatFields...)
	var taken, messagesTaken int
	prop := func(t *rapid.T) {
		// The usual shape most of the time, so the fast path is exercised.
		var members []string
		if rapid.Bool().Draw(t, "usual") {
			members = append(members,
				`"model":"troupe-omni-sim"`,
				`"messages":[`+jsonObject(t, "msg", 1, []string{"role", "content", "name"})+`,{"role":"user","content":"hi"}]`)
		}
		body := jsonObject(t, "body", 0, requestKeys)
		if len(members) > 0 {
			if body == "{}" {
				body = "{" + strings.Join(members, ",") + "}"
			} else {
				body = "{" + strings.Join(members, ",") + "," + body[1:]
			}
		}
		require.True(t, json.Valid([]byte(body)), body)

		ok, mismatch := fastDecodeMismatch([]byte(body))
		require.Empty(t, mismatch)
		if ok {
			taken++
		}
		var slow chatRequest
		if json.Unmarshal([]byte(body), &slow) != nil {
			return
		}
		for _, raw := range slow.Messages {
			var fastMsg chatMessage
			ok := decodeMessageFast(raw, &fastMsg)
			var slowMsg chatMessage
			err := json.Unmarshal(raw, &slowMsg)
			if ok {
				messagesTaken++
				require.NoError(t, err, "the fast decoder took a message encoding/json refuses: %s", raw)
				require.Equal(t, slowMsg, fastMsg, string(raw))
			}
		}
	}
	for range 10 { // ten seeds: a mismatch may need a rare mix of fields
		rapid.Check(t, prop)
	}
	t.Logf("fast path: %d requests, %d messages", taken, messagesTaken)
	assert.Greater(t, taken, 5, "the fast path was hardly exercised")
	assert.Greater(t, messagesTaken, 5, "the fast message path was hardly exercised")
}

// fastDecodeMismatch reports whether the fast decoder took body and, if
// it did, how its result differs from encoding/json's ("" when it does
// not).
func fastDecodeMismatch(body []byte) (taken bool, mismatch string) {
	var fast chatRequest
	ignored, ok := decodeChatFast(body, &fast)
	if !ok {
		return false, ""
	}
	var slow chatRequest
	if err := json.Unmarshal(body, &slow); err != nil {
		return true, fmt.Sprintf("took %q, which encoding/json refuses: %v", body, err)
	}
	if !reflect.DeepEqual(slow, fast) {
		return true, fmt.Sprintf("decoded %q as %+v, encoding/json as %+v", body, fast, slow)
	}
	if want := ignoredFields(body, chatFields); !slices.Equal(want, ignored) {
		return true, fmt.Sprintf("ignored %q in %q, ignoredFields says %q", ignored, body, want)
	}
	return true, ""
}

func TestFastDecodeTakesTheUsualRequest(t *testing.T) {
	body := `{"model":"troupe-omni-sim","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}],` +
		`"max_tokens":16,"temperature":0.7,"seed":3,"stream":true,"stream_options":{"include_usage":true},"top_p":0.9,"store":false,"user":"u1"}`
	var req chatRequest
	ignored, ok := decodeChatFast([]byte(body), &req)
	require.True(t, ok)
	assert.Equal(t, []string{"store"}, ignored)
	assert.InDelta(t, 0.9, *req.TopP, 1e-9)
	assert.Equal(t, int64(16), *req.MaxTokens)
	assert.True(t, *req.StreamOptions.IncludeUsage)
	require.Len(t, req.Messages, 2)
	var m chatMessage
	require.True(t, decodeMessageFast(req.Messages[1], &m))
	assert.Equal(t, "user", *m.Role)
	assert.JSONEq(t, `"hi"`, string(m.Content))

	for _, unusual := range []string{
		`{"model":"m","model":"m"}`,    // a repeated key
		`{"Model":"m"}`,                // another case
		`{"model":"\u006d"}`,           // an escape
		`{"max_tokens":1.5}`,           // a type encoding/json refuses, with its own error
		`{"messages":{"role":"user"}}`, // an object for an array
		`[{"model":"m"}]`,              // not an object
		`{"model":"m"`,                 // not JSON
		`{"stream_options":{"include_usage":1}}`,
	} {
		var req chatRequest
		_, ok := decodeChatFast([]byte(unusual), &req)
		assert.False(t, ok, unusual)
	}
}
