package orchestrator_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/tokenizers"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/sim"
)

var prefixThinker = orchestrator.Pipeline{Model: "troupe-omni-sim", Stages: []orchestrator.Stage{
	{Name: "thinker", Policy: "prefix_aware", PrefixSource: "auto"},
}}

// cachePrompt is a prompt of many full sim blocks.
func cachePrompt(who string) string {
	return "system: " + strings.Repeat("you answer questions about the troupe serving orchestrator briefly and politely ", 8) + "\nuser: only " + who + " asks this"
}

func fullBlocks(prompt string) int { return len(tokenizers.Sim(prompt)) / sim.DefaultBlockSize }

func cacheSnapshots(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	v, _ := value(t, reg, "troupe_router_cache_snapshots_total", nil)
	return v
}

// TestHeadLearnsCacheFromSubscription: head B, which routed nothing,
// learns from its subscriptions which replica cached the prompt head A
// sent, and routes that prompt there with reason prefix_match.
func TestHeadLearnsCacheFromSubscription(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: prefixThinker, ReplicasPerStage: 3})
	b, bMetrics := c.AddHead(t)
	ctx := ctxT(t)
	for _, w := range c.Workers() {
		waitStateOn(t, b, w.ReplicaID(), orchestrator.StateAttached)
	}
	require.Eventually(t, func() bool { return cacheSnapshots(t, bMetrics) == 3 }, 20*time.Second, 5*time.Millisecond,
		"B subscribes to each replica's cache")

	prompt := cachePrompt("A")
	before := servedBy(t, c)
	_, err := c.Head.Execute(ctx, orchestrator.Request{ID: "a", Prompt: prompt, Sampling: sampling(2, 1)}, nil)
	require.NoError(t, err)
	served := grew(before, servedBy(t, c))
	require.Len(t, served, 1)
	var holder uint32
	for r := range served {
		holder = r
	}
	require.Eventually(t, func() bool {
		return orchestrator.PrefixHeld(b, 0, prompt)[holder] == fullBlocks(prompt)
	}, 20*time.Second, 5*time.Millisecond, "B's index learns the blocks A's request left on replica %d", holder)
	for r, n := range orchestrator.PrefixHeld(b, 0, prompt) {
		if r != holder {
			assert.Zero(t, n, "replica %d holds nothing of it", r)
		}
	}

	_, err = b.Execute(ctx, orchestrator.Request{ID: "b", Prompt: prompt, Sampling: sampling(2, 2)}, nil)
	require.NoError(t, err)
	matched, _ := value(t, bMetrics, "troupe_router_decisions_total", map[string]string{"stage": "0", "reason": "prefix_match"})
	assert.Equal(t, 1.0, matched, "B routes A's prompt by its prefix")
	assert.Equal(t, 1.0, successes(t, bMetrics, holder), "to the replica that holds it")
}

// gappyEngine is the sim, whose cache reports to subscribers skip the first
// report that stores blocks (chunks still carry it): a subscriber sees a
// gap in seq.
type gappyEngine struct {
	*sim.Engine
	drop atomic.Uint64 // the seq of the dropped report; 0 until there is one
}

func (g *gappyEngine) WatchCache(ctx context.Context, fn func(*stagepb.KvEvents)) (func(), error) {
	return g.Engine.WatchCache(ctx, func(ev *stagepb.KvEvents) {
		if !ev.GetSnapshot() && len(ev.GetStored()) > 0 {
			g.drop.CompareAndSwap(0, ev.GetSeq())
		}
		if !ev.GetSnapshot() && ev.GetSeq() == g.drop.Load() {
			return
		}
		fn(ev)
	})
}

// TestCacheSubscriptionGapResubscribes: a report lost on the subscription
// shows as a seq gap at the next report; the head subscribes again and
// the fresh snapshot brings the lost blocks.
func TestCacheSubscriptionGapResubscribes(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: prefixThinker, ReplicasPerStage: -1})
	b, bMetrics := c.AddHead(t)
	gappy := func(e *sim.Engine) worker.Engine { return &gappyEngine{Engine: e} }
	w := c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{Engine: gappy})
	waitStateOn(t, c.Head, w.ReplicaID(), orchestrator.StateAttached)
	waitStateOn(t, b, w.ReplicaID(), orchestrator.StateAttached)
	require.Eventually(t, func() bool { return cacheSnapshots(t, bMetrics) == 1 }, 20*time.Second, 5*time.Millisecond)

	ctx := ctxT(t)
	lost := cachePrompt("A, first,")
	_, err := c.Head.Execute(ctx, orchestrator.Request{ID: "lost", Prompt: lost, Sampling: sampling(2, 1)}, nil)
	require.NoError(t, err)
	assert.Zero(t, orchestrator.PrefixHeld(b, 0, lost)[w.ReplicaID()], "the report was not sent to B")
	assert.Equal(t, 1.0, cacheSnapshots(t, bMetrics), "no gap is seen before the next report")

	next := "a different conversation " + strings.Repeat("with words of its own ", 10)
	_, err = c.Head.Execute(ctx, orchestrator.Request{ID: "next", Prompt: next, Sampling: sampling(2, 2)}, nil)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		return orchestrator.PrefixHeld(b, 0, lost)[w.ReplicaID()] == fullBlocks(lost)
	}, 20*time.Second, 5*time.Millisecond, "the fresh snapshot brings the lost blocks")
	assert.Equal(t, 2.0, cacheSnapshots(t, bMetrics), "one subscription again, after the gap")
	assert.Equal(t, fullBlocks(next), orchestrator.PrefixHeld(b, 0, next)[w.ReplicaID()], "and what came after")
}
