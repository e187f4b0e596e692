package worker_test

import (
	"bytes"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/membership/membershiptest"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/sim"
)

// syncBuffer is a log sink safe for the worker's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *syncBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *syncBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// gauge reads a gauge without labels from reg; ok is false when the
// family is absent.
func gauge(t *testing.T, reg *prometheus.Registry, name string) (v float64, ok bool) {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) == 1 {
			return mf.GetMetric()[0].GetGauge().GetValue(), true
		}
	}
	return 0, false
}

// TestWorkerEtcdGauges: a worker's troupe_etcd_up follows its etcd (1, 0
// while the real etcd is stopped, 1 once it is back), its log says when
// etcd was lost and found again, and troupe_lease_keepalive_lag_seconds
// grows while etcd is silent and falls back once the lease is answered.
func TestWorkerEtcdGauges(t *testing.T) {
	etcd := membershiptest.Start(t)
	cli := etcd.Client(t)
	reg := prometheus.NewRegistry()
	var logs syncBuffer
	r := start(t, worker.Config{
		Stage: "thinker", ReplicaID: 0, EtcdClient: cli, LeaseTTL: 3 * time.Second,
		Engine: newSim(t, sim.Config{}), Metrics: reg,
		Logger: slog.New(slog.NewTextHandler(&logs, nil)),
	})
	r.waitRegistered(t)

	up := func(want float64) func() bool {
		return func() bool { v, ok := gauge(t, reg, "troupe_etcd_up"); return ok && v == want }
	}
	lag := func(t *testing.T) float64 {
		v, ok := gauge(t, reg, "troupe_lease_keepalive_lag_seconds")
		require.True(t, ok, "the lag is exported while registered")
		return v
	}
	require.Eventually(t, up(1), wait, 20*time.Millisecond, "up while etcd answers")
	assert.Less(t, lag(t), 3.0, "a live lease is answered within its TTL")

	etcd.Stop()
	require.Eventually(t, up(0), wait, 20*time.Millisecond, "down while etcd is stopped")
	assert.Contains(t, logs.String(), "etcd unreachable")
	require.Eventually(t, func() bool {
		v, ok := gauge(t, reg, "troupe_lease_keepalive_lag_seconds")
		return !ok || v > 3 // past the TTL, or the lease is already given up
	}, wait, 50*time.Millisecond, "the keepalive lag grows while etcd is silent")

	etcd.Restart(t)
	require.Eventually(t, up(1), wait, 20*time.Millisecond, "up again")
	assert.Contains(t, logs.String(), "etcd reachable again")
	require.Eventually(t, func() bool {
		v, ok := gauge(t, reg, "troupe_lease_keepalive_lag_seconds")
		return ok && v < 3
	}, wait, 50*time.Millisecond, "the (re-registered) lease is answered again")
}

// TestWorkerMetricsNeedEtcd: without an etcd client there is nothing to
// watch, and nothing is registered.
func TestWorkerMetricsNeedEtcd(t *testing.T) {
	reg := prometheus.NewRegistry()
	r := start(t, worker.Config{Stage: "thinker", Engine: newSim(t, sim.Config{}), Metrics: reg})
	r.waitRegistered(t)
	mfs, err := reg.Gather()
	require.NoError(t, err)
	assert.Empty(t, mfs)
}
