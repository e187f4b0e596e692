package orchestrator_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/sim"
)

// loadSeen is what h reads of every replica's load (the sum of their
// reported loads), its own requests on them, and the oldest report's age
// in seconds.
func loadSeen(h *orchestrator.Head) (load, inFlight int64, age float64) {
	for _, r := range h.Replicas() {
		inFlight += r.InFlight
		if r.Load != nil {
			load += *r.Load
		}
		if r.LoadAgeSeconds != nil {
			age = max(age, *r.LoadAgeSeconds)
		}
	}
	return load, inFlight, age
}

// TestHeadLearnsLoadFromSubscription: head B, which sends nothing, reads
// the load head A's requests put on the replicas (the engines' running
// count, through SubscribeLoad) as it rises and as it falls, and an idle
// replica's report stays fresh (the heartbeat). Without the subscription
// B knows only the loads of the replicas' Health at join: 0, aging.
func TestHeadLearnsLoadFromSubscription(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{
		Pipeline:         orchestrator.Pipeline{Model: "troupe-omni-sim", Stages: []orchestrator.Stage{{Name: "thinker", Policy: "prefix_aware", PrefixSource: "head"}}},
		ReplicasPerStage: 2,
		Sim:              sim.Config{DecodeTokenLatency: 2 * time.Millisecond},
	})
	b, _ := c.AddHead(t)
	for _, w := range c.Workers() {
		waitStateOn(t, b, w.ReplicaID(), orchestrator.StateAttached)
	}
	load, _, _ := loadSeen(b)
	require.Zero(t, load, "idle at join")

	// Three requests on A that run until cancelled.
	const n = 3
	ctx, cancel := context.WithCancel(ctxT(t))
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			seed := int64(i)
			_, err := c.Head.Execute(ctx, orchestrator.Request{ID: fmt.Sprint("long-", i), Prompt: cachePrompt("A"),
				Sampling: &stagepb.SamplingParams{MaxTokens: 60000, IgnoreEos: true, Seed: &seed}}, nil)
			if ctx.Err() == nil {
				t.Errorf("request %d ended before it was cancelled: %v", i, err)
			}
		})
	}
	t.Cleanup(func() { cancel(); wg.Wait() })
	require.Eventually(t, func() bool {
		load, inFlight, age := loadSeen(b)
		return load == n && inFlight == 0 && age < 1
	}, 20*time.Second, 5*time.Millisecond, "B reads the load of A's %d requests, fresh, with none of its own", n)

	cancel()
	wg.Wait()
	require.Eventually(t, func() bool {
		load, _, _ := loadSeen(b)
		return load == 0
	}, 20*time.Second, 5*time.Millisecond, "B reads the load fall when A's requests end")
	idleAt := time.Now()
	require.Eventually(t, func() bool {
		_, _, age := loadSeen(b)
		return time.Since(idleAt).Seconds()-age > worker.LoadHeartbeat.Seconds()/2
	}, 20*time.Second, 10*time.Millisecond, "an idle replica's report is sent again, so it stays fresh")
	_, _, age := loadSeen(b)
	assert.Less(t, age, 2*worker.LoadHeartbeat.Seconds(), "no report older than two heartbeats")
}
