package orchestrator_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker/sim"
)

// histogramOf reads the sample count and sum of family's child on replica.
func histogramOf(t *testing.T, g prometheus.Gatherer, family, replica string) (count uint64, sum time.Duration) {
	t.Helper()
	m := orchestrator.GatheredMetric(t, g, family, map[string]string{"replica": replica})
	require.NotNil(t, m.GetHistogram(), "no %s for replica %s", family, replica)
	h := m.GetHistogram()
	return h.GetSampleCount(), time.Duration(h.GetSampleSum() * float64(time.Second))
}

// A client that does not stream lets the worker hold the answer and send
// it in a few messages; the head still dates every token where the engine
// made it, so time to first token and inter-token latencies are those of
// the engine, not of the messages.
func TestHeldOutputKeepsTokenTimings(t *testing.T) {
	const tokens, step = 10, 15 * time.Millisecond
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, Sim: sim.Config{DecodeTokenLatency: step}})
	res, err := c.Head.Execute(ctxT(t), orchestrator.Request{ID: "held", Prompt: "time every token", Sampling: sampling(tokens, 1)}, nil)
	require.NoError(t, err)
	require.Equal(t, tokens, res.CompletionTokens)

	itlCount, itlSum := histogramOf(t, c.Metrics, "troupe_inter_token_latency_seconds", "0")
	ttftCount, ttft := histogramOf(t, c.Metrics, "troupe_time_to_first_token_seconds", "0")
	_, e2e := histogramOf(t, c.Metrics, "troupe_e2e_request_latency_seconds", "0")
	assert.Equal(t, uint64(tokens-1), itlCount, "one inter-token sample per token after the first")
	assert.Equal(t, uint64(1), ttftCount)
	// The engine spends a step on each token after the first: had the head
	// dated the tokens by the messages that carried them, the gaps between
	// tokens of one message would be 0.
	assert.GreaterOrEqual(t, itlSum, (tokens-1)*step*8/10, "inter-token latencies are the engine's steps")
	assert.LessOrEqual(t, itlSum, e2e)
	assert.Less(t, ttft, e2e-(tokens-2)*step, "the first token is dated when it was made, not when its message came")
}

// A streaming client's output is flushed whenever the head has delivered
// all that came and waits for more: output that comes alone goes out
// before the next arrives. (After the last the caller writes the end of
// the answer and flushes it.)
func TestStreamedOutputIsFlushedWhenIdle(t *testing.T) {
	const tokens, step = 4, 100 * time.Millisecond
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, Sim: sim.Config{DecodeTokenLatency: step}})
	var calls []string // "t" per delivered delta, "f" per flush
	req := orchestrator.Request{ID: "flush", Prompt: "flush every token", Sampling: sampling(tokens, 1),
		Flush: func() error { calls = append(calls, "f"); return nil }}
	res, err := c.Head.Execute(ctxT(t), req, func(string) error { calls = append(calls, "t"); return nil })
	require.NoError(t, err)
	require.Equal(t, tokens, res.CompletionTokens)
	texts, flushes := 0, 0
	for i, call := range calls {
		if call == "f" {
			flushes++
			continue
		}
		texts++
		if texts < tokens {
			// Tokens are a step apart: each is flushed before the next comes.
			assert.Equal(t, "f", calls[i+1], "a delta that came alone is flushed at once: %v", calls)
		}
	}
	assert.Equal(t, tokens, texts)
	assert.GreaterOrEqual(t, flushes, tokens-1)
}

// countingStream counts the messages a head receives on each method.
type countingStream struct {
	grpc.ClientStream
	mu     *sync.Mutex
	counts map[string]int
	method string
}

func (s *countingStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	if err == nil {
		s.mu.Lock()
		s.counts[s.method]++
		s.mu.Unlock()
	}
	return err
}

// countMessages returns a dial option that counts, by method, the
// messages a head receives, into counts under mu.
func countMessages(mu *sync.Mutex, counts map[string]int) grpc.DialOption {
	return grpc.WithStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		s, err := streamer(ctx, desc, cc, method, opts...)
		return &countingStream{ClientStream: s, mu: mu, counts: counts, method: method[strings.LastIndexByte(method, '/')+1:]}, err
	})
}

// In a streamed audio request the head asks the talker for its codes a
// vocoder segment at a time: a few messages instead of one per step, and
// the same audio.
func TestTalkerCodesComePerVocoderSegment(t *testing.T) {
	var mu sync.Mutex
	counts := map[string]int{}
	c := orchestratortest.Start(t, orchestratortest.Options{HeadDialOptions: []grpc.DialOption{countMessages(&mu, counts)}})
	c.WaitReady(t)
	res, err := c.Head.Execute(ctxT(t), orchestrator.Request{ID: "segments", Prompt: "tell me a story about a fox", Sampling: sampling(16, 1), Stages: 3}, nil)
	require.NoError(t, err)
	require.Greater(t, len(res.Codes), 30, "enough codes for several segments")
	require.NotEmpty(t, res.PCM)

	mu.Lock()
	defer mu.Unlock()
	// GenerateStream: the talker and the vocoder (held: one message or
	// two); Generate: the thinker, whose text only the talker reads, a
	// talker segment (8 words) at a time.
	assert.LessOrEqual(t, counts["GenerateStream"], len(res.Codes)/10+1+2, "codes come a segment (10) at a time: %v", counts)
	words := len(strings.Fields(res.Text))
	require.Greater(t, words, 8, "enough words for two segments")
	assert.LessOrEqual(t, counts["Generate"], words/stagepb.DefaultSegmentWords+2, "text comes a segment at a time, not a message per token (%d): %v", res.CompletionTokens, counts)
}

// A client that streams the answer reads the thinker's text as it is
// made: it comes a message per output chunk, gathered by nobody.
func TestStreamedTextIsNotGathered(t *testing.T) {
	var mu sync.Mutex
	counts := map[string]int{}
	c := orchestratortest.Start(t, orchestratortest.Options{HeadDialOptions: []grpc.DialOption{countMessages(&mu, counts)}})
	c.WaitReady(t)
	deltas := 0
	res, err := c.Head.Execute(ctxT(t), orchestrator.Request{ID: "live", Prompt: "tell me a story about a fox", Sampling: sampling(16, 1), Stages: 3, Flush: func() error { return nil }},
		func(string) error { deltas++; return nil })
	require.NoError(t, err)
	require.Equal(t, 16, res.CompletionTokens)
	mu.Lock()
	defer mu.Unlock()
	assert.Equal(t, 16, counts["Generate"], "the thinker's text, an output chunk at a time")
	assert.Equal(t, 16, deltas)
}
