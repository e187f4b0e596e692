package openai_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker/openai"
)

// TestRequestBody: the conversation, model and sampling parameters reach
// the upstream as the OpenAI API spells them; unset ones are left out; the
// API key is sent.
func TestRequestBody(t *testing.T) {
	f := newFake(t)
	f.route("POST /v1/chat/completions", func(w http.ResponseWriter, _ *http.Request) {
		sse(w, delta("hi"), finish("stop"), usageEvent(5, 1, 0), "[DONE]")
	})
	e := startText(t, openai.Config{URL: f.URL + "/v1", APIKey: "sk-secret"})
	_, err := collect(testCtx(t), e, chatReq(&stagepb.SamplingParams{MaxTokens: 9, Temperature: proto.Float32(0), Seed: proto.Int64(-4), Stop: []string{"x", "yz"}, IgnoreEos: true},
		msg("system", "be brief"), msg("user", "hello")))
	require.NoError(t, err)
	b := f.lastBody()
	assert.Equal(t, "m", b["model"])
	assert.Equal(t, true, b["stream"])
	assert.Equal(t, map[string]any{"include_usage": true}, b["stream_options"])
	assert.Equal(t, []any{map[string]any{"role": "system", "content": "be brief"}, map[string]any{"role": "user", "content": "hello"}}, b["messages"])
	assert.EqualValues(t, 9, b["max_tokens"])
	assert.NotContains(t, b, "max_completion_tokens", "the client did not name it")
	assert.Contains(t, b, "temperature", "temperature 0 is sent: it is set")
	assert.EqualValues(t, 0, b["temperature"])
	assert.EqualValues(t, -4, b["seed"])
	assert.Equal(t, []any{"x", "yz"}, b["stop"])
	assert.Equal(t, true, b["ignore_eos"])
	f.mu.Lock()
	assert.Equal(t, "Bearer sk-secret", f.headers[len(f.headers)-1].Get("Authorization"))
	f.mu.Unlock()

	// The client named the limit max_completion_tokens: it goes under
	// that name and as max_tokens, the one every server reads (Ollama
	// ignores the other).
	_, err = collect(testCtx(t), e, chatReq(&stagepb.SamplingParams{MaxTokens: 9, MaxCompletionTokens: true}, msg("user", "hello")))
	require.NoError(t, err)
	b = f.lastBody()
	assert.EqualValues(t, 9, b["max_completion_tokens"])
	assert.EqualValues(t, 9, b["max_tokens"])

	_, err = collect(testCtx(t), e, chatReq(nil, msg("user", "hello")))
	require.NoError(t, err)
	b = f.lastBody()
	for _, k := range []string{"max_tokens", "max_completion_tokens", "temperature", "seed", "stop", "ignore_eos", "prompt", "continue_final_message", "add_generation_prompt"} {
		assert.NotContains(t, b, k)
	}

	// A migrated answer: an upstream that is not vLLM cannot continue the
	// assistant's turn, so nothing is sent.
	cont := chatReq(nil, msg("user", "hello"))
	cont.Continuation = "Hello there,"
	posts := f.posts()
	_, err = collect(testCtx(t), e, cont)
	assert.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
	assert.Equal(t, posts, f.posts(), "a continuation the upstream cannot honour is not sent")
	assert.False(t, e.Health().GetContinuesChat())

	// vLLM: the delivered text is the assistant's unfinished turn,
	// continued rather than answered.
	f = newVLLM(t)
	f.route("POST /v1/chat/completions", func(w http.ResponseWriter, _ *http.Request) {
		sse(w, delta("hi"), finish("stop"), usageEvent(5, 1, 0), "[DONE]")
	})
	e = startText(t, openai.Config{URL: f.URL})
	assert.True(t, e.Health().GetContinuesChat())
	_, err = collect(testCtx(t), e, cont)
	require.NoError(t, err)
	b = f.lastBody()
	assert.Equal(t, map[string]any{"include_usage": true, "continuous_usage_stats": true}, b["stream_options"])
	assert.Equal(t, []any{map[string]any{"role": "user", "content": "hello"}, map[string]any{"role": "assistant", "content": "Hello there,"}}, b["messages"])
	assert.Equal(t, true, b["continue_final_message"])
	assert.Equal(t, false, b["add_generation_prompt"])
}

// TestUsageAndFinish: usage is taken as the upstream reports it, cached
// prompt tokens included; finish reasons keep their meaning.
func TestUsageAndFinish(t *testing.T) {
	f := newFake(t)
	reason := "length"
	f.route("POST /v1/chat/completions", func(w http.ResponseWriter, _ *http.Request) {
		sse(w, delta("a"), delta(" b"), finish(reason), usageEvent(100, 2, 64), "[DONE]")
	})
	e := startText(t, openai.Config{URL: f.URL})
	chunks, err := collect(testCtx(t), e, chatReq(nil, msg("user", "x")))
	require.NoError(t, err)
	require.Len(t, chunks, 3)
	assert.Equal(t, "a b", joinText(chunks))
	last := chunks[2].GetStats()
	assert.Equal(t, stagepb.FinishReason_FINISH_REASON_LENGTH, chunks[2].GetFinishReason())
	assert.Equal(t, uint64(100), last.GetPromptTokens())
	prompt, generated := sumStats(chunks)
	assert.Equal(t, uint64(100), prompt)
	assert.Equal(t, uint64(2), generated)
	assert.Equal(t, uint64(64), last.GetPromptTokensLocalCacheHit())
	assert.Equal(t, uint64(36), last.GetPromptTokensLocalCompute())

	for upstream, want := range map[string]stagepb.FinishReason{
		"stop": stagepb.FinishReason_FINISH_REASON_STOP, "abort": stagepb.FinishReason_FINISH_REASON_ABORT,
		"tool_calls": stagepb.FinishReason_FINISH_REASON_STOP,
	} {
		reason = upstream
		chunks, err := collect(testCtx(t), e, chatReq(nil, msg("user", "x")))
		require.NoError(t, err)
		assert.Equal(t, want, chunks[len(chunks)-1].GetFinishReason(), upstream)
	}
}

// TestNullFinishIsStop: a stream the upstream ends itself ([DONE]) with
// finish_reason null (Ollama) or an unknown reason ended normally: stop.
func TestNullFinishIsStop(t *testing.T) {
	for name, handler := range map[string]http.HandlerFunc{
		"done without finish": func(w http.ResponseWriter, _ *http.Request) {
			sse(w, delta("one"), delta(" two"), "[DONE]")
		},
		"null finish and usage": func(w http.ResponseWriter, _ *http.Request) {
			sse(w, delta("one"), delta(" two"), `{"choices":[{"index":0,"delta":{},"finish_reason":null}]}`, usageEvent(3, 2, 0), "[DONE]")
		},
		"unknown finish": func(w http.ResponseWriter, _ *http.Request) {
			sse(w, delta("one"), delta(" two"), finish("eos_token"), "[DONE]")
		},
	} {
		t.Run(name, func(t *testing.T) {
			f := newFake(t)
			f.route("POST /v1/chat/completions", handler)
			e := startText(t, openai.Config{URL: f.URL})
			chunks, err := collect(testCtx(t), e, chatReq(nil, msg("user", "x")))
			require.NoError(t, err)
			assert.Equal(t, "one two", joinText(chunks))
			assert.Equal(t, stagepb.FinishReason_FINISH_REASON_STOP, chunks[len(chunks)-1].GetFinishReason())
			_, generated := sumStats(chunks)
			assert.Equal(t, uint64(2), generated)
		})
	}
}

// TestStreamCut: an upstream that dies mid-answer (the connection killed
// or reset, a chunk of the response cut short), sends an error event, or
// ends its response before any text is a stage failure (Unavailable),
// never a truncated success: no chunk with a finish reason is emitted.
// (A response read to its end after text ended normally:
// TestCleanEndWithoutFinishIsStop.)
func TestStreamCut(t *testing.T) {
	for name, tc := range map[string]struct {
		handler http.HandlerFunc
		want    string // the text streamed before the failure
		prefix  bool   // want may arrive cut short (a reset can drop what the client had not read yet)
	}{
		"connection killed": {handler: func(w http.ResponseWriter, _ *http.Request) {
			sse(w, delta("one"), delta(" two"))
			panic(http.ErrAbortHandler) // the server drops the connection
		}, want: "one two"},
		"truncated chunk": {handler: func(w http.ResponseWriter, _ *http.Request) {
			hijacked(w, httpChunk("data: "+delta("one")+"\n\n")+httpChunk("data: "+delta(" two")+"\n\n")+
				"40\r\ndata: {\"choi", false) // a chunk of 64 bytes, cut after 12
		}, want: "one two"},
		"connection reset": {handler: func(w http.ResponseWriter, _ *http.Request) {
			hijacked(w, httpChunk("data: "+delta("one")+"\n\n")+httpChunk("data: "+delta(" two")+"\n\n"), true)
		}, want: "one two", prefix: true},
		"ends before any text": {handler: func(w http.ResponseWriter, _ *http.Request) {
			sse(w, `{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}`)
		}},
		"error event": {handler: func(w http.ResponseWriter, _ *http.Request) {
			sse(w, delta("one"), delta(" two"), `{"error":{"message":"engine died","type":"InternalServerError","code":500}}`)
		}, want: "one two"},
	} {
		t.Run(name, func(t *testing.T) {
			f := newFake(t)
			f.route("POST /v1/chat/completions", tc.handler)
			e := startText(t, openai.Config{URL: f.URL})
			chunks, err := collect(testCtx(t), e, chatReq(nil, msg("user", "x")))
			assert.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
			if tc.prefix {
				assert.True(t, strings.HasPrefix(tc.want, joinText(chunks)), "%q", joinText(chunks))
			} else {
				assert.Equal(t, tc.want, joinText(chunks), "what came before the cut was streamed")
			}
			for _, c := range chunks {
				assert.Equal(t, stagepb.FinishReason_FINISH_REASON_UNSPECIFIED, c.GetFinishReason())
			}
			if name == "error event" {
				assert.Contains(t, status.Convert(err).Message(), "engine died")
			}
		})
	}
}

// hijacked answers 200 with a chunked event stream whose body is raw
// (chunks as httpChunk makes them), written on the bare connection, and
// then closes the connection: with a reset (RST) when reset is set.
func hijacked(w http.ResponseWriter, raw string, reset bool) {
	c, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		panic(http.ErrAbortHandler)
	}
	_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"+raw)
	if reset {
		_ = c.(*net.TCPConn).SetLinger(0) // Close sends RST
	}
	_ = c.Close()
}

// httpChunk is s as one chunk of a chunked HTTP/1.1 body.
func httpChunk(s string) string { return fmt.Sprintf("%x\r\n%s\r\n", len(s), s) }

// TestStreamEventEdges: the stream is read by pkg/sse's rules. A last
// event that no blank line ends is still read (an upstream that closes
// after its last line loses nothing); a bare "data" line is an empty data
// field, as "data:" is, so an event of it alone is malformed.
func TestStreamEventEdges(t *testing.T) {
	f := newFake(t)
	f.route("POST /v1/chat/completions", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: "+delta("one")+"\n\n: ping\r\ndata:"+delta(" two")+"\r\n\r\ndata: "+finish("stop"))
	})
	e := startText(t, openai.Config{URL: f.URL})
	chunks, err := collect(testCtx(t), e, chatReq(nil, msg("user", "x")))
	require.NoError(t, err)
	assert.Equal(t, "one two", joinText(chunks))
	assert.Equal(t, stagepb.FinishReason_FINISH_REASON_STOP, chunks[len(chunks)-1].GetFinishReason())

	for _, empty := range []string{"data:", "data"} {
		f.route("POST /v1/chat/completions", func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, "data: "+delta("one")+"\n\n"+empty+"\n\ndata: [DONE]\n\n")
		})
		_, err := collect(testCtx(t), e, chatReq(nil, msg("user", "x")))
		assert.Equal(t, codes.Internal, status.Code(err), "%s: %v", empty, err)
	}
}

// TestStatusCodes: upstream errors keep their meaning as gRPC codes, with
// the upstream's message.
func TestStatusCodes(t *testing.T) {
	for _, tc := range []struct {
		status int
		body   string
		want   codes.Code
		msg    string
	}{
		{400, `{"error":{"message":"This model's maximum context length is 4096 tokens","type":"BadRequestError","code":400}}`, codes.InvalidArgument, "This model's maximum context length is 4096 tokens"},
		{400, `{"object":"error","message":"older vLLM error","type":"BadRequestError","code":400}`, codes.InvalidArgument, "older vLLM error"},
		{422, `{"detail":[{"type":"missing","loc":["body","messages"],"msg":"Field required"}]}`, codes.InvalidArgument, "body.messages: Field required"},
		{429, `{"error":{"message":"slow down"}}`, codes.Unavailable, "slow down"},
		{503, `overloaded`, codes.Unavailable, "overloaded"},
		{502, ``, codes.Unavailable, "Bad Gateway"},
		{500, `{"error":{"message":"boom"}}`, codes.Internal, "boom"},
		{401, `{"error":{"message":"bad key"}}`, codes.Unauthenticated, "bad key"},
		{404, `{"error":{"message":"The model m does not exist."}}`, codes.Internal, "does not exist"}, // at runtime, as docs/engines.md says
	} {
		f := newFake(t)
		f.route("POST /v1/chat/completions", func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(tc.status)
			_, _ = io.WriteString(w, tc.body)
		})
		e := startText(t, openai.Config{URL: f.URL})
		chunks, err := collect(testCtx(t), e, chatReq(nil, msg("user", "x")))
		assert.Empty(t, chunks)
		assert.Equal(t, tc.want, status.Code(err), "%d: %v", tc.status, err)
		assert.Contains(t, status.Convert(err).Message(), tc.msg, "%d", tc.status)
	}
}

// TestConnectionRefused: an upstream that is gone is Unavailable.
func TestConnectionRefused(t *testing.T) {
	f := newFake(t)
	e := startText(t, openai.Config{URL: f.URL, HealthInterval: time.Hour})
	f.Close()
	_, err := collect(testCtx(t), e, chatReq(nil, msg("user", "x")))
	assert.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
}

// TestSlowStart: while the upstream loads (health 503, no models yet) the
// engine is not available; it becomes available once the upstream is
// ready. An upstream never ready within the timeout fails Run.
func TestSlowStart(t *testing.T) {
	f := newFake(t)
	var healthy atomic.Bool
	var checks atomic.Int32
	f.route("GET /health", func(w http.ResponseWriter, _ *http.Request) {
		checks.Add(1)
		if !healthy.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	})
	e, err := openai.New(openai.Config{URL: f.URL, Logger: quiet()})
	require.NoError(t, err)
	run(t, e)
	require.Eventually(t, func() bool { return checks.Load() >= 2 }, wait, time.Millisecond)
	ok, _ := e.Available()
	assert.False(t, ok, "not available while the upstream loads")
	h := e.Health()
	assert.Equal(t, stagepb.ServingStatus_SERVING_STATUS_NOT_SERVING, h.GetStatus())
	assert.Contains(t, h.GetStatusMessage(), "GET /health: 503")
	_, err = collect(testCtx(t), e, chatReq(nil, msg("user", "x")))
	assert.Equal(t, codes.Unavailable, status.Code(err))
	assert.Zero(t, f.posts(), "nothing sent to an upstream that is not ready")
	healthy.Store(true)
	waitAvailable(t, e, true)

	// Never ready.
	g := newFake(t)
	g.route("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusServiceUnavailable) })
	e2, err := openai.New(openai.Config{URL: g.URL, ReadyTimeout: 1500 * time.Millisecond, Logger: quiet()})
	require.NoError(t, err)
	err = run(t, e2).result(t)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "not ready after 1.5s (--upstream-ready-timeout)")
	assert.Contains(t, err.Error(), "503")
}

// TestNoHealthEndpoint: an upstream without /health (Ollama) is checked
// through its model list.
func TestNoHealthEndpoint(t *testing.T) {
	f := newFake(t)
	f.route("GET /health", nil)
	var models atomic.Bool
	var asked atomic.Int32
	f.route("GET /v1/models", func(w http.ResponseWriter, _ *http.Request) {
		asked.Add(1)
		if !models.Load() {
			_, _ = io.WriteString(w, `{"object":"list","data":[]}`)
			return
		}
		_, _ = io.WriteString(w, `{"object":"list","data":[{"id":"llama3.2:1b"},{"id":"qwen"}]}`)
	})
	e, err := openai.New(openai.Config{URL: f.URL, Logger: quiet()})
	require.NoError(t, err)
	run(t, e)
	require.Eventually(t, func() bool { return asked.Load() >= 2 }, wait, time.Millisecond)
	ok, _ := e.Available()
	assert.False(t, ok)
	models.Store(true)
	waitAvailable(t, e, true)
	assert.Equal(t, "llama3.2:1b", e.Model())
}

// TestAPIKeyRefused: a refused key is a startup error, not a wait.
func TestAPIKeyRefused(t *testing.T) {
	f := newFake(t)
	f.route("GET /v1/models", func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer right" {
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		_, _ = io.WriteString(w, `{"data":[{"id":"m"}]}`)
	})
	e, err := openai.New(openai.Config{URL: f.URL, APIKey: "wrong", Logger: quiet()})
	require.NoError(t, err)
	err = run(t, e).result(t)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "refused the API key")
	startText(t, openai.Config{URL: f.URL, APIKey: "right"})
}

// TestSlowUpstreamHeaders: a request whose upstream never answers ends
// when its context does.
func TestSlowUpstreamHeaders(t *testing.T) {
	f := newFake(t)
	release := make(chan struct{})
	f.route("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-release:
		}
	})
	defer close(release)
	e := startText(t, openai.Config{URL: f.URL})
	ctx, cancel := context.WithTimeout(testCtx(t), 200*time.Millisecond)
	defer cancel()
	_, err := collect(ctx, e, chatReq(nil, msg("user", "x")))
	require.ErrorIs(t, err, context.DeadlineExceeded)
}

func closedAddr(t *testing.T) string {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := lis.Addr().String()
	require.NoError(t, lis.Close())
	return addr
}

// TestUnreachableAtStart: nothing listens: Run keeps waiting (and says so
// in Health) until its timeout.
func TestUnreachableAtStart(t *testing.T) {
	e, err := openai.New(openai.Config{URL: "http://" + closedAddr(t) + "/v1", ReadyTimeout: time.Second, Logger: quiet()})
	require.NoError(t, err)
	err = run(t, e).result(t)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "not ready after 1s")
	assert.True(t, strings.Contains(err.Error(), "connection refused"), err.Error())
}

// TestConnectionsReused: requests reuse the upstream connection (the end
// of each stream is read), so a busy worker does not open a connection
// per request.
func TestConnectionsReused(t *testing.T) {
	var conns atomic.Int32
	f := newFakeWith(t, func(s *http.Server) {
		s.ConnState = func(_ net.Conn, s http.ConnState) {
			if s == http.StateNew {
				conns.Add(1)
			}
		}
	})
	chatting(f)
	e := startText(t, openai.Config{URL: f.URL, HealthInterval: time.Hour})
	before := conns.Load()
	for range 20 {
		chunks, err := collect(testCtx(t), e, chatReq(nil, msg("user", "x")))
		require.NoError(t, err)
		require.Equal(t, "ok", joinText(chunks))
	}
	assert.LessOrEqual(t, conns.Load()-before, int32(1), "one connection for 20 sequential requests")
}

// contUsage is a chat chunk with text and vLLM's continuous usage: the
// counts so far, this chunk included.
func contUsage(s string, prompt, completion int) string {
	b, _ := json.Marshal(map[string]any{"object": "chat.completion.chunk",
		"choices": []any{map[string]any{"index": 0, "delta": map[string]any{"content": s}, "finish_reason": nil}},
		"usage":   map[string]any{"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}})
	return string(b)
}

// ollamaText is a /v1/completions chunk as Ollama sends it: its text and
// a usage of zeros.
func ollamaText(s string) string {
	b, _ := json.Marshal(map[string]any{"object": "text_completion",
		"choices": []any{map[string]any{"index": 0, "text": s, "finish_reason": nil}},
		"usage":   map[string]any{"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}})
	return string(b)
}

// TestTokenAccounting: every text chunk carries the tokens it holds, so
// the counts are right when the answer is cut, and they add up to the
// upstream's final usage: one token per delta; several per delta reported
// on every chunk (vLLM's continuous usage); several per delta with usage
// only at the end (the final chunk makes up the difference). Usage that
// contradicts the text sent is not believed: zeros on chunks of text
// (Ollama's /v1/completions), a count that goes back, a final count below
// what was sent; the chunks then count one token per delta.
func TestTokenAccounting(t *testing.T) {
	for _, tc := range []struct {
		name        string
		vllm        bool
		completions bool // a text prompt, to /v1/completions
		events      []string
		perChunk    []uint64 // generation tokens of the text chunks
		final       uint64
		prompt      uint64 // on the first text chunk
		wantTotal   uint64
		wantPrompt  uint64
	}{
		{"one per delta", false, false, []string{delta("a"), delta("b"), delta("c"), finish("stop"), usageEvent(7, 3, 0), "[DONE]"}, []uint64{1, 1, 1}, 0, 0, 3, 7},
		{"several per delta, usage on each", true, false, []string{contUsage("ab", 7, 2), contUsage("cde", 7, 5), contUsage("f", 7, 6), finish("length"), usageEvent(7, 6, 0), "[DONE]"}, []uint64{2, 3, 1}, 0, 7, 6, 7},
		{"several per delta, usage at the end", false, false, []string{delta("ab"), delta("cde"), finish("stop"), usageEvent(7, 5, 0), "[DONE]"}, []uint64{1, 1}, 3, 0, 5, 7},
		{"no usage at all", false, false, []string{delta("ab"), delta("cd"), finish("stop"), "[DONE]"}, []uint64{1, 1}, 0, 0, 2, 0},
		{"zeros on every chunk, then the final usage", false, true, []string{ollamaText("a"), ollamaText("bc"), ollamaText("d"), usageEvent(7, 5, 0), "[DONE]"}, []uint64{1, 1, 1}, 2, 0, 5, 7},
		{"zeros on every chunk and at the end", false, true, []string{ollamaText("a"), ollamaText("b"), ollamaText("c"), usageEvent(0, 0, 0), "[DONE]"}, []uint64{1, 1, 1}, 0, 0, 3, 0},
		{"zeros on every chunk, no final usage", false, true, []string{ollamaText("a"), ollamaText("b"), "[DONE]"}, []uint64{1, 1}, 0, 0, 2, 0},
		{"usage that goes back", true, false, []string{contUsage("ab", 7, 2), contUsage("c", 7, 1), contUsage("d", 7, 4), finish("stop"), usageEvent(7, 5, 0), "[DONE]"}, []uint64{2, 1, 1}, 1, 7, 5, 7},
		{"final usage below what was sent", false, false, []string{delta("a"), delta("b"), delta("c"), finish("stop"), usageEvent(7, 1, 0), "[DONE]"}, []uint64{1, 1, 1}, 0, 0, 3, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFake(t)
			if tc.vllm {
				f = newVLLM(t)
			}
			req := chatReq(nil, msg("user", "x"))
			route := "POST /v1/chat/completions"
			if tc.completions {
				req = &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Text{Text: "x"}}
				route = "POST /v1/completions"
			}
			f.route(route, func(w http.ResponseWriter, _ *http.Request) { sse(w, tc.events...) })
			e := startText(t, openai.Config{URL: f.URL})
			chunks, err := collect(testCtx(t), e, req)
			require.NoError(t, err)
			require.Len(t, chunks, len(tc.perChunk)+1)
			for i, want := range tc.perChunk {
				assert.Equal(t, want, chunks[i].GetStats().GetGenerationTokens(), "chunk %d", i)
			}
			assert.Equal(t, tc.prompt, chunks[0].GetStats().GetPromptTokens(), "prompt tokens on the first chunk when usage comes with it")
			assert.Equal(t, tc.final, chunks[len(chunks)-1].GetStats().GetGenerationTokens(), "the final chunk adds what the usage says beyond")
			prompt, generated := sumStats(chunks)
			assert.Equal(t, tc.wantTotal, generated)
			assert.Equal(t, tc.wantPrompt, prompt, "the prompt is counted once, from usage that is believed")
		})
	}
}

// TestInFlightLoad: an upstream without /metrics: the gauges are the
// requests this worker has in flight.
func TestInFlightLoad(t *testing.T) {
	f := newFake(t)
	release := make(chan struct{})
	started := make(chan struct{}, 3)
	f.route("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		sse(w, delta("a"))
		started <- struct{}{}
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		sse(w, finish("stop"), "[DONE]")
	})
	e := startText(t, openai.Config{URL: f.URL, HealthInterval: 10 * time.Millisecond})
	ctx := testCtx(t)
	errs := make(chan error, 3)
	for range 3 {
		go func() { _, err := collect(ctx, e, chatReq(nil, msg("user", "x"))); errs <- err }()
	}
	for range 3 {
		<-started
	}
	assert.Equal(t, uint32(3), e.Health().GetGauges().GetNumRequestsRunning())
	close(release)
	for range 3 {
		require.NoError(t, <-errs)
	}
	assert.Equal(t, uint32(0), e.Health().GetGauges().GetNumRequestsRunning())
	chunks, err := collect(ctx, e, chatReq(nil, msg("user", "x")))
	require.NoError(t, err)
	assert.Equal(t, uint32(1), chunks[0].GetStats().GetNumRequestsRunning(), "a chunk counts its own request")
	assert.Equal(t, uint32(0), chunks[len(chunks)-1].GetStats().GetNumRequestsRunning(), "the final chunk no longer does: the replica is idle after it")
}
