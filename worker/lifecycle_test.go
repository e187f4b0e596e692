package worker_test

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/membership/membershiptest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/sim"
)

func TestServesBeforeRegistering(t *testing.T) {
	etcd := membershiptest.Start(t)
	cli := etcd.Client(t)
	ctx := testCtx(t)
	watch := cli.Watch(ctx, membership.StagePrefix("blue", "talker"), clientv3.WithPrefix())

	r := start(t, worker.Config{
		Stage: "talker", ReplicaID: 4, Cluster: "blue", Listen: "127.0.0.1:0",
		Engine:     newSim(t, sim.Config{Role: stagepb.RoleCodes, NumSpeculativeTokens: 2}),
		EtcdClient: cli, LeaseTTL: 5 * time.Second,
		Model: "troupe-omni-sim", Version: "v-test", Labels: map[string]string{"zone": "a"},
	})

	var m membership.Member
	select {
	case resp := <-watch:
		require.NoError(t, resp.Err())
		require.NotEmpty(t, resp.Events)
		ev := resp.Events[0]
		require.Equal(t, clientv3.EventTypePut, ev.Type)
		var err error
		m, err = membership.DecodeMember("blue", string(ev.Kv.Key), ev.Kv.Value)
		require.NoError(t, err)
	case <-time.After(wait):
		t.Fatal("no registration seen")
	}
	// The moment the record exists, its address answers: serving came first.
	h, err := dial(t, m.Addr).Health(ctx, &stagepb.HealthRequest{})
	require.NoError(t, err)
	assert.Equal(t, stagepb.ServingStatus_SERVING_STATUS_SERVING, h.GetStatus())

	// --listen 127.0.0.1:0 advertises the bound port.
	bound := r.Addr().(*net.TCPAddr)
	assert.NotZero(t, bound.Port)
	assert.Equal(t, net.JoinHostPort("127.0.0.1", strconv.Itoa(bound.Port)), m.Addr)
	assert.Equal(t, r.Advertise(), m.Addr)

	assert.Equal(t, "talker", m.Stage)
	assert.Equal(t, uint32(4), m.ReplicaID)
	assert.Equal(t, "sim", m.Engine)
	assert.Equal(t, 2, m.NumSpeculativeTokens)
	assert.Equal(t, "troupe-omni-sim", m.Model)
	assert.Equal(t, "v-test", m.Version)
	assert.Equal(t, map[string]string{"zone": "a"}, m.Labels)
	assert.WithinDuration(t, time.Now(), m.StartedAt, time.Minute)

	r.waitRegistered(t)
	assert.Equal(t, m.Addr, r.Member().Addr)
	assert.Equal(t, uint32(4), r.Member().ReplicaID)
	assert.NoError(t, r.stop(t))
}

func TestAutoReplicaIDs(t *testing.T) {
	cli := membershiptest.Start(t).Client(t)
	ids := map[uint32]bool{}
	for range 2 {
		r := start(t, worker.Config{Stage: "thinker", AutoID: true, EtcdClient: cli, Engine: newSim(t, sim.Config{})})
		r.waitRegistered(t)
		ids[r.Member().ReplicaID] = true
	}
	assert.Equal(t, map[uint32]bool{0: true, 1: true}, ids)
}

func TestDuplicateReplicaIDFailsAtOnce(t *testing.T) {
	cli := membershiptest.Start(t).Client(t)
	first := start(t, worker.Config{Stage: "thinker", ReplicaID: 3, EtcdClient: cli, Engine: newSim(t, sim.Config{})})
	first.waitRegistered(t)

	second, err := worker.New(worker.Config{Stage: "thinker", ReplicaID: 3, EtcdClient: cli, Engine: newSim(t, sim.Config{}), Logger: quietLogger()})
	require.NoError(t, err)
	err = second.Run(testCtx(t))
	require.Error(t, err)
	assert.True(t, errors.Is(err, membership.ErrAlreadyRegistered))
	assert.Equal(t, fmt.Sprintf("membership: replica thinker/3 already registered by %s", first.Advertise()), err.Error())
	select {
	case <-second.Registered():
		t.Fatal("a duplicate must not count as registered")
	default:
	}
	// The holder is untouched.
	resp, err := cli.Get(testCtx(t), membership.MemberKey(membership.DefaultCluster, "thinker", 3))
	require.NoError(t, err)
	require.Len(t, resp.Kvs, 1)
	m, err := membership.DecodeMember(membership.DefaultCluster, string(resp.Kvs[0].Key), resp.Kvs[0].Value)
	require.NoError(t, err)
	assert.Equal(t, first.Advertise(), m.Addr)
	// The refused replica no longer listens.
	_, err = net.DialTimeout("tcp", second.Addr().String(), 5*time.Second)
	assert.Error(t, err)
}

// TestRestartWithinLeaseTakesItsRecordBack (issue 47, item 5): a worker
// whose predecessor at the same address died within its lease (its etcd
// client gone, the lease never revoked) takes the record back instead of
// exiting with "already registered by" its own address.
func TestRestartWithinLeaseTakesItsRecordBack(t *testing.T) {
	etcd := membershiptest.Start(t)
	cli := etcd.Client(t)
	ctx := testCtx(t)
	key := membership.MemberKey(membership.DefaultCluster, "thinker", 0)

	deadCli := etcd.Client(t)
	first := start(t, worker.Config{Stage: "thinker", EtcdClient: deadCli, LeaseTTL: time.Minute, Engine: newSim(t, sim.Config{})})
	first.waitRegistered(t)
	before, err := cli.Get(ctx, key)
	require.NoError(t, err)
	require.Len(t, before.Kvs, 1)
	// Its client goes first, so nothing revokes the lease; then its listener.
	require.NoError(t, deadCli.Close())
	require.NoError(t, first.stop(t))

	second := start(t, worker.Config{Stage: "thinker", Listen: first.Addr().String(), EtcdClient: cli, LeaseTTL: time.Minute, Engine: newSim(t, sim.Config{})})
	second.waitRegistered(t)
	assert.Equal(t, first.Advertise(), second.Advertise())
	after, err := cli.Get(ctx, key)
	require.NoError(t, err)
	require.Len(t, after.Kvs, 1)
	assert.NotEqual(t, before.Kvs[0].Lease, after.Kvs[0].Lease, "under the new process's lease")
	m, err := membership.DecodeMember(membership.DefaultCluster, key, after.Kvs[0].Value)
	require.NoError(t, err)
	assert.Equal(t, second.Member(), m, "the new process's record")
	ttl, err := cli.TimeToLive(ctx, clientv3.LeaseID(before.Kvs[0].Lease))
	require.NoError(t, err)
	assert.Positive(t, ttl.TTL, "the old lease is left to expire")
	h, err := dial(t, m.Addr).Health(ctx, &stagepb.HealthRequest{})
	require.NoError(t, err)
	assert.Equal(t, stagepb.ServingStatus_SERVING_STATUS_SERVING, h.GetStatus())
	assert.NoError(t, second.stop(t))
}

func TestShutdownDeregistersThenFinishesInFlight(t *testing.T) {
	cli := membershiptest.Start(t).Client(t)
	g := newGated(newSim(t, sim.Config{}))
	r := start(t, worker.Config{Stage: "thinker", ReplicaID: 1, EtcdClient: cli, Engine: g})
	r.waitRegistered(t)
	key := membership.MemberKey(membership.DefaultCluster, "thinker", 1)
	resp, err := cli.Get(testCtx(t), key)
	require.NoError(t, err)
	require.Len(t, resp.Kvs, 1)

	wc := dial(t, r.Advertise())
	req := textReq("almost done", &stagepb.SamplingParams{MaxTokens: 12, IgnoreEos: true})
	stream, err := wc.Generate(testCtx(t), req)
	require.NoError(t, err)
	g.waitHeld(t)

	r.cancel() // SIGTERM
	// The record goes first, while the request is still in flight.
	require.Eventually(t, func() bool {
		resp, err := cli.Get(testCtx(t), key)
		return err == nil && len(resp.Kvs) == 0
	}, wait, 5*time.Millisecond)
	r.requireDraining(t, wc)

	close(g.gate)
	chunks, err := recvAll(stream)
	require.NoError(t, err)
	want, err := sim.Expect(stagepb.RoleText, req)
	require.NoError(t, err)
	assert.Equal(t, want.Text, joinText(chunks))
	assert.NoError(t, r.stop(t))
}

// TestFirstRegistrationRetriesUntilEtcdAnswers: a worker that starts while
// etcd is down does not exit: its first registration is retried with
// backoff, each failure logged, and it registers once etcd is back.
func TestFirstRegistrationRetriesUntilEtcdAnswers(t *testing.T) {
	etcd := membershiptest.Start(t)
	cli := etcd.Client(t)
	etcd.Stop()
	var logs syncBuffer
	r := start(t, worker.Config{Stage: "thinker", ReplicaID: 4, EtcdClient: cli, Engine: newSim(t, sim.Config{}),
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), "worker: registration failed; retrying") },
		wait, 20*time.Millisecond, "the failed first registration is logged")
	select {
	case err := <-r.done:
		t.Fatalf("the worker stopped while etcd was down: %v", err)
	case <-r.Registered():
		t.Fatal("registered while etcd was down")
	default:
	}

	etcd.Restart(t)
	r.waitRegistered(t)
	ctx := testCtx(t)
	got, err := cli.Get(ctx, membership.MemberKey(membership.DefaultCluster, "thinker", 4))
	require.NoError(t, err)
	require.Len(t, got.Kvs, 1, "the record is in etcd")
	assert.NotZero(t, got.Kvs[0].Lease, "under a lease")
	require.NoError(t, r.stop(t))
}
