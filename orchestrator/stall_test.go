package orchestrator_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/sim"
)

// TestPreemptedRequestIsNotAStall: a replica whose KV cache is
// oversubscribed preempts requests (vLLM's recompute preemption), which
// then make no progress until others finish, much longer than the stall
// timeout, while the replica keeps answering its other requests. That is
// load, not a frozen replica: no attempt is failed as a stall, no replica
// is ejected (though the breaker ejects at the first failure), every
// request completes. Many long requests at once did that to the thinkers
// of the chaos scenario "200 never-read audio streams" (issue 34), read
// by their clients or not.
func TestPreemptedRequestIsNotAStall(t *testing.T) {
	const stall = 150 * time.Millisecond
	c := orchestratortest.Start(t, orchestratortest.Options{
		Pipeline: thinkerOnly, ReplicasPerStage: 2, Policy: router.PolicyRoundRobin, StallTimeout: stall,
		Breaker: orchestrator.BreakerConfig{Failures: 1, Backoff: time.Minute},
		// 40 blocks of 16 tokens: three of the requests below at full
		// length; a request preempted waits for one to finish, about
		// 200 steps of 3 ms.
		Sim: sim.Config{NumKVBlocks: 40, BlockSize: 16, DecodeTokenLatency: 3 * time.Millisecond},
	})
	ctx := ctxT(t)
	const n = 12
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			sp := sampling(200, int64(i))
			sp.IgnoreEos = true
			res, err := c.Head.Execute(ctx, orchestrator.Request{ID: fmt.Sprint("p", i), Prompt: fmt.Sprint("tell a long story ", i), Sampling: sp}, nil)
			if err == nil && res.CompletionTokens != 200 {
				err = fmt.Errorf("%d tokens, want 200", res.CompletionTokens)
			}
			errs[i] = err
		})
	}
	wg.Wait()
	for i, err := range errs {
		assert.NoError(t, err, "request %d", i)
	}
	var preempted uint64
	for _, w := range c.Workers() {
		preempted += w.Engine.Snapshot().Preemptions
	}
	require.NotZero(t, preempted, "the replicas preempted requests (else the test shows nothing)")
	ej, _ := value(t, c.Metrics, "troupe_router_ejections_total", map[string]string{"stage": "0"})
	assert.Zero(t, ej, "no replica ejected")
	for r := range 2 {
		failed, _ := value(t, c.Metrics, "troupe_request_success_total", map[string]string{"stage": "0", "replica": fmt.Sprint(r), "finished_reason": "error"})
		assert.Zero(t, failed, "replica %d: no attempt failed", r)
	}
	for _, st := range c.Head.Replicas() {
		assert.Equal(t, orchestrator.StateAttached, st.State, "replica %d: %s", st.Replica, st.Reason)
	}
	t.Logf("%d preemptions", preempted)
}

// freezable serves a sim engine until frozen: from then on no request of
// the replica gets another chunk (a frozen process, as SIGSTOP makes it),
// and its requests end only when cancelled.
type freezable struct {
	*sim.Engine
	frozen chan struct{}
}

func (f *freezable) Generate(ctx context.Context, req *stagepb.GenerateRequest, emit func(*stagepb.GenerateChunk) error) error {
	return f.Engine.Generate(ctx, req, func(c *stagepb.GenerateChunk) error {
		select {
		case <-f.frozen:
			<-ctx.Done()
			return ctx.Err()
		default:
			return emit(c)
		}
	})
}

// TestFrozenReplicaIsAStall: the other side of
// TestPreemptedRequestIsNotAStall. A replica that sends nothing for any of
// its requests is frozen: its attempts fail after the stall timeout, are
// counted against it, and are retried on the other replica, where every
// request completes.
func TestFrozenReplicaIsAStall(t *testing.T) {
	const stall = 150 * time.Millisecond
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, ReplicasPerStage: -1, StallTimeout: stall,
		Sim: sim.Config{DecodeTokenLatency: 5 * time.Millisecond}})
	ctx := ctxT(t)
	frozen := make(chan struct{})
	zero := uint32(0)
	c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{ReplicaID: &zero,
		Engine: func(e *sim.Engine) worker.Engine { return &freezable{Engine: e, frozen: frozen} }})
	c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{})
	c.WaitState(t, "thinker", 0, "attached")
	c.WaitState(t, "thinker", 1, "attached")

	var g errgroup.Group
	for i := range 8 {
		g.Go(func() error {
			sp := sampling(100, int64(i))
			sp.IgnoreEos = true
			res, err := c.Head.Execute(ctx, orchestrator.Request{ID: fmt.Sprint("f", i), Prompt: "long answer please", Sampling: sp}, nil)
			if err == nil && res.CompletionTokens != 100 {
				err = fmt.Errorf("%d tokens, want 100", res.CompletionTokens)
			}
			return err
		})
	}
	require.Eventually(t, func() bool { return genTokens(t, c, 0) > 0 }, 30*time.Second, time.Millisecond, "replica 0 made output")
	close(frozen)
	require.NoError(t, g.Wait(), "every request survives the freeze")
	failed, _ := value(t, c.Metrics, "troupe_request_success_total", map[string]string{"stage": "0", "replica": "0", "finished_reason": "error"})
	assert.Positive(t, failed, "the frozen replica's attempts failed as stalls")
}

// frozenHealth is a sim engine that freezes whole, as SIGSTOP freezes a
// worker: from frozen on, no request gets a chunk and Health (the head's
// probe, the worker's load reports) answers only once thawed.
type frozenHealth struct {
	*sim.Engine
	frozen, thawed chan struct{}
}

func (f *frozenHealth) Generate(ctx context.Context, req *stagepb.GenerateRequest, emit func(*stagepb.GenerateChunk) error) error {
	select {
	case <-f.frozen:
		<-ctx.Done()
		return ctx.Err()
	default:
		return f.Engine.Generate(ctx, req, emit)
	}
}

func (f *frozenHealth) Health() *stagepb.HealthResponse {
	select {
	case <-f.frozen:
		<-f.thawed
	default:
	}
	return f.Engine.Health()
}

// TestFrozenBeforeFirstTokenIsAStall: a replica frozen before it made a
// first token for its requests releases them within the stall timeout,
// not its lease's TTL: silent on every request, it does not answer the
// head's Health probe either, so its attempts fail as stalls and are
// retried on the other replica.
func TestFrozenBeforeFirstTokenIsAStall(t *testing.T) {
	const stall = 300 * time.Millisecond
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, ReplicasPerStage: -1, StallTimeout: stall, LeaseTTL: time.Minute})
	f := &frozenHealth{frozen: make(chan struct{}), thawed: make(chan struct{})}
	zero := uint32(0)
	c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{ReplicaID: &zero,
		Engine: func(e *sim.Engine) worker.Engine { f.Engine = e; return f }})
	c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{})
	c.WaitState(t, "thinker", 0, "attached")
	c.WaitState(t, "thinker", 1, "attached")
	t.Cleanup(func() { close(f.thawed) }) // before the cluster stops
	close(f.frozen)

	// Well within the lease (a minute): without the probe the frozen
	// replica's requests would wait for it.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var g errgroup.Group
	for i := range 8 {
		g.Go(func() error {
			res, err := c.Head.Execute(ctx, orchestrator.Request{ID: fmt.Sprint("frozen-", i), Prompt: "are you there", Sampling: sampling(8, int64(i))}, nil)
			if err == nil && res.CompletionTokens == 0 {
				err = fmt.Errorf("request %d: no tokens", i)
			}
			return err
		})
	}
	require.NoError(t, g.Wait(), "every request is served by the live replica")
	failed, _ := value(t, c.Metrics, "troupe_request_success_total", map[string]string{"stage": "0", "replica": "0", "finished_reason": "error"})
	assert.Positive(t, failed, "the frozen replica's attempts failed as stalls")
}
