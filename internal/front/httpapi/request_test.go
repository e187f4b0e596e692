package httpapi

import (
	"net/http"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"
)

const testModel = "troupe-omni-sim"

func TestParseChatMapsFields(t *testing.T) {
	body := `{
		"model": "troupe-omni-sim",
		"messages": [
			{"role": "system", "content": "be brief"},
			{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]},
			{"role": "assistant", "content": null}
		],
		"max_tokens": 7, "max_completion_tokens": 9,
		"temperature": 0.5, "seed": 42, "stop": ["x", "y"], "ignore_eos": true,
		"stream": true, "stream_options": {"include_usage": true},
		"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "pcm16"},
		"top_p": 0.9, "user": "ignored"
	}`
	j, e := parseChat([]byte(body), testModel)
	require.Nil(t, e)
	assert.Equal(t, "system: be brief\nuser: hello\nworld\nassistant: ", j.prompt)
	assert.Equal(t, uint32(7), j.sampling.GetMaxTokens(), "the smaller of max_tokens and max_completion_tokens wins")
	for _, c := range []struct {
		body       string
		max        uint32
		completion bool
	}{
		{`"max_tokens": 32, "max_completion_tokens": 5`, 5, true},
		{`"max_tokens": 5, "max_completion_tokens": 32`, 5, false},
		{`"max_completion_tokens": 32`, 32, true},
		{`"max_tokens": 32`, 32, false},
	} {
		j, e := parseChat([]byte(`{"model":"`+testModel+`","messages":[{"role":"user","content":"hi"}],`+c.body+`}`), testModel)
		require.Nil(t, e, c.body)
		assert.Equal(t, c.max, j.sampling.GetMaxTokens(), c.body)
		assert.Equal(t, c.completion, j.sampling.GetMaxCompletionTokens(), c.body)
	}
	assert.InDelta(t, 0.5, j.sampling.GetTemperature(), 1e-6)
	assert.Equal(t, int64(42), j.sampling.GetSeed())
	assert.NotNil(t, j.sampling.Seed)
	assert.Equal(t, []string{"x", "y"}, j.sampling.GetStop())
	assert.True(t, j.sampling.GetIgnoreEos())
	assert.True(t, j.stream)
	assert.True(t, j.includeUsage)
	assert.True(t, j.audio)
	assert.Equal(t, "pcm16", j.audioFormat)
	assert.Equal(t, testModel, j.model)
}

func TestParseChatDefaults(t *testing.T) {
	j, e := parseChat([]byte(`{"model":"troupe-omni-sim","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stop":"."}`), testModel)
	require.Nil(t, e)
	assert.Equal(t, "user: hi", j.prompt)
	assert.Equal(t, uint32(3), j.sampling.GetMaxTokens())
	assert.Nil(t, j.sampling.Seed, "no seed: the engine's default (0)")
	assert.Equal(t, []string{"."}, j.sampling.GetStop())
	assert.False(t, j.stream)
	assert.False(t, j.audio)
	assert.False(t, j.includeUsage)
}

func TestParseCompletion(t *testing.T) {
	j, e := parseCompletion([]byte(`{"model":"troupe-omni-sim","prompt":["once upon"],"max_completion_tokens":4,"seed":-3}`), testModel)
	require.Nil(t, e)
	assert.Equal(t, "once upon", j.prompt)
	assert.Equal(t, uint32(4), j.sampling.GetMaxTokens())
	assert.Equal(t, int64(-3), j.sampling.GetSeed())
}

func TestParseErrors(t *testing.T) {
	const msgs = `"messages":[{"role":"user","content":"hi"}]`
	cases := []struct {
		name       string
		completion bool
		body       string
		status     int
		param      string
		code       string
		msg        string // the whole message, when the case pins it
	}{
		{name: "empty body", body: ``, status: 400, code: "invalid_json"},
		{name: "syntax", body: `{"model":`, status: 400, code: "invalid_json"},
		{name: "trailing garbage", body: `{"model":"m"} x`, status: 400, code: "invalid_json"},
		{name: "array body", body: `[1]`, status: 400, code: "invalid_type"},
		{name: "missing model", body: `{` + msgs + `}`, status: 400, param: "model", code: "missing_field"},
		{name: "model wrong type", body: `{"model":5,` + msgs + `}`, status: 400, param: "model", code: "invalid_type"},
		{name: "unknown model", body: `{"model":"gpt-4",` + msgs + `}`, status: 404, param: "model", code: "model_not_found"},
		{name: "missing messages", body: `{"model":"troupe-omni-sim"}`, status: 400, param: "messages", code: "missing_field"},
		{name: "empty messages", body: `{"model":"troupe-omni-sim","messages":[]}`, status: 400, param: "messages", code: "invalid_value"},
		{name: "messages wrong type", body: `{"model":"troupe-omni-sim","messages":"hi"}`, status: 400, param: "messages", code: "invalid_type"},
		{name: "message missing role", body: `{"model":"troupe-omni-sim","messages":[{"content":"hi"}]}`, status: 400, param: "messages[0].role", code: "missing_field"},
		{name: "unknown role", body: `{"model":"troupe-omni-sim","messages":[{"role":"bot","content":"hi"}]}`, status: 400, param: "messages[0].role", code: "invalid_value"},
		{name: "content number", body: `{"model":"troupe-omni-sim","messages":[{"role":"user","content":3}]}`, status: 400, param: "messages[0].content", code: "invalid_type"},
		{name: "content unknown part type", body: `{"model":"troupe-omni-sim","messages":[{"role":"user","content":[{"type":"file","file":{"file_id":"x"}}]}]}`, status: 400, param: "messages[0].content[0].type", code: "unsupported"},
		{name: "image url without scheme", body: `{"model":"troupe-omni-sim","messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"x"}}]}]}`, status: 400, param: "messages[0].content[1].image_url.url", code: "unsupported"},
		{name: "image file url", body: `{"model":"troupe-omni-sim","messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"file:///etc/passwd"}}]}]}`, status: 400, param: "messages[0].content[1].image_url.url", code: "unsupported"},
		{name: "image missing url", body: `{"model":"troupe-omni-sim","messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{}}]}]}`, status: 400, param: "messages[0].content[1].image_url.url", code: "missing_field"},
		{name: "image missing object", body: `{"model":"troupe-omni-sim","messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url"}]}]}`, status: 400, param: "messages[0].content[1].image_url", code: "missing_field"},
		{name: "image bad base64", body: `{"model":"troupe-omni-sim","messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"data:image/png;base64,!!!!"}}]}]}`, status: 400, param: "messages[0].content[1].image_url.url", code: "invalid_value"},
		{name: "image data url without comma", body: `{"model":"troupe-omni-sim","messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"data:image/png;base64"}}]}]}`, status: 400, param: "messages[0].content[1].image_url.url", code: "invalid_value"},
		{name: "image empty data url", body: `{"model":"troupe-omni-sim","messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"data:image/png;base64,"}}]}]}`, status: 400, param: "messages[0].content[1].image_url.url", code: "invalid_value"},
		{name: "video url wrong type", body: `{"model":"troupe-omni-sim","messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"video_url","video_url":{"url":5}}]}]}`, status: 400, param: "messages[0].content[1].video_url.url", code: "invalid_type"},
		{name: "audio bad base64", body: `{"model":"troupe-omni-sim","messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"input_audio","input_audio":{"data":"UklGR!","format":"wav"}}]}]}`, status: 400, param: "messages[0].content[1].input_audio.data", code: "invalid_value"},
		{name: "audio missing format", body: `{"model":"troupe-omni-sim","messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"input_audio","input_audio":{"data":"UklGRg=="}}]}]}`, status: 400, param: "messages[0].content[1].input_audio.format", code: "missing_field"},
		{name: "audio unknown format", body: `{"model":"troupe-omni-sim","messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"input_audio","input_audio":{"data":"UklGRg==","format":"midi"}}]}]}`, status: 400, param: "messages[0].content[1].input_audio.format", code: "invalid_value"},
		{name: "audio missing data", body: `{"model":"troupe-omni-sim","messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"input_audio","input_audio":{"format":"wav"}}]}]}`, status: 400, param: "messages[0].content[1].input_audio.data", code: "missing_field"},
		{name: "audio url http bad host", body: `{"model":"troupe-omni-sim","messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"audio_url","audio_url":{"url":"http://"}}]}]}`, status: 400, param: "messages[0].content[1].audio_url.url", code: "invalid_value"},
		{name: "content part not object", body: `{"model":"troupe-omni-sim","messages":[{"role":"user","content":["hi"]}]}`, status: 400, param: "messages[0].content[0]", code: "invalid_type"},
		{name: "content part no text", body: `{"model":"troupe-omni-sim","messages":[{"role":"user","content":[{"type":"text"}]}]}`, status: 400, param: "messages[0].content[0].text", code: "missing_field"},
		{name: "max_tokens string", body: `{"model":"troupe-omni-sim",` + msgs + `,"max_tokens":"7"}`, status: 400, param: "max_tokens", code: "invalid_type"},
		{name: "max_tokens float", body: `{"model":"troupe-omni-sim",` + msgs + `,"max_tokens":1.5}`, status: 400, param: "max_tokens", code: "invalid_type"},
		{name: "max_tokens zero", body: `{"model":"troupe-omni-sim",` + msgs + `,"max_tokens":0}`, status: 400, param: "max_tokens", code: "invalid_value"},
		{name: "max_tokens negative", body: `{"model":"troupe-omni-sim",` + msgs + `,"max_tokens":-1}`, status: 400, param: "max_tokens", code: "invalid_value"},
		{name: "max_completion_tokens huge", body: `{"model":"troupe-omni-sim",` + msgs + `,"max_completion_tokens":1048577}`, status: 400, param: "max_completion_tokens", code: "invalid_value"},
		{name: "temperature high", body: `{"model":"troupe-omni-sim",` + msgs + `,"temperature":2.5}`, status: 400, param: "temperature", code: "invalid_value"},
		{name: "temperature string", body: `{"model":"troupe-omni-sim",` + msgs + `,"temperature":"hot"}`, status: 400, param: "temperature", code: "invalid_type"},
		{name: "seed float", body: `{"model":"troupe-omni-sim",` + msgs + `,"seed":0.5}`, status: 400, param: "seed", code: "invalid_type"},
		{name: "stream string", body: `{"model":"troupe-omni-sim",` + msgs + `,"stream":"yes"}`, status: 400, param: "stream", code: "invalid_type"},
		{name: "stop number", body: `{"model":"troupe-omni-sim",` + msgs + `,"stop":1}`, status: 400, param: "stop", code: "invalid_type"},
		{name: "stop mixed array", body: `{"model":"troupe-omni-sim",` + msgs + `,"stop":["a",1]}`, status: 400, param: "stop[1]", code: "invalid_type"},
		{name: "stop empty", body: `{"model":"troupe-omni-sim",` + msgs + `,"stop":""}`, status: 400, param: "stop", code: "invalid_value"},
		{name: "n two", body: `{"model":"troupe-omni-sim",` + msgs + `,"n":2}`, status: 400, param: "n", code: "unsupported"},
		{name: "n zero", body: `{"model":"troupe-omni-sim",` + msgs + `,"n":0}`, status: 400, param: "n", code: "invalid_value"},
		{name: "unknown modality", body: `{"model":"troupe-omni-sim",` + msgs + `,"modalities":["video"]}`, status: 400, param: "modalities[0]", code: "invalid_value"},
		{name: "streamed wav", body: `{"model":"troupe-omni-sim",` + msgs + `,"stream":true,"modalities":["text","audio"],"audio":{"voice":"alloy","format":"wav"}}`, status: 400, param: "audio.format", code: "unsupported"},
		{name: "audio mp3", body: `{"model":"troupe-omni-sim",` + msgs + `,"modalities":["text","audio"],"audio":{"voice":"alloy","format":"mp3"}}`, status: 400, param: "audio.format", code: "unsupported"},
		{name: "audio voice number", body: `{"model":"troupe-omni-sim",` + msgs + `,"audio":{"voice":3,"format":"wav"}}`, status: 400, param: "audio.voice", code: "invalid_type"},
		{name: "completion missing prompt", completion: true, body: `{"model":"troupe-omni-sim"}`, status: 400, param: "prompt", code: "missing_field"},
		{name: "completion prompt number", completion: true, body: `{"model":"troupe-omni-sim","prompt":5}`, status: 400, param: "prompt", code: "invalid_type"},
		{name: "completion batch", completion: true, body: `{"model":"troupe-omni-sim","prompt":["a","b"]}`, status: 400, param: "prompt", code: "unsupported"},
		{name: "completion token ids", completion: true, body: `{"model":"troupe-omni-sim","prompt":[1,2,3]}`, status: 400, param: "prompt", code: "unsupported"},
		{name: "completion unknown model", completion: true, body: `{"model":"x","prompt":"a"}`, status: 404, param: "model", code: "model_not_found"},
		// The exact field, with its index, in JSON's words.
		{name: "second message role number", body: `{"model":"troupe-omni-sim","messages":[{"role":"user","content":"a"},{"role":7}]}`, status: 400, param: "messages[1].role", code: "invalid_type", msg: `invalid type for "messages[1].role": expected a string, got number`},
		{name: "message not object", body: `{"model":"troupe-omni-sim","messages":[{"role":"user","content":"a"},"hi"]}`, status: 400, param: "messages[1]", code: "invalid_type"},
		{name: "content part text number", body: `{"model":"troupe-omni-sim","messages":[{"role":"user","content":[{"type":"text","text":5}]}]}`, status: 400, param: "messages[0].content[0].text", code: "invalid_type", msg: `invalid type for "messages[0].content[0].text": expected a string, got number`},
		{name: "content part type bool", body: `{"model":"troupe-omni-sim","messages":[{"role":"user","content":[{"type":true}]}]}`, status: 400, param: "messages[0].content[0].type", code: "invalid_type"},
		{name: "modality number", body: `{"model":"troupe-omni-sim",` + msgs + `,"modalities":["text",5]}`, status: 400, param: "modalities[1]", code: "invalid_type"},
		{name: "stream_options nested", body: `{"model":"troupe-omni-sim",` + msgs + `,"stream_options":{"include_usage":"yes"}}`, status: 400, param: "stream_options.include_usage", code: "invalid_type"},
		{name: "audio format number", body: `{"model":"troupe-omni-sim",` + msgs + `,"audio":{"format":1}}`, status: 400, param: "audio.format", code: "invalid_type"},
		{name: "body array", body: `[{"model":"troupe-omni-sim"}]`, status: 400, code: "invalid_type", msg: "invalid type for the request body: expected an object, got array"},
		// Parameters troupe cannot honour, refused by name.
		{name: "logprobs", body: `{"model":"troupe-omni-sim",` + msgs + `,"logprobs":true}`, status: 400, param: "logprobs", code: "unsupported"},
		{name: "top_logprobs", body: `{"model":"troupe-omni-sim",` + msgs + `,"top_logprobs":3}`, status: 400, param: "top_logprobs", code: "unsupported"},
		{name: "tool_choice required", body: `{"model":"troupe-omni-sim",` + msgs + `,"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":"required"}`, status: 400, param: "tool_choice", code: "unsupported"},
		{name: "tool_choice named", body: `{"model":"troupe-omni-sim",` + msgs + `,"tool_choice":{"type":"function","function":{"name":"f"}}}`, status: 400, param: "tool_choice", code: "unsupported"},
		{name: "tool_choice unknown", body: `{"model":"troupe-omni-sim",` + msgs + `,"tool_choice":"sometimes"}`, status: 400, param: "tool_choice", code: "invalid_value"},
		{name: "function_call named", body: `{"model":"troupe-omni-sim",` + msgs + `,"function_call":{"name":"f"}}`, status: 400, param: "function_call", code: "unsupported"},
		{name: "response_format json", body: `{"model":"troupe-omni-sim",` + msgs + `,"response_format":{"type":"json_object"}}`, status: 400, param: "response_format", code: "unsupported"},
		{name: "response_format schema", completion: true, body: `{"model":"troupe-omni-sim","prompt":"a","response_format":{"type":"json_schema","json_schema":{}}}`, status: 400, param: "response_format", code: "unsupported"},
		{name: "response_format no type", body: `{"model":"troupe-omni-sim",` + msgs + `,"response_format":{}}`, status: 400, param: "response_format.type", code: "missing_field"},
		{name: "prompt_logprobs", completion: true, body: `{"model":"troupe-omni-sim","prompt":"a","prompt_logprobs":1}`, status: 400, param: "prompt_logprobs", code: "unsupported"},
		{name: "completion logprobs", completion: true, body: `{"model":"troupe-omni-sim","prompt":"a","logprobs":2}`, status: 400, param: "logprobs", code: "unsupported"},
		{name: "completion logprobs bool", completion: true, body: `{"model":"troupe-omni-sim","prompt":"a","logprobs":true}`, status: 400, param: "logprobs", code: "invalid_type", msg: `invalid type for "logprobs": expected an integer, got bool`},
		{name: "completion suffix", completion: true, body: `{"model":"troupe-omni-sim","prompt":"a","suffix":"end"}`, status: 400, param: "suffix", code: "unsupported"},
		{name: "completion best_of", completion: true, body: `{"model":"troupe-omni-sim","prompt":"a","best_of":3}`, status: 400, param: "best_of", code: "unsupported"},
		// Prompt forms, worded for what they are.
		{name: "token ids are one prompt", completion: true, body: `{"model":"troupe-omni-sim","prompt":[1,2,3]}`, status: 400, param: "prompt", code: "unsupported", msg: `"prompt" is one prompt of 3 token ids: token-id prompts are not supported, send the prompt as text`},
		{name: "one token-id prompt nested", completion: true, body: `{"model":"troupe-omni-sim","prompt":[[1,2]]}`, status: 400, param: "prompt", code: "unsupported", msg: `"prompt" is one prompt of 2 token ids: token-id prompts are not supported, send the prompt as text`},
		{name: "token-id batch", completion: true, body: `{"model":"troupe-omni-sim","prompt":[[1,2],[3]]}`, status: 400, param: "prompt", code: "unsupported"},
		{name: "token ids mixed", completion: true, body: `{"model":"troupe-omni-sim","prompt":[1,"a"]}`, status: 400, param: "prompt[1]", code: "invalid_type"},
		{name: "prompt empty array", completion: true, body: `{"model":"troupe-omni-sim","prompt":[]}`, status: 400, param: "prompt", code: "invalid_value"},
		{name: "prompt batch of strings", completion: true, body: `{"model":"troupe-omni-sim","prompt":["a","b","c"]}`, status: 400, param: "prompt", code: "unsupported", msg: `"prompt" holds 3 prompts: batched prompts are not supported, send one request per prompt`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var e *apiError
			if tc.completion {
				_, e = parseCompletion([]byte(tc.body), testModel)
			} else {
				_, e = parseChat([]byte(tc.body), testModel)
			}
			require.NotNil(t, e, "body %s must be refused", tc.body)
			assert.Equal(t, tc.status, e.Status)
			assert.Equal(t, tc.param, e.Param)
			assert.Equal(t, tc.code, e.Code)
			assert.NotEmpty(t, e.Message)
			if tc.msg != "" {
				assert.Equal(t, tc.msg, e.Message)
			}
			assertNoInternals(t, e.Message)
			if tc.status == http.StatusBadRequest {
				assert.Equal(t, typeInvalidRequest, e.Type)
			}
		})
	}
}

// Whatever bytes arrive, parsing answers a job or a 4xx; it never panics.
func TestParseNeverPanics(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		body := rapid.OneOf(
			rapid.SliceOf(rapid.Byte()),
			rapid.Map(rapid.StringMatching(`\{"model":"troupe-omni-sim","(messages|prompt)":[\[\]{}"a-z:,0-9 .-]{0,40}\}`), func(s string) []byte { return []byte(s) }),
		).Draw(t, "body")
		for _, parse := range []func([]byte, string) (job, *apiError){parseChat, parseCompletion} {
			j, e := parse(body, testModel)
			if e != nil {
				if e.Status < 400 || e.Status > 499 {
					t.Fatalf("status %d for %q", e.Status, body)
				}
				if m := internalsRE.FindString(e.Message); m != "" {
					t.Fatalf("message %q for %q names %q", e.Message, body, m)
				}
				continue
			}
			if j.sampling == nil {
				t.Fatalf("accepted %q without sampling params", body)
			}
		}
	})
}

func TestRequestID(t *testing.T) {
	assert.Equal(t, "abc-123_x.y", requestID("abc-123_x.y"))
	for _, bad := range []string{"", "has space", "ctl\x01", strings.Repeat("a", maxRequestIDLen+1), "é"} {
		got := requestID(bad)
		assert.Regexp(t, `^[0-9a-f]{32}$`, got, "client id %q must be replaced", bad)
	}
	assert.NotEqual(t, requestID(""), requestID(""), "generated ids are random")
	assert.Equal(t, strings.Repeat("a", maxRequestIDLen), requestID(strings.Repeat("a", maxRequestIDLen)))
}

// internalsRE matches what a client must never read in an error: Go type
// names, encoding/json's own wording, package prefixes.
var internalsRE = regexp.MustCompile(`Go (struct|value)|\bstruct\b|json: |samplingFields|chatRequest|chatMessage|contentPart|completionRequest|audioParam|RawMessage|\bu?int(64|32)?\b|float64|\*[a-zA-Z]|orchestrator: |router: |httpapi: |sim: |worker: `)

func assertNoInternals(t *testing.T, msg string) {
	t.Helper()
	assert.NotRegexp(t, internalsRE, msg)
}

// TestIgnoredParams: what is set and not read is listed, sorted; null and
// honoured values are not.
func TestIgnoredParams(t *testing.T) {
	j, e := parseChat([]byte(`{"model":"troupe-omni-sim","messages":[{"role":"user","content":"hi"}],
		"top_p":0.9,"user":"u1","tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":"auto",
		"logprobs":false,"top_logprobs":0,"response_format":{"type":"text"},"frequency_penalty":null,"max_token":5}`), testModel)
	require.Nil(t, e)
	assert.Equal(t, []string{"max_token", "tools"}, j.ignored, "user is a session key, not ignored; top_p is passed on")
	assert.InDelta(t, 0.9, j.sampling.GetTopP(), 1e-6)

	j, e = parseCompletion([]byte(`{"model":"troupe-omni-sim","prompt":"a","echo":true,"presence_penalty":1,"metadata":{"k":"v"},"suffix":"","best_of":1}`), testModel)
	require.Nil(t, e)
	assert.True(t, j.echo)
	assert.Equal(t, []string{"metadata"}, j.ignored, "presence_penalty is passed on")
	assert.InDelta(t, 1, j.sampling.GetPresencePenalty(), 1e-6)

	j, e = parseChat([]byte(`{"model":"troupe-omni-sim","messages":[{"role":"user","content":"hi"}]}`), testModel)
	require.Nil(t, e)
	assert.Empty(t, j.ignored)
}

// BenchmarkParseChat: the request the head's benchmarks send
// (scripts/bench-vs-nginx.sh).
//
//	go test -run '^$' -bench ParseChat -benchmem ./internal/front/httpapi/
func BenchmarkParseChat(b *testing.B) {
	body := []byte(`{"ignore_eos":true,"max_tokens":16,"messages":[{"content":"tell me a story about a fox","role":"user"}],"model":"troupe-omni-sim","stream":false}`)
	b.ReportAllocs()
	for b.Loop() {
		if _, e := parseChat(body, "troupe-omni-sim"); e != nil {
			b.Fatal(e)
		}
	}
}

// TestSamplingKnobs: the OpenAI and vLLM sampling knobs are passed on as
// given, within the ranges those APIs accept.
func TestSamplingKnobs(t *testing.T) {
	j, e := parseChat([]byte(`{"model":"troupe-omni-sim","messages":[{"role":"user","content":"hi"}],
		"top_p":0.5,"top_k":40,"min_p":0.05,"frequency_penalty":-0.5,"presence_penalty":1.5,"repetition_penalty":1.1,
		"logit_bias":{"50256":-100,"7":2.5},"min_tokens":3,"max_completion_tokens":20}`), testModel)
	require.Nil(t, e)
	sp := j.sampling
	assert.Empty(t, j.ignored)
	assert.InDelta(t, 0.5, sp.GetTopP(), 1e-6)
	assert.Equal(t, int32(40), sp.GetTopK())
	assert.InDelta(t, 0.05, sp.GetMinP(), 1e-6)
	assert.InDelta(t, -0.5, sp.GetFrequencyPenalty(), 1e-6)
	assert.InDelta(t, 1.5, sp.GetPresencePenalty(), 1e-6)
	assert.InDelta(t, 1.1, sp.GetRepetitionPenalty(), 1e-6)
	assert.Equal(t, map[string]float32{"50256": -100, "7": 2.5}, sp.GetLogitBias())
	assert.Equal(t, uint32(3), sp.GetMinTokens())
	assert.True(t, sp.GetMaxCompletionTokens())

	for body, param := range map[string]string{
		`"top_p":0`:               "top_p",
		`"top_p":1.5`:             "top_p",
		`"min_p":-0.1`:            "min_p",
		`"frequency_penalty":2.5`: "frequency_penalty",
		`"presence_penalty":-3`:   "presence_penalty",
		`"repetition_penalty":0`:  "repetition_penalty",
		`"top_k":-2`:              "top_k",
		`"min_tokens":-1`:         "min_tokens",
		`"logit_bias":{"abc":1}`:  "logit_bias",
		`"logit_bias":{"1":101}`:  "logit_bias",
		`"logit_bias":[1]`:        "logit_bias",
	} {
		_, e := parseChat([]byte(`{"model":"troupe-omni-sim","messages":[{"role":"user","content":"hi"}],`+body+`}`), testModel)
		require.NotNil(t, e, body)
		assert.Equal(t, param, e.Param, body)
		assert.Equal(t, 400, e.Status, body)
	}
}
