package membership_test

import (
	"context"
	"fmt"
	"net"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/membership/membershiptest"
)

func TestRegisterJoinThenCloseLeaves(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	wa := startWatcher(t, membership.NewWatcher(cli, membership.WatchConfig{Logger: quietLogger()}))

	m := member("thinker", 2, "127.0.0.1:7002")
	m.Labels = map[string]string{"zone": "a"}
	r := register(t, cli, membership.RegisterConfig{Member: m, TTL: 5 * time.Second})
	require.Equal(t, "/troupe/default/members/thinker/2", r.Key())

	join := wa.next(t)
	require.Equal(t, membership.Join, join.Type)
	require.Equal(t, r.Key(), join.Key)
	require.Equal(t, m, join.Member)
	require.Positive(t, join.Revision)

	// The key is attached to the registration's lease, with the TTL asked.
	ctx := testCtx(t)
	got, err := cli.Get(ctx, r.Key())
	require.NoError(t, err)
	require.Len(t, got.Kvs, 1)
	require.Equal(t, int64(r.Lease()), got.Kvs[0].Lease)
	ttl, err := cli.TimeToLive(ctx, r.Lease())
	require.NoError(t, err)
	require.Equal(t, int64(5), ttl.GrantedTTL)

	require.NoError(t, r.Close(ctx))
	leave := wa.next(t)
	require.Equal(t, membership.Leave, leave.Type)
	require.Equal(t, r.Key(), leave.Key)
	require.Equal(t, m, leave.Member, "a leave carries the last record")
	require.Greater(t, leave.Revision, join.Revision)
	_, open := <-r.Events()
	require.False(t, open, "events are closed after Close")
	require.NoError(t, r.Close(ctx), "a second Close does nothing")
}

func TestLeaseExpiresWhenWorkerDies(t *testing.T) {
	e := membershiptest.Start(t)
	watchCli := dial(t, e.Endpoints())
	wa := startWatcher(t, membership.NewWatcher(watchCli, membership.WatchConfig{Logger: quietLogger()}))

	// The worker's own client: closing it is the worker dying; nobody
	// revokes the lease, so only its expiry removes the record.
	workerCli := dial(t, e.Endpoints())
	r := register(t, workerCli, membership.RegisterConfig{Member: member("talker", 0, "127.0.0.1:7100"), TTL: time.Second})
	require.True(t, is(membership.Join, r.Key())(wa.next(t)))

	require.NoError(t, workerCli.Close())
	leave := wa.next(t)
	require.Equal(t, membership.Leave, leave.Type)
	require.Equal(t, r.Key(), leave.Key)
	select {
	case <-drained(r.Events()): // closed once the registration noticed its client is gone
	case <-time.After(wait):
		t.Fatal("registration did not stop after its client closed")
	}
}

func TestDuplicateIsRejectedWithoutOverwrite(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	ctx := testCtx(t)
	first := register(t, cli, membership.RegisterConfig{Member: member("thinker", 3, "10.0.0.1:7000")})
	leasesBefore, err := cli.Leases(ctx)
	require.NoError(t, err)

	_, err = membership.Register(ctx, cli, membership.RegisterConfig{
		Member: member("thinker", 3, "10.0.0.2:7000"), Logger: quietLogger(),
	})
	require.Error(t, err)
	require.ErrorIs(t, err, membership.ErrAlreadyRegistered)
	require.EqualError(t, err, "membership: replica thinker/3 already registered by 10.0.0.1:7000")
	var are *membership.AlreadyRegisteredError
	require.ErrorAs(t, err, &are)
	require.Equal(t, "10.0.0.1:7000", are.Addr)

	got, err := cli.Get(ctx, first.Key())
	require.NoError(t, err)
	require.Len(t, got.Kvs, 1)
	require.Contains(t, string(got.Kvs[0].Value), `"addr":"10.0.0.1:7000"`, "the holder's record is untouched")
	require.Equal(t, int64(first.Lease()), got.Kvs[0].Lease)
	leasesAfter, err := cli.Leases(ctx)
	require.NoError(t, err)
	require.Len(t, leasesAfter.Leases, len(leasesBefore.Leases), "the refused registration's lease is revoked")
}

func TestAutoIDFillsTheSmallestGap(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	for _, id := range []uint32{0, 1, 3} {
		register(t, cli, membership.RegisterConfig{Member: member("vocoder", id, fmt.Sprintf("127.0.0.1:%d", 7000+id))})
	}
	// Another stage's ids do not count.
	register(t, cli, membership.RegisterConfig{Member: member("talker", 2, "127.0.0.1:8002")})

	r := register(t, cli, membership.RegisterConfig{Member: member("vocoder", 99, "127.0.0.1:7999"), AutoID: true})
	require.Equal(t, uint32(2), r.Member().ReplicaID)
	require.Equal(t, "/troupe/default/members/vocoder/2", r.Key())
	got, err := cli.Get(testCtx(t), r.Key())
	require.NoError(t, err)
	require.Contains(t, string(got.Kvs[0].Value), `"replica_id":2`)

	r = register(t, cli, membership.RegisterConfig{Member: member("vocoder", 0, "127.0.0.1:7998"), AutoID: true})
	require.Equal(t, uint32(4), r.Member().ReplicaID)
}

func TestConcurrentAutoIDsAreDistinct(t *testing.T) {
	e := membershiptest.Start(t)
	const n = 8
	ctx := testCtx(t)
	regs := make([]*membership.Registration, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		// One client each: joins race as separate processes would.
		cli := dial(t, e.Endpoints())
		wg.Go(func() {
			regs[i], errs[i] = membership.Register(ctx, cli, membership.RegisterConfig{
				Member: member("thinker", 0, fmt.Sprintf("127.0.0.1:%d", 9000+i)), AutoID: true, Logger: quietLogger(),
			})
		})
	}
	wg.Wait()
	var ids []int
	for i := range n {
		require.NoError(t, errs[i])
		ids = append(ids, int(regs[i].Member().ReplicaID))
		t.Cleanup(func() { _ = regs[i].Close(context.Background()) })
	}
	sort.Ints(ids)
	require.Equal(t, []int{0, 1, 2, 3, 4, 5, 6, 7}, ids)
}

func TestRegisterRejectsBadInput(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	ctx := testCtx(t)
	for name, cfg := range map[string]membership.RegisterConfig{
		"bad stage":   {Member: member("no/slash", 0, "a:1")},
		"empty addr":  {Member: member("thinker", 0, "")},
		"bad cluster": {Cluster: "a b", Member: member("thinker", 0, "a:1")},
		"short ttl":   {Member: member("thinker", 0, "a:1"), TTL: 500 * time.Millisecond},
	} {
		_, err := membership.Register(ctx, cli, cfg)
		require.Error(t, err, name)
		require.True(t, strings.HasPrefix(err.Error(), "membership: "), name)
	}
	_, err := membership.Register(ctx, nil, membership.RegisterConfig{Member: member("thinker", 0, "a:1")})
	require.Error(t, err)
}

func TestReregistersWhenLeaseIsRevokedFromOutside(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	wa := startWatcher(t, membership.NewWatcher(cli, membership.WatchConfig{Logger: quietLogger()}))
	// The keepalive notices the revoke at its next refresh, every TTL/3.
	r := register(t, cli, membership.RegisterConfig{Member: member("thinker", 1, "127.0.0.1:7001"), TTL: 2 * time.Second})
	require.True(t, is(membership.Join, r.Key())(wa.next(t)))
	old := r.Lease()

	ctx := testCtx(t)
	_, err := cli.Revoke(ctx, old)
	require.NoError(t, err)

	lost := regEvent(t, r, membership.LeaseLost)
	require.Equal(t, old, lost.Lease)
	again := regEvent(t, r, membership.Reregistered)
	require.NotEqual(t, old, again.Lease)
	require.Equal(t, again.Lease, r.Lease())

	require.True(t, is(membership.Leave, r.Key())(wa.next(t)))
	join := wa.next(t)
	require.True(t, is(membership.Join, r.Key())(join))
	require.Equal(t, uint32(1), join.Member.ReplicaID)
	got, err := cli.Get(ctx, r.Key())
	require.NoError(t, err)
	require.Equal(t, int64(again.Lease), got.Kvs[0].Lease)
}

func TestReregisterWaitsForAnotherHolder(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	ctx := testCtx(t)
	r := register(t, cli, membership.RegisterConfig{Member: member("thinker", 5, "127.0.0.1:7005"), TTL: 2 * time.Second})

	// Someone else takes the id while the lease is alive (an operator, or
	// a split brain), then the registration's lease goes.
	other, err := cli.Grant(ctx, 30)
	require.NoError(t, err)
	foreign := `{"stage":"thinker","replica_id":5,"addr":"127.0.0.1:1","engine":"sim","version":"x","started_at":"2024-01-01T00:00:00Z"}`
	_, err = cli.Put(ctx, r.Key(), foreign, clientv3.WithLease(other.ID))
	require.NoError(t, err)
	_, err = cli.Revoke(ctx, r.Lease())
	require.NoError(t, err)

	regEvent(t, r, membership.LeaseLost)
	blocked := regEvent(t, r, membership.ReregisterBlocked)
	require.Equal(t, "127.0.0.1:1", blocked.Holder)
	got, err := cli.Get(ctx, r.Key())
	require.NoError(t, err)
	require.Equal(t, foreign, string(got.Kvs[0].Value), "never overwrites another holder")

	_, err = cli.Revoke(ctx, other.ID)
	require.NoError(t, err)
	again := regEvent(t, r, membership.Reregistered)
	got, err = cli.Get(ctx, r.Key())
	require.NoError(t, err)
	require.Equal(t, int64(again.Lease), got.Kvs[0].Lease)
	require.Contains(t, string(got.Kvs[0].Value), `"addr":"127.0.0.1:7005"`)
}

// TestEtcdRestart: etcd goes away for longer than the short lease and comes
// back on the same data dir. The head keeps its membership while etcd is
// gone; the worker with the short lease re-registers under the same id;
// the worker with the long lease never leaves.
func TestEtcdRestart(t *testing.T) {
	e := membershiptest.Start(t)
	watchCli := dial(t, e.Endpoints())
	w := membership.NewWatcher(watchCli, membership.WatchConfig{ReconcileInterval: 200 * time.Millisecond, Logger: quietLogger()})
	lists := hookResyncs(w, 500*time.Millisecond)
	wa := startWatcher(t, w)

	long := register(t, dial(t, e.Endpoints()), membership.RegisterConfig{Member: member("thinker", 0, "127.0.0.1:7000"), TTL: 30 * time.Second})
	short := register(t, dial(t, e.Endpoints()), membership.RegisterConfig{Member: member("talker", 0, "127.0.0.1:7100"), TTL: time.Second})
	wa.until(t, is(membership.Join, long.Key()))
	wa.until(t, is(membership.Join, short.Key()))
	shortLease := short.Lease()

	e.Stop()
	lists.waitFor(t, "failed", failed)
	lost := regEvent(t, short, membership.LeaseLost)
	require.Equal(t, shortLease, lost.Lease)
	wa.none(t) // etcd unreachable: the membership stays as it was

	e.Restart(t)
	again := regEvent(t, short, membership.Reregistered)
	require.NotEqual(t, shortLease, again.Lease)
	events := wa.until(t, func(ev membership.Event) bool {
		return ev.Type == membership.Join && ev.Key == short.Key() && ev.Revision > 0
	})
	lists.waitFor(t, "successful", succeeded)
	for _, ev := range events {
		require.NotEqual(t, long.Key(), ev.Key, "the long-lease worker never left: %+v", ev)
	}
	wa.none(t)

	ctx := testCtx(t)
	got, err := watchCli.Get(ctx, membership.MembersPrefix(membership.DefaultCluster), clientv3.WithPrefix())
	require.NoError(t, err)
	require.Len(t, got.Kvs, 2)
	leases := map[string]int64{}
	for _, kv := range got.Kvs {
		leases[string(kv.Key)] = kv.Lease
	}
	require.Equal(t, int64(long.Lease()), leases[long.Key()])
	require.Equal(t, int64(short.Lease()), leases[short.Key()])
	require.Equal(t, uint32(0), short.Member().ReplicaID)
	// The lost lease is gone: it holds nothing and cannot come back.
	ttl, err := watchCli.TimeToLive(ctx, shortLease)
	require.NoError(t, err)
	require.Equal(t, int64(-1), ttl.TTL)
}

func TestCloseIsBoundedWhenEtcdIsDown(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	r, err := membership.Register(testCtx(t), cli, membership.RegisterConfig{Member: member("thinker", 0, "127.0.0.1:7000"), Logger: quietLogger()})
	require.NoError(t, err)
	e.Stop()
	done := make(chan error, 1)
	go func() { done <- r.Close(context.Background()) }()
	select {
	case err := <-done:
		require.ErrorContains(t, err, "membership: revoke lease of /troupe/default/members/thinker/0")
	case <-time.After(wait):
		t.Fatal("Close did not return while etcd was down")
	}
}

func TestDialDeadEndpointFailsFast(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	dead := "http://" + ln.Addr().String()
	require.NoError(t, ln.Close())

	done := make(chan error, 1)
	go func() {
		cli, err := membership.Dial(context.Background(), membership.ClientConfig{Endpoints: []string{dead}, DialTimeout: time.Second})
		if cli != nil {
			_ = cli.Close()
		}
		done <- err
	}()
	select {
	case err := <-done:
		require.Error(t, err)
		require.True(t, strings.HasPrefix(err.Error(), fmt.Sprintf("membership: etcd at [%s] unreachable after 1s: ", dead)), err.Error())
	case <-time.After(wait):
		t.Fatal("Dial did not give up on a dead endpoint")
	}
}

func TestDialChecksConfig(t *testing.T) {
	ctx := testCtx(t)
	_, err := membership.Dial(ctx, membership.ClientConfig{})
	require.EqualError(t, err, "membership: no etcd endpoints")
	_, err = membership.Dial(ctx, membership.ClientConfig{Endpoints: []string{"http://127.0.0.1:1"}, Cert: "c.pem"})
	require.EqualError(t, err, "membership: etcd cert and key must be given together")
	_, err = membership.Dial(ctx, membership.ClientConfig{Endpoints: []string{"http://127.0.0.1:1"}, Username: "root"})
	require.EqualError(t, err, "membership: etcd user and password must be given together")
}

func TestListShowsLeaseTTL(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	ctx := testCtx(t)
	register(t, cli, membership.RegisterConfig{Member: member("talker", 1, "127.0.0.1:7101"), TTL: 20 * time.Second})
	register(t, cli, membership.RegisterConfig{Member: member("talker", 0, "127.0.0.1:7100"), TTL: 20 * time.Second})
	register(t, cli, membership.RegisterConfig{Member: member("thinker", 0, "127.0.0.1:7000"), TTL: 20 * time.Second})
	_, err := cli.Put(ctx, "/troupe/default/members/thinker/9", "{")
	require.NoError(t, err)
	// Another cluster is not listed.
	register(t, cli, membership.RegisterConfig{Cluster: "other", Member: member("thinker", 0, "127.0.0.1:7999")})

	list, err := membership.List(ctx, cli, "")
	require.NoError(t, err)
	require.Len(t, list, 4)
	var order []string
	for _, l := range list[:3] {
		require.NoError(t, l.Invalid)
		order = append(order, fmt.Sprintf("%s/%d", l.Record.Stage, l.Record.ReplicaID))
		require.Greater(t, l.TTLLeft, time.Duration(0))
		require.LessOrEqual(t, l.TTLLeft, 20*time.Second)
		require.Equal(t, 20*time.Second, l.TTL, "the granted TTL, not the time left")
	}
	require.Equal(t, []string{"talker/0", "talker/1", "thinker/0"}, order)
	require.Error(t, list[3].Invalid)
	require.Equal(t, "/troupe/default/members/thinker/9", list[3].Key)
	require.Equal(t, time.Duration(-1), list[3].TTLLeft, "no lease")
	require.Equal(t, time.Duration(-1), list[3].TTL, "no lease")
}

// drained is closed once ch is closed; it reads and drops what ch holds.
func drained[T any](ch <-chan T) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range ch {
		}
	}()
	return done
}

// TestRecordDeletedOrOverwrittenIsRestored: an operator deleting a live
// worker's key, or writing over it, does not take the replica out for
// good: the registration writes its record back under its lease, and says
// so.
func TestRecordDeletedOrOverwrittenIsRestored(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	ctx := testCtx(t)
	r := register(t, cli, membership.RegisterConfig{Member: member("thinker", 0, "127.0.0.1:7000")})
	restoredWithin := func(what string) {
		t.Helper()
		require.Eventually(t, func() bool {
			resp, err := cli.Get(ctx, r.Key())
			if err != nil || len(resp.Kvs) != 1 {
				return false
			}
			kv := resp.Kvs[0]
			m, err := membership.DecodeMember(membership.DefaultCluster, r.Key(), kv.Value)
			return err == nil && m.Addr == "127.0.0.1:7000" && clientv3.LeaseID(kv.Lease) == r.Lease()
		}, 10*time.Second, 10*time.Millisecond, "record restored after it was %s", what)
		select {
		case ev := <-r.Events():
			assert.Equal(t, membership.Restored, ev.Type)
		case <-ctx.Done():
			t.Fatal("no Restored event")
		}
	}

	_, err := cli.Delete(ctx, r.Key())
	require.NoError(t, err)
	restoredWithin("deleted")

	_, err = cli.Put(ctx, r.Key(), `{"stage":"thinker","replica_id":0,"addr":"127.0.0.1:1"}`)
	require.NoError(t, err)
	restoredWithin("overwritten")
}

// TestRecordGuardCostsNoReadAtRest: a live registration reads its record
// once, when its keepalive starts, and then only watches it: across
// several keepalive periods at rest it sends etcd no Range, so that at rest
// a registration costs etcd its keepalives alone.
func TestRecordGuardCostsNoReadAtRest(t *testing.T) {
	e := membershiptest.Start(t)
	var ranges atomic.Int64
	count := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if method == "/etcdserverpb.KV/Range" {
			ranges.Add(1)
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: e.Endpoints(), DialTimeout: 5 * time.Second, Logger: zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(count)}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = cli.Close() })
	r := register(t, cli, membership.RegisterConfig{Member: member("thinker", 0, "127.0.0.1:7000"), TTL: time.Second})
	require.Eventually(t, func() bool { return ranges.Load() >= 1 }, 10*time.Second, 5*time.Millisecond, "the guard reads the record once")
	before := ranges.Load()
	// Four keepalive answers: about four thirds of the TTL at rest.
	last := r.LastKeepAlive()
	for range 4 {
		require.Eventually(t, func() bool { return r.LastKeepAlive().After(last) }, 10*time.Second, 5*time.Millisecond)
		last = r.LastKeepAlive()
	}
	assert.Equal(t, before, ranges.Load(), "no Range at rest")

	// The guard still works: a deletion is written back.
	_, err = cli.Delete(testCtx(t), r.Key())
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		resp, err := cli.Get(testCtx(t), r.Key())
		return err == nil && len(resp.Kvs) == 1 && clientv3.LeaseID(resp.Kvs[0].Lease) == r.Lease()
	}, 10*time.Second, 10*time.Millisecond, "record restored after it was deleted")
}
