package orchestrator_test

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/internal/core/stats"
	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
)

// TestMinimalReplicaSeriesBoundBeforeRoutingKeptAfterLeaving holds the
// seed's rule with --replica-series=minimal, through a real cluster (real
// etcd, sim workers over gRPC, the head's registry read with testutil):
// while replicas join, every replica the head lists as attached already
// has its per-replica series and its stage's aggregates; a replica that
// leaves keeps its series (replica_attached=0) and the stage aggregate
// keeps its requests; no replica has a counter or histogram of its own.
func TestMinimalReplicaSeriesBoundBeforeRoutingKeptAfterLeaving(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, ReplicaSeries: stats.ReplicaSeriesMinimal})
	ctx := ctxT(t)

	var violations, seen atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			for _, r := range c.Head.Replicas() {
				if r.State != orchestrator.StateAttached {
					continue
				}
				seen.Add(1)
				labels := map[string]string{"stage": "0", "replica": fmt.Sprint(r.Replica)}
				v, ok := value(t, c.Metrics, "troupe_replica_attached", labels)
				_, running := value(t, c.Metrics, "troupe_num_requests_running", labels)
				_, agg := value(t, c.Metrics, "troupe_request_success_total", map[string]string{"stage": "0", "replica": "", "finished_reason": "stop"})
				if !ok || v != 1 || !running || !agg {
					violations.Add(1)
				}
			}
		}
	}()
	var added []*orchestratortest.Worker
	for range 3 {
		w := c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{})
		added = append(added, w)
	}
	for _, w := range added {
		c.WaitState(t, "thinker", w.ReplicaID(), "attached")
	}
	require.Eventually(t, func() bool { return seen.Load() > 0 }, 30*time.Second, 5*time.Millisecond, "the reader checked attached replicas")
	close(stop)
	wg.Wait()
	assert.Zero(t, violations.Load(), "an attached replica had no bound series")

	const requests = 8
	for i := range requests {
		_, err := c.Head.Execute(ctx, orchestrator.Request{ID: fmt.Sprint("m", i), Prompt: fmt.Sprintf("minimal %d", i), Sampling: sampling(2, int64(i))}, nil)
		require.NoError(t, err)
	}
	stageAgg := map[string]string{"stage": "0", "replica": ""}
	v, ok := value(t, c.Metrics, "troupe_e2e_request_latency_seconds", stageAgg)
	require.True(t, ok)
	assert.Equal(t, float64(requests), v, "the stage aggregate counts every request")
	for _, w := range c.Workers() {
		_, own := value(t, c.Metrics, "troupe_e2e_request_latency_seconds", map[string]string{"stage": "0", "replica": fmt.Sprint(w.ReplicaID())})
		assert.False(t, own, "minimal: replica %d has no counter of its own", w.ReplicaID())
	}

	gone := added[0]
	gone.Stop(t)
	c.WaitState(t, "thinker", gone.ReplicaID(), "detached")
	attached, ok := value(t, c.Metrics, "troupe_replica_attached", map[string]string{"stage": "0", "replica": fmt.Sprint(gone.ReplicaID())})
	require.True(t, ok, "kept after leaving")
	assert.Zero(t, attached)
	_, ok = value(t, c.Metrics, "troupe_kv_cache_usage_perc", map[string]string{"stage": "0", "replica": fmt.Sprint(gone.ReplicaID())})
	assert.True(t, ok, "its gauges are kept")
	v, _ = value(t, c.Metrics, "troupe_e2e_request_latency_seconds", stageAgg)
	assert.Equal(t, float64(requests), v, "the stage keeps its count after a replica left")
}
