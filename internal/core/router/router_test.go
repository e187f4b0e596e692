package router

import (
	"cmp"
	"context"
	"fmt"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type healthServer struct {
	stagepb.UnimplementedStageServiceServer
}

func (healthServer) Health(context.Context, *stagepb.HealthRequest) (*stagepb.HealthResponse, error) {
	return &stagepb.HealthResponse{Status: stagepb.ServingStatus_SERVING_STATUS_SERVING}, nil
}

// serve starts a real gRPC server on loopback and returns its address and
// a function that stops it.
func serve(t *testing.T) (string, func()) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer()
	stagepb.RegisterStageServiceServer(srv, healthServer{})
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	stop := func() { srv.Stop(); <-done }
	t.Cleanup(stop)
	return lis.Addr().String(), stop
}

func insecureDial(addr string) (*grpc.ClientConn, error) {
	return grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
}

// stages returns the routing of n stages, each with a new instance of the
// named policy.
func stages(t *testing.T, n int, policy string) []StageRouting {
	t.Helper()
	out := make([]StageRouting, n)
	for i := range out {
		p, err := NewPolicy(policy, PolicyOptions{})
		require.NoError(t, err)
		out[i].Policy = p
	}
	return out
}

func pick(t *testing.T, r *Router, stage int, exclude ...*Replica) *Replica {
	t.Helper()
	d, err := r.Pick(stage, &Request{}, exclude)
	require.NoError(t, err)
	return d.Replica
}

func addReplica(t *testing.T, r *Router, stage int, id uint32, addr string) *Replica {
	t.Helper()
	rep, err := r.Dial(ReplicaSpec{Key: Key{Stage: stage, Replica: id}, StageName: "s", EngineIndex: int(id), Addr: addr})
	require.NoError(t, err)
	require.NoError(t, r.Add(rep))
	return rep
}

func TestSnapshotsAreImmutable(t *testing.T) {
	addr, _ := serve(t)
	r := New(stages(t, 2, ""), insecureDial, nil)
	defer r.Close()

	before := r.Snapshot()
	a := addReplica(t, r, 0, 3, addr)
	mid := r.Snapshot()
	addReplica(t, r, 0, 1, addr)
	after := r.Snapshot()

	assert.Zero(t, before.Stage(0).Len(), "an old snapshot never sees later adds")
	assert.Equal(t, []*Replica{a}, slices.Collect(mid.Stage(0).All()))
	require.Len(t, stageOf(after, 0), 2)
	assert.Equal(t, uint32(1), stageOf(after, 0)[0].Key.Replica, "sorted by replica id")

	r.Remove(Key{Stage: 0, Replica: 3})
	assert.Len(t, stageOf(after, 0), 2, "removal publishes a new snapshot")
	assert.Len(t, stageOf(r.Snapshot(), 0), 1)
	assert.Empty(t, stageOf(r.Snapshot(), 5), "out-of-range stage is empty")
	assert.Error(t, r.Add(&Replica{Key: Key{Stage: 9}}), "stage out of range")
}

func TestRoundRobinSpreadsEvenly(t *testing.T) {
	addr, _ := serve(t)
	r := New(stages(t, 1, "round_robin"), insecureDial, nil)
	defer r.Close()
	for id := range uint32(3) {
		addReplica(t, r, 0, id, addr)
	}
	counts := map[uint32]int{}
	for range 300 {
		d, err := r.Pick(0, &Request{}, nil)
		require.NoError(t, err)
		assert.Equal(t, ReasonRotation, d.Reason)
		assert.Equal(t, "round_robin", d.Policy)
		counts[d.Replica.Key.Replica]++
	}
	assert.Equal(t, map[uint32]int{0: 100, 1: 100, 2: 100}, counts)
}

func TestLeastLoadedAvoidsBusyReplica(t *testing.T) {
	addr, _ := serve(t)
	r := New(stages(t, 1, ""), insecureDial, nil)
	defer r.Close()
	busy := addReplica(t, r, 0, 0, addr)
	idle := addReplica(t, r, 0, 1, addr)
	c := []*Replica{busy, idle}
	busy.SetLoad(10)
	for _, name := range []string{"least_loaded", "power_of_two"} {
		p, err := NewPolicy(name, PolicyOptions{})
		require.NoError(t, err)
		for range 50 {
			d := p.Pick(&Request{}, c)
			assert.Same(t, idle, d.Replica, name)
			assert.Equal(t, ReasonLoad, d.Reason)
		}
	}
	// In-flight work sent by this head counts too.
	busy.SetLoad(0)
	busy.Acquire()
	defer busy.Release()
	assert.Same(t, idle, LeastLoaded{}.Pick(&Request{}, c).Replica)
}

func TestPickSkipsSleepingExcludedAndReportsNoReplica(t *testing.T) {
	addr, _ := serve(t)
	r := New(stages(t, 1, "round_robin"), insecureDial, nil)
	defer r.Close()

	_, err := r.Pick(0, &Request{}, nil)
	require.ErrorIs(t, err, ErrNoReplica)

	a := addReplica(t, r, 0, 0, addr)
	b := addReplica(t, r, 0, 1, addr)
	a.SetSleepState(stagepb.SleepState_SLEEP_STATE_WEIGHTS_OFFLOADED)
	for range 10 {
		assert.Same(t, b, pick(t, r, 0))
	}
	_, err = r.Pick(0, &Request{}, []*Replica{b})
	require.ErrorIs(t, err, ErrNoReplica)
	// Session affinity never picks an unroutable or excluded replica either.
	r2 := New([]StageRouting{{SessionAffinity: true}}, insecureDial, nil)
	defer r2.Close()
	a2 := addReplica(t, r2, 0, 0, addr)
	b2 := addReplica(t, r2, 0, 1, addr)
	a2.SetSleepState(stagepb.SleepState_SLEEP_STATE_WEIGHTS_OFFLOADED)
	for i := range 20 {
		d, err := r2.Pick(0, &Request{SessionKey: fmt.Sprint("s", i)}, nil)
		require.NoError(t, err)
		assert.Same(t, b2, d.Replica)
	}
	_, err = r2.Pick(0, &Request{SessionKey: "s"}, []*Replica{b2})
	require.ErrorIs(t, err, ErrNoReplica)
}

func TestBrokenConnectionLeavesRotationAndReturns(t *testing.T) {
	addr, stop := serve(t)
	r := New(stages(t, 1, ""), insecureDial, nil)
	defer r.Close()
	rep := addReplica(t, r, 0, 0, addr)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := rep.Client.Health(ctx, &stagepb.HealthRequest{})
	require.NoError(t, err)

	stop()
	require.Eventually(t, func() bool { return !rep.Routable() }, 20*time.Second, 10*time.Millisecond,
		"a dead peer leaves rotation without waiting for its lease")

	// A server on the same address brings it back.
	lis, err := net.Listen("tcp", addr)
	require.NoError(t, err)
	srv := grpc.NewServer()
	stagepb.RegisterStageServiceServer(srv, healthServer{})
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	defer func() { srv.Stop(); <-done }()
	require.Eventually(t, rep.Routable, 30*time.Second, 10*time.Millisecond, "a healthy connection returns to rotation")
}

func TestRemovedReplicaClosesAfterLastRequest(t *testing.T) {
	addr, _ := serve(t)
	r := New(stages(t, 1, ""), insecureDial, nil)
	defer r.Close()
	rep := addReplica(t, r, 0, 0, addr)
	rep.Acquire()
	r.Remove(rep.Key)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := rep.Client.Health(ctx, &stagepb.HealthRequest{})
	require.NoError(t, err, "an in-flight request outlives the leave (drain)")
	rep.Release()
	_, err = rep.Client.Health(ctx, &stagepb.HealthRequest{})
	require.Error(t, err, "the connection is closed after the last release")
}

func TestUnknownPolicy(t *testing.T) {
	_, err := NewPolicy("fastest", PolicyOptions{})
	require.ErrorContains(t, err, `router: unknown policy "fastest"`)
	_, err = NewPolicy("prefix_aware", PolicyOptions{PrefixSource: "engine"})
	require.ErrorContains(t, err, `router: unknown prefix source "engine"`)
	require.NoError(t, CheckPolicy(""))
	for _, name := range PolicyNames {
		p, err := NewPolicy(name, PolicyOptions{})
		require.NoError(t, err)
		assert.Equal(t, name, p.Name())
	}
}

// TestHoldPublishesOnCommit: between Hold and Commit, Add and Remove
// change nothing readers see; Commit publishes them all in one snapshot,
// sorted, with the order a snapshot built from scratch has, and retires
// the replaced and removed replicas only then.
func TestHoldPublishesOnCommit(t *testing.T) {
	addr, _ := serve(t)
	r := New(stages(t, 2, ""), insecureDial, nil)
	defer r.Close()
	two := addReplica(t, r, 0, 2, addr)
	four := addReplica(t, r, 0, 4, addr)
	before := r.Snapshot()

	r.Hold()
	one := addReplica(t, r, 0, 1, addr)
	three := addReplica(t, r, 0, 3, addr)
	newFour := addReplica(t, r, 0, 4, addr)
	got, ok := r.Remove(Key{Stage: 0, Replica: 2})
	require.True(t, ok)
	assert.Same(t, two, got)
	_, ok = r.Remove(Key{Stage: 0, Replica: 9})
	assert.False(t, ok, "nothing under that key")
	assert.Same(t, before, r.Snapshot(), "held changes are not published")
	assert.False(t, two.removed.Load() || four.removed.Load(), "nothing retired before the commit")

	r.Commit()
	assert.Equal(t, []*Replica{one, three, newFour}, stageOf(r.Snapshot(), 0))
	assert.True(t, two.removed.Load(), "removed: retired at the commit")
	assert.True(t, four.removed.Load(), "replaced: retired at the commit")
	assert.False(t, newFour.removed.Load())
	sameOrder(t, newStageOrder(stageOf(r.Snapshot(), 0)), r.Snapshot().order(0))

	// A large batch rebuilds the stage's order; it is the same order.
	r.Hold()
	for id := uint32(10); id < 10+2*orderRebuild; id++ {
		addReplica(t, r, 1, id, addr)
	}
	r.Remove(Key{Stage: 0, Replica: 1})
	r.Commit()
	require.Len(t, stageOf(r.Snapshot(), 1), 2*orderRebuild)
	assert.True(t, slices.IsSortedFunc(stageOf(r.Snapshot(), 1), func(a, b *Replica) int { return cmp.Compare(a.Key.Replica, b.Key.Replica) }))
	sameOrder(t, newStageOrder(stageOf(r.Snapshot(), 1)), r.Snapshot().order(1))
	sameOrder(t, newStageOrder(stageOf(r.Snapshot(), 0)), r.Snapshot().order(0))
	assert.Equal(t, []*Replica{three, newFour}, stageOf(r.Snapshot(), 0))

	// Close closes what a hold added but never published.
	r.Hold()
	held := addReplica(t, r, 0, 20, addr)
	r.Close()
	assert.True(t, held.removed.Load())
}

// sameOrder asserts two stage orders hold the same members in the same
// groups, in the same order.
func sameOrder(t *testing.T, want, got *stageOrder) {
	t.Helper()
	for g := range want.groups {
		require.Len(t, got.groups[g], len(want.groups[g]), "group %d", g)
		for i, m := range want.groups[g] {
			assert.Equal(t, m.key, got.groups[g][i].key, "group %d member %d", g, i)
			assert.Same(t, m.rep, got.groups[g][i].rep, "group %d member %d", g, i)
		}
	}
}

// stageOf is a stage's replicas as a slice, in replica id order.
func stageOf(s *Snapshot, stage int) []*Replica { return slices.Collect(s.Stage(stage).All()) }
