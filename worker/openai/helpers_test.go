package openai_test

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/troupe-serving/troupe/internal/front/httpapi"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker/openai"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// wait bounds every wait on a condition; generous for a loaded machine.
const wait = 30 * time.Second

func testCtx(t testing.TB) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

// upstreamHead is a real OpenAI-compatible server: a troupe head (real
// etcd, sim workers over gRPC) behind its HTTP API on loopback.
type upstreamHead struct {
	*orchestratortest.Cluster
	base string // http://127.0.0.1:port/v1
}

func startUpstreamHead(t testing.TB, opts orchestratortest.Options) *upstreamHead {
	t.Helper()
	opts.Sim.Logger = quiet()
	c := orchestratortest.Start(t, opts)
	return &upstreamHead{Cluster: c, base: serveAPI(t, c) + "/v1"}
}

// serveAPI serves the cluster head's HTTP API on loopback until the test
// ends and returns its root URL.
func serveAPI(t testing.TB, c *orchestratortest.Cluster) string {
	t.Helper()
	srv := httpapi.NewHTTPServer("127.0.0.1:0", httpapi.New(c.Head, httpapi.Config{Logger: quiet(), Gatherer: c.Metrics}).Handler())
	lis, err := net.Listen("tcp", srv.Addr)
	require.NoError(t, err)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), wait)
		defer cancel()
		if err := srv.Shutdown(ctx); err != nil {
			_ = srv.Close()
		}
		require.ErrorIs(t, <-served, http.ErrServerClosed)
	})
	return "http://" + lis.Addr().String()
}

// runner is what both engines offer to be watched.
type runner interface {
	Run(ctx context.Context) error
	Available() (bool, <-chan struct{})
}

// monitor is an engine's Run, owned by the test.
type monitor struct {
	cancel context.CancelFunc
	done   chan error
}

// run starts the engine's monitor until the test ends.
func run(t testing.TB, e runner) *monitor {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	m := &monitor{cancel: cancel, done: make(chan error, 1)}
	go func() { m.done <- e.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-m.done:
		case <-time.After(wait):
			t.Error("engine monitor did not stop")
		}
	})
	return m
}

// result waits for Run to return on its own.
func (m *monitor) result(t testing.TB) error {
	t.Helper()
	select {
	case err := <-m.done:
		m.done <- err // for the cleanup
		return err
	case <-time.After(wait):
		t.Fatal("engine monitor did not return")
		return nil
	}
}

// waitAvailable waits until the engine says it is available.
func waitAvailable(t testing.TB, e runner, want bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	for {
		ok, changed := e.Available()
		if ok == want {
			return
		}
		select {
		case <-changed:
		case <-ctx.Done():
			t.Fatalf("engine never became available=%v", want)
		}
	}
}

// startText builds a text engine on url and waits until it is available.
func startText(t testing.TB, cfg openai.Config) *openai.Engine {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = quiet()
	}
	e, err := openai.New(cfg)
	require.NoError(t, err)
	run(t, e)
	waitAvailable(t, e, true)
	return e
}

// collect runs one request and returns its chunks.
func collect(ctx context.Context, e interface {
	Generate(context.Context, *stagepb.GenerateRequest, func(*stagepb.GenerateChunk) error) error
}, req *stagepb.GenerateRequest) ([]*stagepb.GenerateChunk, error) {
	var chunks []*stagepb.GenerateChunk
	err := e.Generate(ctx, req, func(c *stagepb.GenerateChunk) error {
		chunks = append(chunks, c)
		return nil
	})
	return chunks, err
}

func joinText(chunks []*stagepb.GenerateChunk) string {
	s := ""
	for _, c := range chunks {
		s += c.GetText()
	}
	return s
}

func chatReq(sp *stagepb.SamplingParams, msgs ...*stagepb.ChatMessage) *stagepb.GenerateRequest {
	return &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Chat{Chat: &stagepb.Chat{Messages: msgs}}, Sampling: sp}
}

func msg(role, content string) *stagepb.ChatMessage {
	return &stagepb.ChatMessage{Role: role, Content: content}
}

// fake is a small OpenAI-compatible server on loopback whose routes each
// test sets: for upstream failures a troupe head cannot produce (cut
// streams, 429s, slow starts, flapping health, vLLM metrics and sleep).
type fake struct {
	*httptest.Server
	mu      sync.Mutex
	routes  map[string]http.HandlerFunc
	bodies  []map[string]any // decoded JSON bodies of POSTs, in order
	headers []http.Header
	ownedBy string // the model's owned_by in /v1/models ("vllm": a vLLM server)
}

// newFake serves /health and /v1/models (model "m") until routes say
// otherwise.
func newFake(t testing.TB) *fake { return newFakeWith(t, nil) }

// newFakeWith is newFake with tweak applied to the server before it starts.
func newFakeWith(t testing.TB, tweak func(*http.Server)) *fake {
	t.Helper()
	f := &fake{routes: map[string]http.HandlerFunc{
		"GET /health": func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) },
	}}
	f.routes["GET /v1/models"] = func(w http.ResponseWriter, _ *http.Request) {
		f.mu.Lock()
		owner := f.ownedBy
		f.mu.Unlock()
		_, _ = io.WriteString(w, `{"object":"list","data":[{"id":"m","object":"model","owned_by":"`+owner+`"}]}`)
	}
	f.Server = httptest.NewUnstartedServer(http.HandlerFunc(f.serve))
	if tweak != nil {
		tweak(f.Config)
	}
	f.Start()
	t.Cleanup(f.Close)
	return f
}

// newVLLM is newFake saying it is vLLM (owned_by "vllm"): it continues
// chat answers and reports usage on every chunk.
func newVLLM(t testing.TB) *fake {
	t.Helper()
	f := newFake(t)
	f.mu.Lock()
	f.ownedBy = "vllm"
	f.mu.Unlock()
	return f
}

// sumStats adds up the token counts of all chunks, as the head does.
func sumStats(chunks []*stagepb.GenerateChunk) (prompt, generated uint64) {
	for _, c := range chunks {
		prompt += c.GetStats().GetPromptTokens()
		generated += c.GetStats().GetGenerationTokens()
	}
	return prompt, generated
}

func (f *fake) serve(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	h := f.routes[r.Method+" "+r.URL.Path]
	if r.Method == http.MethodPost {
		var body map[string]any
		if data, err := io.ReadAll(r.Body); err == nil && len(data) > 0 {
			_ = json.Unmarshal(data, &body)
		}
		f.bodies = append(f.bodies, body)
		f.headers = append(f.headers, r.Header.Clone())
	}
	f.mu.Unlock()
	if h == nil {
		http.NotFound(w, r)
		return
	}
	h(w, r)
}

func (f *fake) route(pattern string, h http.HandlerFunc) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.routes[pattern] = h
}

func (f *fake) lastBody() map[string]any {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.bodies) == 0 {
		return nil
	}
	return f.bodies[len(f.bodies)-1]
}

func (f *fake) posts() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.bodies)
}

// sse writes server-sent events, flushing each.
func sse(w http.ResponseWriter, events ...string) {
	w.Header().Set("Content-Type", "text/event-stream")
	for _, e := range events {
		_, _ = io.WriteString(w, "data: "+e+"\n\n")
		w.(http.Flusher).Flush()
	}
}

// delta is a chat chunk with content.
func delta(s string) string {
	b, _ := json.Marshal(map[string]any{"object": "chat.completion.chunk", "choices": []any{map[string]any{"index": 0, "delta": map[string]any{"content": s}, "finish_reason": nil}}})
	return string(b)
}

func finish(reason string) string {
	return `{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"` + reason + `"}]}`
}

func usageEvent(prompt, completion, cached int) string {
	b, _ := json.Marshal(map[string]any{"object": "chat.completion.chunk", "choices": []any{},
		"usage": map[string]any{"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
			"prompt_tokens_details": map[string]any{"cached_tokens": cached}}})
	return string(b)
}
