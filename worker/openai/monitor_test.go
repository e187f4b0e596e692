package openai_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"encoding/pem"
	"fmt"
	"io"
	"log"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/openai"
)

// chatting makes f answer every chat request with "ok".
func chatting(f *fake) *atomic.Int32 {
	var n atomic.Int32
	f.route("POST /v1/chat/completions", func(w http.ResponseWriter, _ *http.Request) {
		n.Add(1)
		sse(w, delta("ok"), finish("stop"), usageEvent(3, 1, 0), "[DONE]")
	})
	return &n
}

// flappy makes f's health answer 503 while down is set.
func flappy(f *fake) *atomic.Bool {
	var down atomic.Bool
	f.route("GET /health", func(w http.ResponseWriter, _ *http.Request) {
		if down.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	})
	return &down
}

// metricsFrom makes f serve the text from *text at /metrics and counts
// the scrapes.
func metricsFrom(f *fake, text *atomic.Pointer[string]) *atomic.Int32 {
	var n atomic.Int32
	f.route("GET /metrics", func(w http.ResponseWriter, _ *http.Request) {
		n.Add(1)
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		_, _ = io.WriteString(w, *text.Load())
	})
	return &n
}

// startWorker serves eng as a replica of stage in the cluster's etcd,
// with its monitor running, until the test ends.
func startWorker(t testing.TB, c *orchestratortest.Cluster, stage string, eng interface {
	worker.Engine
	runner
}) *worker.Server {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{Endpoints: c.Etcd.Endpoints(), DialTimeout: 5 * time.Second})
	require.NoError(t, err)
	srv, err := worker.New(worker.Config{Stage: stage, AutoID: true, Engine: eng, EtcdClient: cli, LeaseTTL: 3 * time.Second,
		DrainTimeout: 5 * time.Second, Version: "test", Logger: quiet()})
	require.NoError(t, err)
	run(t, eng)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			assert.NoError(t, err)
		case <-time.After(wait):
			t.Error("worker did not stop")
		}
		cli.Close()
	})
	select {
	case <-srv.Registered():
	case err := <-done:
		t.Fatalf("worker stopped: %v", err)
	case <-time.After(wait):
		t.Fatal("worker never registered")
	}
	return srv
}

// TestFlappingUpstream: an upstream that stops answering takes the replica
// out of rotation (its registration is revoked, the head detaches it and
// routes nothing to it, Health says NOT_SERVING and why), and brings it
// back under the same replica id when it answers again.
func TestFlappingUpstream(t *testing.T) {
	var headLog lockedBuffer
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, ReplicasPerStage: -1, Logger: slog.New(slog.NewJSONHandler(&headLog, nil))})
	f := newFake(t)
	served := chatting(f)
	down := flappy(f)
	e, err := openai.New(openai.Config{URL: f.URL, HealthInterval: 50 * time.Millisecond, HealthFailures: 2, Logger: quiet()})
	require.NoError(t, err)
	srv := startWorker(t, c, "thinker", e)
	id := srv.Member().ReplicaID
	assert.Equal(t, "m", srv.Member().Model, "the upstream's model is recorded")
	c.WaitState(t, "thinker", id, "attached")
	res, err := c.Head.Execute(testCtx(t), orchestrator.Request{ID: "1", Messages: []*stagepb.ChatMessage{msg("user", "hi")}}, nil)
	require.NoError(t, err)
	assert.Equal(t, "ok", res.Text)

	conn, err := grpc.NewClient(srv.Advertise(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer conn.Close()
	stage := stagepb.NewStageServiceClient(conn)
	grpcHealth := healthpb.NewHealthClient(conn)

	for round := range 2 {
		down.Store(true)
		c.WaitState(t, "thinker", id, "detached")
		require.Eventually(t, func() bool { return strings.Contains(headLog.String(), `"reason":"left: not serving: `) }, wait, 5*time.Millisecond,
			"the head says why the replica left: its Health's message, not \"does not answer\"")
		assert.NotContains(t, headLog.String(), "does not answer")
		h, err := stage.Health(testCtx(t), &stagepb.HealthRequest{})
		require.NoError(t, err)
		assert.Equal(t, stagepb.ServingStatus_SERVING_STATUS_NOT_SERVING, h.GetStatus())
		assert.Contains(t, h.GetStatusMessage(), "health checks failed in a row")
		gh, err := grpcHealth.Check(testCtx(t), &healthpb.HealthCheckRequest{})
		require.NoError(t, err)
		assert.Equal(t, healthpb.HealthCheckResponse_NOT_SERVING, gh.GetStatus())
		before := served.Load()
		_, err = c.Head.Execute(testCtx(t), orchestrator.Request{ID: fmt.Sprint("down", round), Prompt: "hi"}, nil)
		require.ErrorIs(t, err, orchestrator.ErrNoReplica, "nothing routed to a replica whose engine is down")
		assert.Equal(t, before, served.Load())

		down.Store(false)
		st := c.WaitState(t, "thinker", id, "attached")
		assert.Equal(t, id, st.Replica, "back under the same replica id")
		res, err := c.Head.Execute(testCtx(t), orchestrator.Request{ID: fmt.Sprint("up", round), Messages: []*stagepb.ChatMessage{msg("user", "hi")}}, nil)
		require.NoError(t, err)
		assert.Equal(t, "ok", res.Text)
	}
	rows := c.Head.Replicas()
	require.Len(t, rows, 1, "one replica, never a second id")

	// Sleep is an admin error with a reason: this upstream has no sleep mode.
	_, err = c.Head.Sleep(testCtx(t), 0, id, 1)
	require.ErrorIs(t, err, orchestrator.ErrStageFailed)
	assert.Contains(t, err.Error(), "has no sleep mode")
	// The client's message carries the actionable reason, not the
	// upstream's address.
	var oe *orchestrator.Error
	require.ErrorAs(t, err, &oe)
	assert.Equal(t, fmt.Sprintf("sleep of stage thinker failed on replica %d: upstream has no sleep mode (POST /sleep?level=1: 404); vLLM needs --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1", id), oe.Message)
}

// TestScrapedLoad: the upstream's vLLM metrics become the replica's engine
// gauges (Health and every chunk), and its prefix-cache counters reach the
// chunks as increases, each exactly once.
func TestScrapedLoad(t *testing.T) {
	vllm, err := os.ReadFile(filepath.Join("testdata", "vllm.prom"))
	require.NoError(t, err)
	text := string(vllm)
	var current atomic.Pointer[string]
	current.Store(&text)
	f := newFake(t)
	chatting(f)
	scrapes := metricsFrom(f, &current)
	e := startText(t, openai.Config{URL: f.URL, HealthInterval: 20 * time.Millisecond})

	g := e.Health().GetGauges()
	assert.Equal(t, uint32(7), g.GetNumRequestsRunning())
	assert.Equal(t, uint32(6), g.GetNumRequestsWaitingCapacity())
	assert.InDelta(t, 0.375, g.GetKvCacheUsagePerc(), 1e-9)
	chunks, err := collect(testCtx(t), e, chatReq(nil, msg("user", "x")))
	require.NoError(t, err)
	for _, c := range chunks {
		assert.Equal(t, uint32(7), c.GetStats().GetNumRequestsRunning())
		assert.InDelta(t, 0.375, c.GetStats().GetKvCacheUsagePerc(), 1e-9)
	}
	assert.Zero(t, chunks[len(chunks)-1].GetStats().GetPrefixCacheQueries(), "the first scrape is the baseline")

	// The upstream computed 300 more prompt tokens, 120 of them cached.
	more := replaceAll(text, map[string]string{
		`vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 10000.0`: `vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 10300.0`,
		`vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 4000.0`:     `vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 4120.0`,
		`vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0`:           `vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.0`,
	})
	n := scrapes.Load()
	current.Store(&more)
	require.Eventually(t, func() bool { return scrapes.Load() >= n+2 }, wait, time.Millisecond)
	assert.Equal(t, uint32(4), e.Health().GetGauges().GetNumRequestsRunning())
	chunks, err = collect(testCtx(t), e, chatReq(nil, msg("user", "x")))
	require.NoError(t, err)
	last := chunks[len(chunks)-1].GetStats()
	assert.Equal(t, uint64(300), last.GetPrefixCacheQueries())
	assert.Equal(t, uint64(120), last.GetPrefixCacheHits())
	chunks, err = collect(testCtx(t), e, chatReq(nil, msg("user", "x")))
	require.NoError(t, err)
	assert.Zero(t, chunks[len(chunks)-1].GetStats().GetPrefixCacheQueries(), "counted once")
}

func replaceAll(s string, m map[string]string) string {
	for old, repl := range m {
		if !containsOnce(s, old) {
			panic("testdata changed: " + old)
		}
		s = replaceOnce(s, old, repl)
	}
	return s
}

// TestLeastLoadedFollowsUpstreams: with least_loaded, the head sends work
// to the replica whose upstream holds less, as its metrics say.
func TestLeastLoadedFollowsUpstreams(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, ReplicasPerStage: -1, Policy: "least_loaded"})
	gauge := func(running int) *atomic.Pointer[string] {
		var p atomic.Pointer[string]
		s := fmt.Sprintf("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} %d\n# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\"} 0\n", running)
		p.Store(&s)
		return &p
	}
	busyText, idleText := gauge(10), gauge(0)
	busy, idle := newFake(t), newFake(t)
	busyServed, idleServed := chatting(busy), chatting(idle)
	busyScrapes, idleScrapes := metricsFrom(busy, busyText), metricsFrom(idle, idleText)
	for _, f := range []*fake{busy, idle} {
		e, err := openai.New(openai.Config{URL: f.URL, HealthInterval: 20 * time.Millisecond, Logger: quiet()})
		require.NoError(t, err)
		srv := startWorker(t, c, "thinker", e)
		c.WaitState(t, "thinker", srv.Member().ReplicaID, "attached")
	}
	ask := func(id string) {
		_, err := c.Head.Execute(testCtx(t), orchestrator.Request{ID: id, Messages: []*stagepb.ChatMessage{msg("user", "hi")}}, nil)
		require.NoError(t, err)
	}
	for i := range 5 {
		ask(fmt.Sprint("a", i))
	}
	assert.Equal(t, int32(5), idleServed.Load(), "all to the idle upstream")
	assert.Zero(t, busyServed.Load())

	// The load moves: the idle upstream fills up, the busy one drains.
	b, i := busyScrapes.Load(), idleScrapes.Load()
	busyText.Store(gauge(0).Load())
	idleText.Store(gauge(20).Load())
	require.Eventually(t, func() bool { return busyScrapes.Load() >= b+2 && idleScrapes.Load() >= i+2 }, wait, time.Millisecond)
	// Every worker streams its engine's load to the head (SubscribeLoad),
	// so the head learns the new loads without sending anything.
	require.Eventually(t, func() bool {
		for _, r := range c.Head.Replicas() {
			if r.Load == nil || (*r.Load != 0 && *r.Load != 20) {
				return false
			}
		}
		total := int64(0)
		for _, r := range c.Head.Replicas() {
			total += *r.Load
		}
		return total == 20
	}, wait, time.Millisecond, "the head reads the loads the upstreams report")
	for i := range 5 {
		ask(fmt.Sprint("b", i))
	}
	assert.Equal(t, int32(5), busyServed.Load(), "then to the upstream that drained")
	assert.Equal(t, int32(5), idleServed.Load())
}

// TestSleepWake: sleep and wake map to vLLM's sleep-mode endpoints; a
// sleeping upstream takes no requests; an upstream that starts asleep is
// reported asleep.
func TestSleepWake(t *testing.T) {
	f := newFake(t)
	chatting(f)
	var mu sync.Mutex
	asleep, lastLevel := true, ""
	f.route("POST /sleep", func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		asleep, lastLevel = true, r.URL.Query().Get("level")
	})
	f.route("POST /wake_up", func(w http.ResponseWriter, _ *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		asleep = false
	})
	f.route("GET /is_sleeping", func(w http.ResponseWriter, _ *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		fmt.Fprintf(w, `{"is_sleeping":%t}`, asleep)
	})
	e := startText(t, openai.Config{URL: f.URL})
	assert.Equal(t, stagepb.SleepState_SLEEP_STATE_WEIGHTS_OFFLOADED, e.Health().GetSleepState(), "started asleep")
	_, err := collect(testCtx(t), e, chatReq(nil, msg("user", "x")))
	assert.Equal(t, codes.FailedPrecondition, status.Code(err))

	st, err := e.WakeUp(testCtx(t))
	require.NoError(t, err)
	assert.Equal(t, stagepb.SleepState_SLEEP_STATE_AWAKE, st)
	_, err = collect(testCtx(t), e, chatReq(nil, msg("user", "x")))
	require.NoError(t, err)

	st, err = e.Sleep(testCtx(t), 2)
	require.NoError(t, err)
	assert.Equal(t, stagepb.SleepState_SLEEP_STATE_DISCARD_ALL, st)
	assert.Equal(t, st, e.Health().GetSleepState())
	mu.Lock()
	assert.Equal(t, "2", lastLevel)
	mu.Unlock()

	// An upstream that ignores the call is not believed.
	f.route("POST /wake_up", func(http.ResponseWriter, *http.Request) {})
	_, err = e.WakeUp(testCtx(t))
	assert.Equal(t, codes.Internal, status.Code(err))
	assert.Contains(t, status.Convert(err).Message(), "still sleeps")

	// No sleep mode at all: a clear error, not a silent success.
	g := newFake(t)
	e2 := startText(t, openai.Config{URL: g.URL})
	st, err = e2.Sleep(testCtx(t), 1)
	assert.Equal(t, codes.Unimplemented, status.Code(err))
	assert.Contains(t, status.Convert(err).Message(), "has no sleep mode (POST /sleep?level=1: 404)")
	assert.Equal(t, stagepb.SleepState_SLEEP_STATE_AWAKE, st)
	_, err = e2.WakeUp(testCtx(t))
	assert.Equal(t, codes.Unimplemented, status.Code(err))
}

// wavOf encodes PCM16 mono as a WAV with the given data size field.
func wavOf(pcm []byte, rate int, dataSize uint32) []byte {
	h := make([]byte, 0, 44+len(pcm))
	h = append(h, "RIFF"...)
	h = binary.LittleEndian.AppendUint32(h, 36+dataSize)
	h = append(h, "WAVEfmt "...)
	h = binary.LittleEndian.AppendUint32(h, 16)
	h = binary.LittleEndian.AppendUint16(h, 1)
	h = binary.LittleEndian.AppendUint16(h, 1)
	h = binary.LittleEndian.AppendUint32(h, uint32(rate))
	h = binary.LittleEndian.AppendUint32(h, uint32(rate*2))
	h = binary.LittleEndian.AppendUint16(h, 2)
	h = binary.LittleEndian.AppendUint16(h, 16)
	h = append(h, "data"...)
	h = binary.LittleEndian.AppendUint32(h, dataSize)
	return append(h, pcm...)
}

func tone(n int) []byte {
	out := make([]byte, 0, 2*n)
	for i := range n {
		out = binary.LittleEndian.AppendUint16(out, uint16(int16(8000*math.Sin(float64(i)/10))))
	}
	return out
}

// writeSlowly writes b in pieces, flushing each, as a TTS server streams.
func writeSlowly(w http.ResponseWriter, b []byte, pieces int) {
	step := (len(b) + pieces - 1) / pieces
	for i := 0; i < len(b); i += step {
		_, _ = w.Write(b[i:min(i+step, len(b))])
		w.(http.Flusher).Flush()
	}
}

// TestSpeech: text in, the upstream's audio out as it streams; voice and
// format reach the upstream; a response cut short is a failure.
func TestSpeech(t *testing.T) {
	pcm := tone(48000)
	f := newFake(t)
	cut := false
	f.route("POST /v1/audio/speech", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "audio/wav")
		if cut {
			writeSlowly(w, wavOf(pcm[:1000], 24000, uint32(len(pcm))), 2)
			panic(http.ErrAbortHandler)
		}
		writeSlowly(w, wavOf(pcm, 24000, 0xFFFFFFFF), 7)
	})
	e, err := openai.NewSpeech(openai.Config{URL: f.URL, Voice: "nova", Logger: quiet()})
	require.NoError(t, err)
	run(t, e)
	waitAvailable(t, e, true)
	h := e.Health()
	assert.Equal(t, "openai-speech", h.GetEngine())
	assert.Equal(t, "audio", h.GetRole())
	assert.Equal(t, "text", h.GetInputRole())

	req := &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Text{Text: "hello there"}, Voice: "echo"}
	chunks, err := collect(testCtx(t), e, req)
	require.NoError(t, err)
	var got []byte
	for _, c := range chunks {
		got = append(got, c.GetAudioPcm16()...)
		if len(c.GetAudioPcm16()) > 0 {
			assert.Equal(t, uint32(24000), c.GetSampleRate())
		}
	}
	assert.Equal(t, pcm, got)
	assert.Greater(t, len(chunks), 2, "streamed")
	assert.Equal(t, stagepb.FinishReason_FINISH_REASON_STOP, chunks[len(chunks)-1].GetFinishReason())
	b := f.lastBody()
	assert.Equal(t, map[string]any{"model": "m", "input": "hello there", "voice": "echo", "response_format": "wav", "stream_format": "audio"}, b)

	// No voice in the request: the configured one.
	_, err = collect(testCtx(t), e, &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Chat{Chat: &stagepb.Chat{Messages: []*stagepb.ChatMessage{msg("user", "hi"), msg("assistant", "say this")}}}})
	require.NoError(t, err)
	assert.Equal(t, "nova", f.lastBody()["voice"])
	assert.Equal(t, "say this", f.lastBody()["input"], "the last message is spoken")

	// No voice anywhere: the upstream's default speaker.
	e2, err := openai.NewSpeech(openai.Config{URL: f.URL, Logger: quiet()})
	require.NoError(t, err)
	run(t, e2)
	waitAvailable(t, e2, true)
	_, err = collect(testCtx(t), e2, &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Text{Text: "hi"}})
	require.NoError(t, err)
	assert.NotContains(t, f.lastBody(), "voice")

	cut = true
	_, err = collect(testCtx(t), e, req)
	assert.Equal(t, codes.Unavailable, status.Code(err), "%v", err)

	f.route("POST /v1/audio/speech", func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusBadRequest)
		_, _ = io.WriteString(w, `{"error":{"message":"unknown voice: echo"}}`)
	})
	_, err = collect(testCtx(t), e, req)
	assert.Equal(t, codes.InvalidArgument, status.Code(err))
	assert.Equal(t, "unknown voice: echo", status.Convert(err).Message())

	posts := f.posts()
	chunks, err = collect(testCtx(t), e, &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Text{Text: ""}})
	require.NoError(t, err)
	require.Len(t, chunks, 1)
	assert.Empty(t, chunks[0].GetAudioPcm16())
	assert.Equal(t, posts, f.posts(), "nothing to say: nothing asked")
}

// TestSpeechPCM: the pcm format is headerless PCM16 at 24 kHz.
func TestSpeechPCM(t *testing.T) {
	pcm := tone(5000)
	f := newFake(t)
	f.route("POST /v1/audio/speech", func(w http.ResponseWriter, _ *http.Request) { writeSlowly(w, pcm, 3) })
	e, err := openai.NewSpeech(openai.Config{URL: f.URL, SpeechFormat: "pcm", Logger: quiet()})
	require.NoError(t, err)
	run(t, e)
	waitAvailable(t, e, true)
	chunks, err := collect(testCtx(t), e, &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Text{Text: "x"}})
	require.NoError(t, err)
	var got []byte
	for _, c := range chunks {
		got = append(got, c.GetAudioPcm16()...)
	}
	assert.Equal(t, pcm, got)
	assert.Equal(t, uint32(24000), chunks[0].GetSampleRate())
	assert.Equal(t, "pcm", f.lastBody()["response_format"])

	_, err = openai.NewSpeech(openai.Config{URL: f.URL, SpeechFormat: "mp3"})
	assert.Error(t, err)
}

// TestUpstreamCA: TLS to the upstream trusts the system roots plus
// --upstream-ca; without the CA a self-signed upstream is refused.
func TestUpstreamCA(t *testing.T) {
	f := &fake{routes: map[string]http.HandlerFunc{
		"GET /health":    func(http.ResponseWriter, *http.Request) {},
		"GET /v1/models": func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, `{"data":[{"id":"m"}]}`) },
	}}
	f.Server = httptest.NewUnstartedServer(http.HandlerFunc(f.serve))
	f.TLS = &tls.Config{MinVersion: tls.VersionTLS12}
	f.Config.ErrorLog = log.New(io.Discard, "", 0) // the refused handshake below is expected
	f.StartTLS()
	t.Cleanup(f.Close)
	chatting(f)
	ca := filepath.Join(t.TempDir(), "ca.pem")
	require.NoError(t, os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: f.Certificate().Raw}), 0o600))

	e := startText(t, openai.Config{URL: f.URL + "/v1", CAFile: ca})
	chunks, err := collect(testCtx(t), e, chatReq(nil, msg("user", "x")))
	require.NoError(t, err)
	assert.Equal(t, "ok", joinText(chunks))

	e2, err := openai.New(openai.Config{URL: f.URL + "/v1", ReadyTimeout: time.Second, Logger: quiet()})
	require.NoError(t, err)
	err = run(t, e2).result(t)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "certificate")

	_, err = openai.New(openai.Config{URL: f.URL, CAFile: filepath.Join(t.TempDir(), "missing.pem")})
	assert.Error(t, err)
}

func containsOnce(s, sub string) bool { return strings.Count(s, sub) == 1 }

func replaceOnce(s, old, repl string) string { return strings.Replace(s, old, repl, 1) }

// lockedBuffer is a log sink safe for concurrent writers.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
