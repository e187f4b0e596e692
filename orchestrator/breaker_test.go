package orchestrator_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
)

func replicaStatus(c *orchestratortest.Cluster, replica uint32) orchestrator.ReplicaStatus {
	for _, r := range c.Head.Replicas() {
		if r.Stage == 0 && r.Replica == replica {
			return r
		}
	}
	return orchestrator.ReplicaStatus{}
}

// TestBrokenReplicaIsEjectedAndReturns: a thinker whose engine refuses
// every request (put to sleep behind the head's back) fails attempts that
// are retried on its healthy peer; after three failures in a row the
// breaker ejects it, requests stop reaching it, and once it answers again
// it is routed again after its back-off.
func TestBrokenReplicaIsEjectedAndReturns(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{
		Pipeline: thinkerOnly, ReplicasPerStage: 2, Policy: router.PolicyRoundRobin,
		Breaker: orchestrator.BreakerConfig{Failures: 3, Backoff: 2 * time.Second},
	})
	ctx := ctxT(t)
	broken := c.Workers()[0]
	require.Equal(t, uint32(0), broken.ReplicaID())
	_, err := broken.Engine.Sleep(ctx, 1)
	require.NoError(t, err)

	ejections := func() float64 {
		v, _ := value(t, c.Metrics, "troupe_router_ejections_total", map[string]string{"stage": "0"})
		return v
	}
	failed := func() float64 {
		v, _ := value(t, c.Metrics, "troupe_request_success_total", map[string]string{"stage": "0", "replica": "0", "finished_reason": "error"})
		return v
	}
	run := func(tag string, i int) {
		res, err := c.Head.Execute(ctx, orchestrator.Request{ID: fmt.Sprint(tag, i), Prompt: fmt.Sprint("ask ", i), Sampling: sampling(2, int64(i))}, nil)
		require.NoError(t, err, "the healthy replica takes every request the broken one fails")
		assert.Equal(t, 2, res.CompletionTokens)
	}
	// Round robin alternates: the broken replica fails every other
	// request's first attempt, the retry succeeds on replica 1.
	for i := 0; ejections() == 0; i++ {
		require.Less(t, i, 20, "the broken replica was never ejected")
		run("a", i)
	}
	assert.Equal(t, 3.0, failed(), "ejected after exactly three failures in a row")
	st := replicaStatus(c, 0)
	assert.Equal(t, orchestrator.StateUnhealthy, st.State)
	assert.Contains(t, st.Reason, "ejected")
	assert.Equal(t, orchestrator.StateAttached, replicaStatus(c, 1).State)

	// Ejected: nothing reaches it (its failures stay at three), although
	// round robin would alternate.
	for i := range 6 {
		if !strings.Contains(replicaStatus(c, 0).Reason, "ejected") {
			break // the back-off ran out on a slow machine; nothing to check
		}
		run("b", i)
		require.Equal(t, 3.0, failed(), "a request reached the ejected replica")
	}

	// It recovers: after the back-off an attempt succeeds and it is
	// routed again.
	_, err = broken.Engine.WakeUp(ctx)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		run("c", 0)
		return genTokens(t, c, 0) > 0 && replicaStatus(c, 0).State == orchestrator.StateAttached
	}, 30*time.Second, 50*time.Millisecond, "the recovered replica never took work again")
	assert.Equal(t, 1.0, ejections())
}

// TestOnlyReplicaIsNotEjected: ejecting a stage's last routable replica
// would turn its failures into 503s for the whole stage, so the breaker
// keeps it.
func TestOnlyReplicaIsNotEjected(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{
		Pipeline: thinkerOnly, Breaker: orchestrator.BreakerConfig{Failures: 2, Backoff: time.Minute},
	})
	ctx := ctxT(t)
	_, err := c.Workers()[0].Engine.Sleep(ctx, 1)
	require.NoError(t, err)
	for i := range 4 {
		_, err := c.Head.Execute(ctx, orchestrator.Request{ID: fmt.Sprint(i), Prompt: "x", Sampling: sampling(2, 1)}, nil)
		require.ErrorIs(t, err, orchestrator.ErrStageFailed, "the replica's own failure, not 503")
	}
	v, _ := value(t, c.Metrics, "troupe_router_ejections_total", map[string]string{"stage": "0"})
	assert.Equal(t, 0.0, v)
	assert.Equal(t, orchestrator.StateAttached, replicaStatus(c, 0).State)
}
