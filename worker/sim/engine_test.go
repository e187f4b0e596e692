package sim

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// wait bounds every condition a test waits on; generous for a loaded machine.
const wait = 20 * time.Second

func newEngine(t *testing.T, cfg Config) *Engine {
	t.Helper()
	require.NoError(t, cfg.Validate())
	e := New(cfg)
	t.Cleanup(func() { require.NoError(t, e.Close()) })
	return e
}

func generate(ctx context.Context, e *Engine, req *stagepb.GenerateRequest) ([]*stagepb.GenerateChunk, error) {
	var chunks []*stagepb.GenerateChunk
	err := e.Generate(ctx, req, func(c *stagepb.GenerateChunk) error {
		chunks = append(chunks, c)
		return nil
	})
	return chunks, err
}

// checkChunks checks a finished stream against Expect and the stats rules.
func checkChunks(t *testing.T, role string, req *stagepb.GenerateRequest, chunks []*stagepb.GenerateChunk) {
	t.Helper()
	want, err := Expect(role, req)
	require.NoError(t, err)
	require.NotEmpty(t, chunks)
	var got Output
	for i, c := range chunks {
		last := i == len(chunks)-1
		got.Text += c.GetText()
		got.TokenIDs = append(got.TokenIDs, c.GetTokenIds()...)
		got.Codes = append(got.Codes, c.GetCodes()...)
		got.Audio = append(got.Audio, c.GetAudioPcm16()...)
		if len(c.GetAudioPcm16()) > 0 {
			assert.Equal(t, uint32(SampleRate), c.GetSampleRate())
		}
		assert.Equal(t, last, c.GetFinishReason() != stagepb.FinishReason_FINISH_REASON_UNSPECIFIED, "finish reason on the final chunk only")
		assert.Equal(t, last, c.GetTimings() != nil, "timings on the final chunk only")
		require.NotNil(t, c.GetStats())
	}
	got.Finish = chunks[len(chunks)-1].GetFinishReason()
	st := sums(chunks)
	got.GenerationTokens = int(st.GenerationTokens)
	assert.Equal(t, want, got)

	prompt, _, err := promptOf(role, req)
	require.NoError(t, err)
	assert.Equal(t, uint64(len(prompt)), st.PromptTokens)
	assert.Equal(t, st.PromptTokens, st.PromptTokensLocalCompute+st.PromptTokensLocalCacheHit)
	assert.Positive(t, chunks[0].GetStats().GetPromptTokens(), "prompt tokens come with the first chunk")
	tm := chunks[len(chunks)-1].GetTimings()
	assert.GreaterOrEqual(t, tm.GetQueueSeconds(), 0.0)
	assert.GreaterOrEqual(t, tm.GetPrefillSeconds(), 0.0)
	assert.GreaterOrEqual(t, tm.GetDecodeSeconds(), 0.0)
}

func TestEngineOutputMatchesExpect(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		role string
		req  *stagepb.GenerateRequest
	}{
		{stagepb.RoleText, textRequest("what is the weather like", &stagepb.SamplingParams{Seed: proto.Int64(42)})},
		{stagepb.RoleText, textRequest("what is the weather like", &stagepb.SamplingParams{MaxTokens: 5})},
		{stagepb.RoleText, textRequest("count", &stagepb.SamplingParams{MaxTokens: 30, IgnoreEos: true, Stop: []string{"e"}})},
		{stagepb.RoleCodes, textRequest("the sun is out today", nil)},
		{stagepb.RoleAudio, codesRequest([]uint32{3, 14, 15, 92, 65})},
	} {
		t.Run(string(c.role), func(t *testing.T) {
			e := newEngine(t, Config{Role: c.role})
			chunks, err := generate(ctx, e, c.req)
			require.NoError(t, err)
			checkChunks(t, c.role, c.req, chunks)
			// Alone on the engine: every step is this request's, reported once.
			st := sums(chunks)
			var iter uint64
			for _, n := range st.IterationTokens {
				iter += uint64(n)
			}
			assert.Equal(t, st.PromptTokens+st.GenerationTokens-1, iter)

			// Again: same output, and the prompt now comes from the cache.
			again, err := generate(ctx, e, c.req)
			require.NoError(t, err)
			checkChunks(t, c.role, c.req, again)
			// The final chunk can reach the caller before the engine loop
			// publishes the snapshot that released the request.
			require.Eventually(t, func() bool {
				snap := e.Snapshot()
				return snap.KVBlocksUsed == 0 && snap.Running == 0
			}, 10*time.Second, time.Millisecond, "blocks released and nothing running: %+v", e.Snapshot())
		})
	}
}

func TestEngineRepeatedPromptHitsPrefixCache(t *testing.T) {
	e := newEngine(t, Config{BlockSize: 4})
	req := textRequest(strings.Repeat("the quick brown fox ", 4), nil) // 17 tokens
	first, err := generate(context.Background(), e, req)
	require.NoError(t, err)
	assert.Equal(t, uint64(0), sums(first).PromptTokensLocalCacheHit)
	second, err := generate(context.Background(), e, req)
	require.NoError(t, err)
	s := sums(second)
	assert.Equal(t, uint64(16), s.PromptTokensLocalCacheHit)
	assert.Equal(t, uint64(1), s.PromptTokensLocalCompute)
	assert.Equal(t, uint64(17), s.PrefixCacheQueries)
	assert.Equal(t, uint64(16), s.PrefixCacheHits)
	// The snapshot is published by the engine loop, possibly just after the
	// final chunk reached the caller.
	require.Eventually(t, func() bool {
		snap := e.Snapshot()
		return snap.PrefixCacheQueries == 34 && snap.PrefixCacheHits == 16
	}, 10*time.Second, time.Millisecond, "engine totals: %+v", e.Snapshot())

	// A prompt that shares only the first block hits only that block.
	third, err := generate(context.Background(), e, textRequest("the quick brown fox jumps", nil))
	require.NoError(t, err)
	assert.Equal(t, uint64(4), sums(third).PrefixCacheHits)
}

func TestEngineConcurrentRequestsAreDeterministic(t *testing.T) {
	// Few seats, a small KV pool and a small token budget: requests queue,
	// get chunked and preempted, and the outputs must not care.
	cfg := Config{MaxNumSeqs: 3, NumKVBlocks: 24, BlockSize: 4, MaxNumBatchedTokens: 16, NumSpeculativeTokens: 2}
	e := newEngine(t, cfg)
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for i := range 16 {
		req := textRequest(fmt.Sprintf("request number %d asks something", i%5), &stagepb.SamplingParams{Seed: proto.Int64(int64(i)), MaxTokens: 40, IgnoreEos: i%2 == 0})
		wg.Go(func() {
			chunks, err := generate(context.Background(), e, req)
			if err != nil {
				errs <- err
				return
			}
			want, _ := Expect(stagepb.RoleText, req)
			if got := text(chunks); got != want.Text {
				errs <- fmt.Errorf("request %d: got %q, want %q", i, got, want.Text)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	require.Eventually(t, func() bool {
		snap := e.Snapshot()
		return snap.KVBlocksUsed == 0 &&
			snap.Finished[stagepb.FinishReason_FINISH_REASON_STOP]+snap.Finished[stagepb.FinishReason_FINISH_REASON_LENGTH] == 16
	}, 10*time.Second, time.Millisecond, "all 16 finished and their blocks freed: %+v", e.Snapshot())
}

func TestEngineQueueAndCancellation(t *testing.T) {
	// One seat, slow decode, long outputs: the other two requests really wait.
	e := newEngine(t, Config{MaxNumSeqs: 1, DecodeTokenLatency: 20 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i := range 3 {
		wg.Go(func() {
			_, errs[i] = generate(ctx, e, textRequest("go on forever", &stagepb.SamplingParams{Seed: proto.Int64(int64(i)), MaxTokens: 10000, IgnoreEos: true}))
		})
	}
	require.Eventually(t, func() bool {
		s := e.Snapshot()
		return s.Running == 1 && s.WaitingCapacity == 2
	}, wait, time.Millisecond)
	h := e.Health()
	assert.Equal(t, uint32(1), h.GetGauges().GetNumRequestsRunning())
	assert.Equal(t, uint32(2), h.GetGauges().GetNumRequestsWaitingCapacity())
	assert.Positive(t, h.GetGauges().GetKvCacheUsagePerc())

	cancel()
	wg.Wait()
	for _, err := range errs {
		assert.ErrorIs(t, err, context.Canceled)
	}
	require.Eventually(t, func() bool {
		s := e.Snapshot()
		return s.Finished[stagepb.FinishReason_FINISH_REASON_ABORT] == 3
	}, wait, time.Millisecond)
	s := e.Snapshot()
	assert.Equal(t, 0, s.Running+s.WaitingCapacity+s.WaitingDeferred)
	assert.Equal(t, 0, s.KVBlocksUsed, "aborted requests free their blocks")
}

func TestEngineEmitErrorAborts(t *testing.T) {
	e := newEngine(t, Config{DecodeTokenLatency: 20 * time.Millisecond})
	boom := errors.New("client went away")
	err := e.Generate(context.Background(), textRequest("hi", &stagepb.SamplingParams{MaxTokens: 10000, IgnoreEos: true}),
		func(*stagepb.GenerateChunk) error { return boom })
	assert.ErrorIs(t, err, boom)
	require.Eventually(t, func() bool {
		return e.Snapshot().Finished[stagepb.FinishReason_FINISH_REASON_ABORT] == 1
	}, wait, time.Millisecond)
	assert.Equal(t, 0, e.Snapshot().KVBlocksUsed)
}

func TestEngineSleepAndWake(t *testing.T) {
	e := newEngine(t, Config{BlockSize: 4})
	ctx := context.Background()
	req := textRequest("sleepy prompt with enough words to fill", nil)
	_, err := generate(ctx, e, req)
	require.NoError(t, err)

	_, err = e.Sleep(context.Background(), 3)
	assert.Equal(t, codes.InvalidArgument, status.Code(err))

	state, err := e.Sleep(context.Background(), 1)
	require.NoError(t, err)
	assert.Equal(t, stagepb.SleepState_SLEEP_STATE_WEIGHTS_OFFLOADED, state)
	assert.Equal(t, state, e.Health().GetSleepState())
	_, err = generate(ctx, e, req)
	assert.Equal(t, codes.FailedPrecondition, status.Code(err))
	assert.ErrorContains(t, err, "asleep (weights_offloaded)")

	state, err = e.WakeUp(context.Background())
	require.NoError(t, err)
	assert.Equal(t, stagepb.SleepState_SLEEP_STATE_AWAKE, state)
	chunks, err := generate(ctx, e, req)
	require.NoError(t, err)
	assert.Positive(t, sums(chunks).PrefixCacheHits, "level 1 keeps the prefix cache")

	state, err = e.Sleep(context.Background(), 2)
	require.NoError(t, err)
	assert.Equal(t, stagepb.SleepState_SLEEP_STATE_DISCARD_ALL, state)
	_, err = generate(ctx, e, req)
	assert.Equal(t, codes.FailedPrecondition, status.Code(err))
	_, err = e.WakeUp(context.Background())
	require.NoError(t, err)
	chunks, err = generate(ctx, e, req)
	require.NoError(t, err)
	assert.Equal(t, uint64(0), sums(chunks).PrefixCacheHits, "level 2 discards the prefix cache")
	checkChunks(t, stagepb.RoleText, req, chunks)
}

func TestEngineRefusesSleepWithRequestsInFlight(t *testing.T) {
	e := newEngine(t, Config{DecodeTokenLatency: 20 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	started := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		var once sync.Once
		done <- e.Generate(ctx, textRequest("long", &stagepb.SamplingParams{MaxTokens: 10000, IgnoreEos: true}), func(*stagepb.GenerateChunk) error {
			once.Do(func() { close(started) })
			return nil
		})
	}()
	<-started
	_, err := e.Sleep(context.Background(), 1)
	assert.Equal(t, codes.FailedPrecondition, status.Code(err))
	assert.ErrorContains(t, err, "1 requests in flight")
	assert.Equal(t, stagepb.SleepState_SLEEP_STATE_AWAKE, e.Health().GetSleepState())
	cancel()
	assert.ErrorIs(t, <-done, context.Canceled)
}

func TestEngineRejectsRequestsBeyondKVCapacity(t *testing.T) {
	e := newEngine(t, Config{NumKVBlocks: 4, BlockSize: 4})
	_, err := generate(context.Background(), e, textRequest("hi", &stagepb.SamplingParams{MaxTokens: 1 << 30, IgnoreEos: true}))
	assert.Equal(t, codes.InvalidArgument, status.Code(err))
	assert.Equal(t, stagepb.ReasonContextLengthExceeded, stagepb.ErrorReason(err), "a typed reason, not only text")
	assert.ErrorContains(t, err, "maximum context length is 16 tokens")
	// A prompt alone longer than the cache: refused before it is queued.
	_, err = generate(context.Background(), e, textRequest(strings.Repeat("word ", 20), &stagepb.SamplingParams{MaxTokens: 1}))
	assert.Equal(t, stagepb.ReasonContextLengthExceeded, stagepb.ErrorReason(err))
	assert.ErrorContains(t, err, "(21 in the prompt, 1 in the completion)")
	_, err = generate(context.Background(), e, codesRequest([]uint32{1}))
	assert.Equal(t, codes.InvalidArgument, status.Code(err))
}

func TestEngineCloseEndsRequests(t *testing.T) {
	e := New(Config{DecodeTokenLatency: 20 * time.Millisecond})
	started := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		var once sync.Once
		done <- e.Generate(context.Background(), textRequest("long", &stagepb.SamplingParams{MaxTokens: 10000, IgnoreEos: true}), func(*stagepb.GenerateChunk) error {
			once.Do(func() { close(started) })
			return nil
		})
	}()
	<-started
	require.NoError(t, e.Close())
	assert.Equal(t, codes.Unavailable, status.Code(<-done))
	_, err := generate(context.Background(), e, textRequest("late", nil))
	assert.Equal(t, codes.Unavailable, status.Code(err))
	assert.Equal(t, stagepb.ServingStatus_SERVING_STATUS_NOT_SERVING, e.Health().GetStatus())
	_, err = e.Sleep(context.Background(), 1)
	assert.Equal(t, codes.Unavailable, status.Code(err))
	require.NoError(t, e.Close(), "Close is idempotent")
}

func TestEngineRunClosesOnCancel(t *testing.T) {
	e := New(Config{})
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- e.Run(ctx) }()
	cancel()
	require.NoError(t, <-ran)
	assert.True(t, e.Snapshot().Closed)
}

func TestConfigValidate(t *testing.T) {
	assert.NoError(t, Config{}.Validate())
	err := Config{Role: "video", MaxNumSeqs: -1, NumSpeculativeTokens: 65, DecodeTokenLatency: -time.Second}.Validate()
	require.Error(t, err)
	for _, msg := range []string{`unknown role "video"`, "max-num-seqs must be positive", "num-speculative-tokens 65 out of range", "decode latency"} {
		assert.ErrorContains(t, err, msg)
	}
	assert.ErrorContains(t, Config{MaxNumBatchedTokens: 2, NumSpeculativeTokens: 4}.Validate(), "cannot hold one decode step")
	// New clamps instead of failing.
	e := New(Config{NumSpeculativeTokens: 100, MaxNumSeqs: -3})
	defer e.Close()
	assert.Equal(t, stagepb.MaxSpeculativeTokens, e.Config().NumSpeculativeTokens)
	assert.Equal(t, DefaultMaxNumSeqs, e.Config().MaxNumSeqs)
}

// BenchmarkGenerate measures the engine's own overhead: 64-token requests
// from 8 concurrent callers, zero delays.
func BenchmarkGenerate(b *testing.B) {
	e := New(Config{NumSpeculativeTokens: 2})
	defer e.Close()
	req := textRequest("a benchmark prompt of a few words", &stagepb.SamplingParams{MaxTokens: 64, IgnoreEos: true})
	b.ReportAllocs()
	b.SetParallelism(4) // with GOMAXPROCS 2: 8 callers
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if err := e.Generate(context.Background(), req, func(*stagepb.GenerateChunk) error { return nil }); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.ReportMetric(float64(b.N*64)/time.Since(start).Seconds(), "tokens/s")
}
