package orchestrator_test

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// membershipOf is what must be equal on every head: each replica's stage,
// id, address and state (engine indexes and join times are the head's own).
func membershipOf(h *orchestrator.Head) []string {
	var out []string
	for _, r := range h.Replicas() {
		out = append(out, fmt.Sprintf("%s/%d %s %s", r.StageName, r.Replica, r.Addr, r.State))
	}
	slices.Sort(out)
	return out
}

func waitSame(t *testing.T, a, b *orchestrator.Head, what string) {
	t.Helper()
	require.Eventually(t, func() bool { return slices.Equal(membershipOf(a), membershipOf(b)) }, 30*time.Second, 5*time.Millisecond,
		"%s: heads disagree: %v vs %v", what, membershipOf(a), membershipOf(b))
}

func waitStateOn(t *testing.T, h *orchestrator.Head, replica uint32, state orchestrator.ReplicaState) {
	t.Helper()
	require.Eventually(t, func() bool {
		for _, r := range h.Replicas() {
			if r.Replica == replica {
				return r.State == state
			}
		}
		return false
	}, 30*time.Second, 5*time.Millisecond, "thinker/%d never %s", replica, state)
}

func successes(t *testing.T, reg *prometheus.Registry, replica uint32) float64 {
	var sum float64
	for _, reason := range []string{"stop", "length"} {
		v, _ := value(t, reg, "troupe_request_success_total", map[string]string{"stage": "0", "replica": fmt.Sprint(replica), "finished_reason": reason})
		sum += v
	}
	return sum
}

// TestTwoHeadsOneMembership: two heads on one etcd serve the same
// replicas; a sleep asked through one head is respected by the other, a
// wake through the other is seen by the first, counters are never reset,
// and a draining replica leaves both.
func TestTwoHeadsOneMembership(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, ReplicasPerStage: 2})
	a := c.Head
	b, bMetrics := c.AddHead(t)
	ctx := ctxT(t)
	waitStateOn(t, b, 0, orchestrator.StateAttached)
	waitStateOn(t, b, 1, orchestrator.StateAttached)
	waitSame(t, a, b, "after start")

	for i := range 4 {
		_, err := b.Execute(ctx, orchestrator.Request{ID: fmt.Sprint("warm", i), Prompt: "hi", Sampling: sampling(2, int64(i))}, nil)
		require.NoError(t, err)
	}
	before0 := successes(t, bMetrics, 0)
	require.Equal(t, 4.0, before0+successes(t, bMetrics, 1))

	s, err := a.Sleep(ctx, 0, 0, 1)
	require.NoError(t, err)
	require.Equal(t, stagepb.SleepState_SLEEP_STATE_WEIGHTS_OFFLOADED, s)
	waitStateOn(t, a, 0, orchestrator.StateSleeping) // A answered after applying the record: already so
	waitStateOn(t, b, 0, orchestrator.StateSleeping)
	waitSame(t, a, b, "after the sleep through A")
	v, _ := value(t, bMetrics, "troupe_engine_sleep_state", map[string]string{"replica": "0", "sleep_state": "weights_offloaded"})
	assert.Equal(t, 1.0, v, "B's series follow the record")

	// B routes nothing to the sleeping replica.
	before1 := successes(t, bMetrics, 1)
	for i := range 6 {
		_, err := b.Execute(ctx, orchestrator.Request{ID: fmt.Sprint("b", i), Prompt: "hi", Sampling: sampling(2, int64(i))}, nil)
		require.NoError(t, err)
	}
	assert.Equal(t, before0, successes(t, bMetrics, 0), "B sent nothing to the sleeping replica")
	assert.Equal(t, before1+6, successes(t, bMetrics, 1))

	s, err = b.WakeUp(ctx, 0, 0)
	require.NoError(t, err)
	require.Equal(t, stagepb.SleepState_SLEEP_STATE_AWAKE, s)
	waitStateOn(t, a, 0, orchestrator.StateAttached)
	waitSame(t, a, b, "after the wake through B")
	assert.Equal(t, before0, successes(t, bMetrics, 0), "counters are not reset by a record change")

	// Draining: the worker revokes its lease; both heads detach it.
	c.Workers()[1].Stop(t)
	waitStateOn(t, a, 1, orchestrator.StateDetached)
	waitStateOn(t, b, 1, orchestrator.StateDetached)
	waitSame(t, a, b, "after the drain")
}
