package orchestrator

import (
	"context"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/membership/membershiptest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// probeServer is a real gRPC StageService that only answers Health, with a
// configurable sleep state and an optional gate that holds the answer.
type probeServer struct {
	stagepb.UnimplementedStageServiceServer
	sleep  stagepb.SleepState
	stage  string // the stage it says it serves; "": none said
	gate   chan struct{}
	probes atomic.Int64 // Health calls answered or held
}

func (p *probeServer) Health(ctx context.Context, _ *stagepb.HealthRequest) (*stagepb.HealthResponse, error) {
	p.probes.Add(1)
	if p.gate != nil {
		select {
		case <-p.gate:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return &stagepb.HealthResponse{Status: stagepb.ServingStatus_SERVING_STATUS_SERVING, SleepState: p.sleep, Stage: p.stage}, nil
}

func startProbeServer(t *testing.T, p *probeServer) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer()
	stagepb.RegisterStageServiceServer(srv, p)
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	t.Cleanup(func() { srv.Stop(); <-done })
	return lis.Addr().String()
}

type testHead struct {
	*Head
	metrics *prometheus.Registry
	cli     *clientv3.Client
}

func startHead(t *testing.T, cli *clientv3.Client, p Pipeline) *testHead {
	t.Helper()
	reg := prometheus.NewRegistry()
	h, err := New(cli, Config{
		Pipeline:          p,
		LogStats:          true,
		Metrics:           reg,
		ReconcileInterval: time.Hour,
		Dial: func(addr string) (*grpc.ClientConn, error) {
			return grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		},
	})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	return &testHead{Head: h, metrics: reg, cli: cli}
}

func register(t *testing.T, cli *clientv3.Client, stage string, id uint32, addr string) *membership.Registration {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, err := membership.Register(ctx, cli, membership.RegisterConfig{
		Member: membership.Member{Stage: stage, ReplicaID: id, Addr: addr, Engine: "probe", Version: "test", StartedAt: time.Now()},
		TTL:    5 * time.Second,
	})
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = r.Close(ctx)
	})
	return r
}

// series reads one child without creating it (see export_test.go).
var series = GatheredValue

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	require.Eventually(t, cond, 30*time.Second, 5*time.Millisecond, what)
}

// TestRoutedOnlyAfterSeriesBound is the seed's crash as a test: while
// replicas join, a reader hammers the router, and every replica it can see
// must already have its series bound.
func TestRoutedOnlyAfterSeriesBound(t *testing.T) {
	e := membershiptest.Start(t)
	cli := e.Client(t)
	h := startHead(t, cli, Pipeline{Model: "m", Stages: []Stage{{Name: "thinker"}, {Name: "talker"}}})

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
			for _, rep := range h.router.Snapshot().All() {
				seen.Add(1)
				v, ok := series(t, h.metrics, "troupe_replica_attached", map[string]string{
					"stage": fmt.Sprint(rep.Key.Stage), "replica": fmt.Sprint(rep.Key.Replica),
				})
				if !ok || v != 1 {
					violations.Add(1)
				}
			}
		}
	}()

	addr := startProbeServer(t, &probeServer{})
	for id := range uint32(6) {
		register(t, cli, "thinker", id*3, addr) // sparse ids
		register(t, cli, "talker", id, addr)
	}
	waitFor(t, "12 replicas routable", func() bool { return len(h.router.Snapshot().All()) == 12 })
	// Joins can all land before the reader's first pass; it must have
	// checked replicas (at the latest, all 12 routed) before it stops.
	waitFor(t, "the reader checked routed replicas", func() bool { return seen.Load() > 0 })
	close(stop)
	wg.Wait()
	assert.Zero(t, violations.Load(), "a routable replica had no bound series")
	assert.Positive(t, seen.Load())

	// Engine indexes are distinct and stable.
	idx := map[int]bool{}
	for _, r := range h.Replicas() {
		assert.False(t, idx[r.EngineIndex], "duplicate engine index %d", r.EngineIndex)
		idx[r.EngineIndex] = true
		assert.Equal(t, StateAttached, r.State)
	}
}

// TestSlowProbeDoesNotRouteOrBlock: a replica whose Health is slow is not
// routed before it answers, and does not hold up another replica's join.
func TestSlowProbeDoesNotRouteOrBlock(t *testing.T) {
	e := membershiptest.Start(t)
	cli := e.Client(t)
	h := startHead(t, cli, Pipeline{Model: "m", Stages: []Stage{{Name: "thinker"}}})

	slow := &probeServer{gate: make(chan struct{})}
	register(t, cli, "thinker", 0, startProbeServer(t, slow))
	register(t, cli, "thinker", 1, startProbeServer(t, &probeServer{}))
	waitFor(t, "fast replica routable", func() bool { return h.router.Snapshot().Stage(0).Len() == 1 })
	assert.Equal(t, uint32(1), h.router.Snapshot().Stage(0).At(0).Key.Replica)
	_, bound := series(t, h.metrics, "troupe_replica_attached", map[string]string{"replica": "0"})
	assert.False(t, bound, "no series before the probe answers")
	rows := h.Replicas()
	require.Len(t, rows, 2)
	assert.Equal(t, StateUnhealthy, rows[0].State, "a joined but unprobed replica shows as unhealthy")

	close(slow.gate)
	waitFor(t, "slow replica routable", func() bool { return h.router.Snapshot().Stage(0).Len() == 2 })
}

// TestSleepingReplicaJoinsAsleep: the worker's reported sleep state is bound
// and keeps the replica out of rotation.
func TestSleepingReplicaJoinsAsleep(t *testing.T) {
	e := membershiptest.Start(t)
	cli := e.Client(t)
	h := startHead(t, cli, Pipeline{Model: "m", Stages: []Stage{{Name: "thinker"}}})

	register(t, cli, "thinker", 4, startProbeServer(t, &probeServer{sleep: stagepb.SleepState_SLEEP_STATE_DISCARD_ALL}))
	waitFor(t, "replica attached", func() bool { return h.router.Snapshot().Stage(0).Len() == 1 })
	v, ok := series(t, h.metrics, "troupe_engine_sleep_state", map[string]string{"replica": "4", "sleep_state": "discard_all"})
	assert.True(t, ok)
	assert.Equal(t, 1.0, v)
	v, _ = series(t, h.metrics, "troupe_engine_sleep_state", map[string]string{"replica": "4", "sleep_state": "awake"})
	assert.Equal(t, 0.0, v)
	ok, reason := h.Ready()
	assert.False(t, ok)
	assert.Contains(t, reason, "thinker")
	assert.Equal(t, StateSleeping, h.Replicas()[0].State)
}

// TestLeaveDetachesAndKeepsSeries: a leave stops routing, sets
// replica_attached=0 and keeps the series; a rejoin keeps the index.
func TestLeaveDetachesAndKeepsSeries(t *testing.T) {
	e := membershiptest.Start(t)
	cli := e.Client(t)
	h := startHead(t, cli, Pipeline{Model: "m", Stages: []Stage{{Name: "thinker"}}})
	addr := startProbeServer(t, &probeServer{})

	r := register(t, cli, "thinker", 2, addr)
	waitFor(t, "attached", func() bool { return h.router.Snapshot().Stage(0).Len() == 1 })
	index := h.Replicas()[0].EngineIndex
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, r.Close(ctx))
	waitFor(t, "detached", func() bool { return h.router.Snapshot().Stage(0).Len() == 0 })
	waitFor(t, "replica_attached=0", func() bool {
		v, ok := series(t, h.metrics, "troupe_replica_attached", map[string]string{"replica": "2"})
		return ok && v == 0
	})
	_, kept := series(t, h.metrics, "troupe_generation_tokens_total", map[string]string{"replica": "2"})
	assert.True(t, kept, "counters of a detached replica are kept")
	// detach removes the replica from the router and its series first,
	// then publishes the record: the API's view may lag them a moment.
	waitFor(t, "listed as detached", func() bool { return h.Replicas()[0].State == StateDetached })

	register(t, cli, "thinker", 2, startProbeServer(t, &probeServer{}))
	waitFor(t, "rejoined", func() bool { return h.router.Snapshot().Stage(0).Len() == 1 })
	assert.Equal(t, index, h.router.Snapshot().Stage(0).At(0).EngineIndex, "a rejoin keeps its engine index")
	v, _ := series(t, h.metrics, "troupe_membership_events_total", map[string]string{"type": "join"})
	assert.Equal(t, 2.0, v)
}

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestRecordChangeIsAppliedInPlace: a changed record of the same process
// (the worker wrote its new sleep state) moves the replica in and out of
// rotation on the head without a new connection, probe or engine index;
// a record of a new process (another start time) is probed again.
func TestRecordChangeIsAppliedInPlace(t *testing.T) {
	e := membershiptest.Start(t)
	cli := e.Client(t)
	h := startHead(t, cli, Pipeline{Model: "m", Stages: []Stage{{Name: "thinker"}}})
	ps := &probeServer{}
	// A long lease: a lease lost on a loaded machine would add a leave probe.
	reg, err := membership.Register(context.Background(), cli, membership.RegisterConfig{
		Member: membership.Member{Stage: "thinker", ReplicaID: 2, Addr: startProbeServer(t, ps), Engine: "probe", Version: "test", StartedAt: time.Now()},
		TTL:    60 * time.Second,
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = reg.Close(context.Background()) })
	waitFor(t, "replica attached", func() bool { return h.router.Snapshot().Stage(0).Len() == 1 })
	rep := h.router.Snapshot().Stage(0).At(0)
	probes := ps.probes.Load()
	index := h.Replicas()[0].EngineIndex
	sleepSeries := func(state string) float64 {
		v, _ := series(t, h.metrics, "troupe_engine_sleep_state", map[string]string{"replica": "2", "sleep_state": state})
		return v
	}

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, reg.Update(ctx, func(m *membership.Member) { m.SleepState = "weights_offloaded" }))
	waitFor(t, "sleeping", func() bool { return h.Replicas()[0].State == StateSleeping })
	assert.Same(t, rep, h.router.Snapshot().Stage(0).At(0), "the same connection")
	assert.False(t, rep.Routable())
	assert.Equal(t, 1.0, sleepSeries("weights_offloaded"))
	assert.Equal(t, 0.0, sleepSeries("awake"))
	ok, _ := h.Ready()
	assert.False(t, ok, "no routable thinker while it sleeps")

	require.NoError(t, reg.Update(ctx, func(m *membership.Member) { m.SleepState = "awake" }))
	waitFor(t, "awake", func() bool { return h.Replicas()[0].State == StateAttached })
	assert.Same(t, rep, h.router.Snapshot().Stage(0).At(0))
	assert.Equal(t, 1.0, sleepSeries("awake"))
	assert.Equal(t, probes, ps.probes.Load(), "no probe for a changed record of the same process")
	assert.Equal(t, index, h.Replicas()[0].EngineIndex)
	joins, _ := series(t, h.metrics, "troupe_membership_events_total", map[string]string{"type": "join"})
	assert.Equal(t, 3.0, joins, "each change is a join event")

	// A new process under the same key (another start time) is probed.
	require.NoError(t, reg.Update(ctx, func(m *membership.Member) { m.StartedAt = m.StartedAt.Add(time.Second) }))
	waitFor(t, "re-probed", func() bool { return ps.probes.Load() > probes })
	waitFor(t, "a new connection", func() bool {
		reps := h.router.Snapshot().Stage(0)
		return reps.Len() == 1 && reps.At(0) != rep
	})
	assert.Equal(t, index, h.Replicas()[0].EngineIndex, "the key keeps its engine index")
}
