package worker_test

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/membership/membershiptest"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/sim"
)

// switchable is the real sim engine with an availability switch, as an
// upstream engine has (worker.Availability).
type switchable struct {
	*sim.Engine
	mu      sync.Mutex
	ok      bool
	changed chan struct{}
}

func (s *switchable) Available() (bool, <-chan struct{}) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ok, s.changed
}

func (s *switchable) set(ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ok != ok {
		s.ok = ok
		close(s.changed)
		s.changed = make(chan struct{})
	}
}

// keyExists reads the member key straight from etcd.
func keyExists(t *testing.T, cli *clientv3.Client, key string) bool {
	t.Helper()
	resp, err := cli.Get(testCtx(t), key)
	require.NoError(t, err)
	return resp.Count == 1
}

// TestRegistersOnlyWhileAvailable: an engine that is not available yet
// keeps the replica out of etcd (while gRPC already serves and reports
// NOT_SERVING); it registers once available, revokes when unavailable and
// comes back under the same replica id.
func TestRegistersOnlyWhileAvailable(t *testing.T) {
	etcd := membershiptest.Start(t)
	cli := etcd.Client(t)
	eng := &switchable{Engine: newSim(t, sim.Config{}), changed: make(chan struct{})}
	r := start(t, worker.Config{Stage: "thinker", AutoID: true, Engine: eng, EtcdClient: cli, LeaseTTL: 5 * time.Second})
	conn := dialWith(t, r.Advertise(), insecure.NewCredentials())
	grpcHealth := healthpb.NewHealthClient(conn)
	require.Eventually(t, func() bool {
		h, err := grpcHealth.Check(testCtx(t), &healthpb.HealthCheckRequest{})
		return err == nil && h.GetStatus() == healthpb.HealthCheckResponse_NOT_SERVING
	}, wait, time.Millisecond, "serving gRPC, NOT_SERVING")
	select {
	case <-r.Registered():
		t.Fatal("registered while the engine is unavailable")
	default:
	}
	list, err := membership.List(testCtx(t), cli, membership.DefaultCluster)
	require.NoError(t, err)
	assert.Empty(t, list)

	eng.set(true)
	r.waitRegistered(t)
	id := r.Member().ReplicaID
	key := membership.MemberKey(membership.DefaultCluster, "thinker", id)
	assert.True(t, keyExists(t, cli, key))
	h, err := grpcHealth.Check(testCtx(t), &healthpb.HealthCheckRequest{})
	require.NoError(t, err)
	assert.Equal(t, healthpb.HealthCheckResponse_SERVING, h.GetStatus())

	for range 2 {
		eng.set(false)
		require.Eventually(t, func() bool { return !keyExists(t, cli, key) }, wait, time.Millisecond, "revoked")
		eng.set(true)
		require.Eventually(t, func() bool { return keyExists(t, cli, key) }, wait, time.Millisecond, "back")
		assert.Equal(t, id, r.Member().ReplicaID)
	}
	require.NoError(t, r.stop(t))
	assert.False(t, keyExists(t, cli, key), "deregistered at shutdown")
}

// TestStopWhileUnavailable: a worker whose engine never becomes available
// stops cleanly on its context.
func TestStopWhileUnavailable(t *testing.T) {
	etcd := membershiptest.Start(t)
	eng := &switchable{Engine: newSim(t, sim.Config{}), changed: make(chan struct{})}
	r := start(t, worker.Config{Stage: "thinker", AutoID: true, Engine: eng, EtcdClient: etcd.Client(t)})
	grpcHealth := healthpb.NewHealthClient(dialWith(t, r.Advertise(), insecure.NewCredentials()))
	require.Eventually(t, func() bool { // Run is waiting on the engine
		h, err := grpcHealth.Check(testCtx(t), &healthpb.HealthCheckRequest{})
		return err == nil && h.GetStatus() == healthpb.HealthCheckResponse_NOT_SERVING
	}, wait, time.Millisecond)
	require.NoError(t, r.stop(t))
	select {
	case <-r.Registered():
		t.Fatal("registered")
	default:
	}
}
