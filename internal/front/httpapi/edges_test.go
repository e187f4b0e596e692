package httpapi

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
)

// The edges a new user hits first: large prompts, errors that net/http
// answers by itself, unclean paths, parameters troupe does not honour.

// TestLargePrompts: a prompt above gRPC's default 4 MiB and below the body
// limit reaches the engine; one longer than the engine's context is a 400
// context_length_exceeded (not a 5xx, which SDKs retry); neither error
// names a replica's address or an internal package.
func TestLargePrompts(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{Pipeline: textPipeline()})
	a := startAPI(t, c, Config{}, nil, nil)
	thinker := c.Workers()[0]
	completion := func(prompt string, extra string) string {
		b, err := json.Marshal(prompt)
		require.NoError(t, err)
		return `{"model":"troupe-omni-sim","max_tokens":4` + extra + `,"prompt":` + string(b) + `}`
	}

	// 6 MiB in one word: two tokens for the sim, 6 MiB on the wire.
	resp, body := a.post(t, "/v1/completions", completion(strings.Repeat("x", 6<<20), ""))
	require.Equal(t, http.StatusOK, resp.StatusCode, "body: %.500s", body)
	var res textCompletion
	require.NoError(t, json.Unmarshal(body, &res))
	assert.NotEmpty(t, res.Choices[0].Text)

	// 6 MiB of words: three million tokens, more than the sim's context
	// (its KV cache: 4096 blocks of 16).
	long := completion(strings.Repeat("a ", 3<<20), "")
	for _, req := range []string{long, strings.Replace(long, `"max_tokens":4`, `"max_tokens":4,"stream":true`, 1)} {
		resp, body = a.post(t, "/v1/completions", req)
		d := wantError(t, resp, body, http.StatusBadRequest, typeInvalidRequest, "context_length_exceeded")
		assert.Contains(t, d.Message, "maximum context length is 65536 tokens")
		assert.Contains(t, d.Message, "(3145729 in the prompt, 4 in the completion)")
		assert.NotContains(t, d.Message, thinker.Addr())
		assertNoInternals(t, d.Message)
	}

	// Invalid UTF-8 decodes to three bytes per byte (U+FFFD): a body under
	// the limit whose prompt is over what a replica takes is refused by
	// the head, before it is sent, as too large.
	raw := append(append([]byte(`{"model":"troupe-omni-sim","prompt":"`), bytes.Repeat([]byte{0xff}, 6<<20)...), `"}`...)
	resp, body = a.do(t, "POST", "/v1/completions", bytes.NewReader(raw), nil)
	d := wantError(t, resp, body, http.StatusRequestEntityTooLarge, typeInvalidRequest, "request_too_large")
	assert.Contains(t, d.Message, "the prompt is too large")
}

// TestStageErrorsHideAddresses: a replica's failure reaches the client
// without the replica's address or the head's error chain; the head's log
// keeps both.
func TestStageErrorsHideAddresses(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{Pipeline: textPipeline()})
	var log syncBuffer
	a := startAPI(t, c, Config{Logger: slog.New(slog.NewTextHandler(&log, nil))}, nil, nil)
	w := c.Workers()[0]
	_, err := w.Engine.Sleep(t.Context(), 1) // behind the head's back: the replica refuses work
	require.NoError(t, err)

	resp, body := a.post(t, "/v1/completions", `{"model":"troupe-omni-sim","prompt":"hi","max_tokens":4}`)
	d := wantError(t, resp, body, http.StatusBadGateway, typeServer, "stage_failed")
	assert.Contains(t, d.Message, `stage "thinker" failed on replica 0`)
	assert.Contains(t, d.Message, resp.Header.Get("X-Request-Id"), "the request id leads to the log line")
	assert.NotContains(t, d.Message, w.Addr())
	assertNoInternals(t, d.Message)
	assert.Contains(t, log.String(), w.Addr(), "the head's log names the replica's address")

	// Not ready, and no replica: OpenAI-shaped, named by stage, no chain.
	w.Stop(t)
	require.Eventually(t, func() bool { ok, _ := c.Head.Ready(); return !ok }, wait, 10*time.Millisecond)
	resp, body = a.post(t, "/v1/completions", `{"model":"troupe-omni-sim","prompt":"hi","max_tokens":4}`)
	d = wantError(t, resp, body, http.StatusServiceUnavailable, typeServer, "no_replica")
	assert.Equal(t, `stage "thinker" has no routable replica; retry shortly`, d.Message)
	resp, body = a.do(t, "GET", "/readyz", nil, nil)
	d = wantError(t, resp, body, http.StatusServiceUnavailable, typeServer, "not_ready")
	assert.Contains(t, d.Message, "thinker")
}

// TestNetHTTPErrorsAreOpenAIShaped: the errors net/http answers before any
// handler runs come in the same JSON shape as every other error.
func TestNetHTTPErrorsAreOpenAIShaped(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{Pipeline: textPipeline()})
	a := startAPI(t, c, Config{}, nil, nil)
	raw := func(t *testing.T, request string) (*http.Response, []byte) {
		t.Helper()
		conn, err := net.Dial("tcp", strings.TrimPrefix(a.base, "http://"))
		require.NoError(t, err)
		defer conn.Close()
		require.NoError(t, conn.SetDeadline(time.Now().Add(wait)))
		_, err = io.WriteString(conn, request)
		require.NoError(t, err)
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		require.NoError(t, err)
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp, body
	}
	for _, tc := range []struct {
		name, request string
		status        int
		code, message string
	}{
		{"headers too large", "GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + strings.Repeat("b", 80<<10) + "\r\n\r\n",
			http.StatusRequestHeaderFieldsTooLarge, "headers_too_large", "the request's header fields are too large"},
		{"missing host", "GET /v1/models HTTP/1.1\r\n\r\n", http.StatusBadRequest, "bad_request", "malformed request: missing required Host header"},
		{"bad header name", "GET /v1/models HTTP/1.1\r\nHost: x\r\nBad Name: y\r\n\r\n", http.StatusBadRequest, "bad_request", "malformed request"},
		{"unknown transfer encoding", "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: rot13\r\n\r\n", http.StatusNotImplemented, "not_implemented", "unsupported transfer encoding"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, body := raw(t, tc.request)
			require.Equal(t, tc.status, resp.StatusCode, "body: %s", body)
			assert.Equal(t, "application/json", resp.Header.Get("Content-Type"))
			var eb errorBody
			require.NoError(t, json.Unmarshal(body, &eb), "body: %s", body)
			assert.Equal(t, typeInvalidRequest, eb.Error.Type)
			require.NotNil(t, eb.Error.Code)
			assert.Equal(t, tc.code, *eb.Error.Code)
			assert.True(t, strings.HasPrefix(eb.Error.Message, tc.message), "message %q", eb.Error.Message)
			assert.Nil(t, eb.Error.Param)
		})
	}

	// A handler's text/plain answer on the same listener is untouched.
	resp, body := raw(t, "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, "ok\n", string(body))
}

// TestUncleanPaths: a double slash, as a base URL with a trailing slash
// makes it, is served; no redirect (which clients do not follow for POST)
// and no HTML.
func TestUncleanPaths(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{Pipeline: textPipeline()})
	a := startAPI(t, c, Config{APIKey: "k"}, nil, nil)
	auth := http.Header{"Authorization": {"Bearer k"}}
	noRedirect := &http.Client{Transport: a.client.Transport, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	for _, path := range []string{"//v1/chat/completions", "/v1//chat/completions", "/v1/./chat/completions", "/v1/x/../chat/completions"} {
		req, err := http.NewRequestWithContext(testCtx(t), "POST", a.base+path,
			strings.NewReader(`{"model":"troupe-omni-sim","messages":[{"role":"user","content":"hi"}],"max_tokens":3}`))
		require.NoError(t, err)
		req.Header = auth.Clone()
		resp, err := noRedirect.Do(req)
		require.NoError(t, err)
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode, "%s: %s", path, body)
		assert.Contains(t, string(body), `"object":"chat.completion"`, path)
	}
	// The key is checked on the cleaned path too.
	resp, body := a.do(t, "GET", "//v1/replicas", nil, nil)
	wantError(t, resp, body, http.StatusUnauthorized, typeAuthentication, "invalid_api_key")
	resp, body = a.do(t, "GET", "/v1/../metrics/../v1/nothing", nil, auth)
	wantError(t, resp, body, http.StatusNotFound, typeNotFound, "not_found")
}

// TestParameterChoices: ignored parameters are reported in a header,
// refused ones name themselves, echo is honoured.
func TestParameterChoices(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{Pipeline: textPipeline()})
	a := startAPI(t, c, Config{}, nil, nil)
	client := a.openai()
	ctx := testCtx(t)

	var raw *http.Response
	p := chatParams("hello", 1, 4)
	p.TopP = openai.Float(0.5)
	p.User = openai.String("u1")
	p.Tools = []openai.ChatCompletionToolUnionParam{openai.ChatCompletionFunctionTool(openai.FunctionDefinitionParam{Name: "lookup"})}
	p.ToolChoice = openai.ChatCompletionToolChoiceOptionUnionParam{OfAuto: openai.String("auto")}
	_, err := client.Chat.Completions.New(ctx, p, option.WithResponseInto(&raw))
	require.NoError(t, err)
	assert.Equal(t, "tools", raw.Header.Get(ignoredHeader), "user is a session key, not ignored; top_p is passed on")

	_, err = client.Chat.Completions.New(ctx, chatParams("hello", 1, 4), option.WithResponseInto(&raw))
	require.NoError(t, err)
	assert.Empty(t, raw.Header.Values(ignoredHeader), "nothing ignored, no header")

	p = chatParams("hello", 1, 4)
	p.ResponseFormat = openai.ChatCompletionNewParamsResponseFormatUnion{OfJSONObject: &openai.ResponseFormatJSONObjectParam{}}
	_, err = client.Chat.Completions.New(ctx, p)
	oe := apiErrorOf(t, err)
	assert.Equal(t, http.StatusBadRequest, oe.StatusCode)
	assert.Equal(t, "response_format", oe.Param)

	p = chatParams("hello", 1, 4)
	p.Logprobs = openai.Bool(true)
	_, err = client.Chat.Completions.New(ctx, p)
	assert.Equal(t, "logprobs", apiErrorOf(t, err).Param)

	// echo: the prompt, then the completion, whole and streamed alike.
	plain, err := client.Completions.New(ctx, openai.CompletionNewParams{
		Model: model, Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("once upon a time")},
		MaxTokens: openai.Int(5), Seed: openai.Int(2),
	})
	require.NoError(t, err)
	echoed := openai.CompletionNewParams{
		Model: model, Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("once upon a time")},
		MaxTokens: openai.Int(5), Seed: openai.Int(2), Echo: openai.Bool(true),
	}
	whole, err := client.Completions.New(ctx, echoed)
	require.NoError(t, err)
	assert.Equal(t, "once upon a time"+plain.Choices[0].Text, whole.Choices[0].Text)
	stream := client.Completions.NewStreaming(ctx, echoed)
	var text strings.Builder
	for stream.Next() {
		if ch := stream.Current(); len(ch.Choices) > 0 {
			text.WriteString(ch.Choices[0].Text)
		}
	}
	require.NoError(t, stream.Err())
	require.NoError(t, stream.Close())
	assert.Equal(t, whole.Choices[0].Text, text.String())
}

// syncBuffer is a bytes.Buffer safe for a logger and a test at once.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// textPipeline is the thinker alone: the edges here are all stage 0's.
func textPipeline() orchestrator.Pipeline {
	return orchestrator.Pipeline{Model: model, Stages: []orchestrator.Stage{{Name: "thinker"}}}
}
