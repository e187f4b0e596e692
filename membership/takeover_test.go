package membership_test

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/membership/membershiptest"
)

// listen binds a loopback listener, closed at cleanup: the address a
// restarted worker holds.
func listen(t *testing.T) net.Listener {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = lis.Close() })
	return lis
}

// plant writes value at key under a fresh lease that nobody keeps alive:
// the record of a process that died within its TTL.
func plant(t *testing.T, cli *clientv3.Client, key, value string) clientv3.LeaseID {
	t.Helper()
	ctx := testCtx(t)
	grant, err := cli.Grant(ctx, 60)
	require.NoError(t, err)
	_, err = cli.Put(ctx, key, value, clientv3.WithLease(grant.ID))
	require.NoError(t, err)
	return grant.ID
}

func encode(t *testing.T, m membership.Member) string {
	t.Helper()
	b, err := json.Marshal(m)
	require.NoError(t, err)
	return string(b)
}

// TestRestartWithinLeaseTakesTheRecordBack (issue 47, item 5): a worker
// killed (its client closed, the lease never revoked) and restarted at the
// same addr within its TTL takes its record back under a new lease. The
// old lease is left to expire; watchers see one Join of the new process's
// record (another started_at) and no Leave.
func TestRestartWithinLeaseTakesTheRecordBack(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	wa := startWatcher(t, membership.NewWatcher(cli, membership.WatchConfig{Logger: quietLogger()}))
	lis := listen(t)
	addr := lis.Addr().String()

	deadCli := dial(t, e.Endpoints())
	before := member("thinker", 0, addr)
	before.StartedAt = before.StartedAt.Add(-time.Minute)
	old := register(t, deadCli, membership.RegisterConfig{Member: before, TTL: 60 * time.Second})
	require.True(t, is(membership.Join, old.Key())(wa.next(t)))
	require.NoError(t, deadCli.Close())
	select {
	case <-drained(old.Events()):
	case <-time.After(wait):
		t.Fatal("the first registration did not stop after its client closed")
	}

	logs := &logRecorder{}
	restarted := member("thinker", 0, addr)
	r := register(t, cli, membership.RegisterConfig{Member: restarted, TTL: 60 * time.Second, Listener: lis, Logger: slog.New(logs)})
	require.NotEqual(t, old.Lease(), r.Lease())

	ctx := testCtx(t)
	got, err := cli.Get(ctx, r.Key())
	require.NoError(t, err)
	require.Len(t, got.Kvs, 1)
	assert.Equal(t, int64(r.Lease()), got.Kvs[0].Lease, "under the new lease")
	assert.JSONEq(t, encode(t, restarted), string(got.Kvs[0].Value))
	ttl, err := cli.TimeToLive(ctx, old.Lease(), clientv3.WithAttachedKeys())
	require.NoError(t, err)
	assert.Positive(t, ttl.TTL, "the old lease is not revoked: it was not ours")
	assert.Empty(t, ttl.Keys, "and holds nothing")
	assert.Equal(t, 1, logs.count("membership: took over the record of this replica's previous process"))
	assert.Equal(t, 1, logs.count("previous_started_at="+before.StartedAt.String()))

	join := wa.next(t)
	require.Equal(t, membership.Join, join.Type)
	require.Equal(t, r.Key(), join.Key)
	assert.Equal(t, restarted, join.Member, "another started_at: the head probes a new process")
	wa.none(t)

	// The old lease's end (a revoke here, as its expiry would) leaves the
	// record alone.
	_, err = cli.Revoke(ctx, old.Lease())
	require.NoError(t, err)
	got, err = cli.Get(ctx, r.Key())
	require.NoError(t, err)
	require.Len(t, got.Kvs, 1)
	assert.Equal(t, int64(r.Lease()), got.Kvs[0].Lease)
	wa.none(t)
}

// TestTakeOverNeedsTheSameAddrAndItsListener: a record of the same
// replica is refused as from any live holder, and left untouched, unless
// it is at this process's own addr and this process holds the listener
// that addr reaches.
func TestTakeOverNeedsTheSameAddrAndItsListener(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	lis := listen(t)
	addr := lis.Addr().String()
	port := strconv.Itoa(lis.Addr().(*net.TCPAddr).Port)
	elsewhere := net.JoinHostPort("192.0.2.1", port) // TEST-NET-1: not this host's

	for i, tc := range []struct {
		name     string
		held     string // the record at the key
		addr     string // the new registration's addr
		listener net.Listener
		holder   string // as the refusal names it
	}{
		{"another addr", encode(t, member("thinker", 0, "10.0.0.1:7000")), addr, lis, "10.0.0.1:7000"},
		{"same addr, no listener", encode(t, member("thinker", 1, addr)), addr, nil, addr},
		{"same addr, not the listener's", encode(t, member("thinker", 2, elsewhere)), elsewhere, lis, elsewhere},
		{"an unreadable record", `{"addr":"` + addr + `"`, addr, lis, "an unreadable record"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := testCtx(t)
			id := uint32(i)
			key := membership.MemberKey(membership.DefaultCluster, "thinker", id)
			lease := plant(t, cli, key, tc.held)
			leasesBefore, err := cli.Leases(ctx)
			require.NoError(t, err)

			_, err = membership.Register(ctx, cli, membership.RegisterConfig{
				Member: member("thinker", id, tc.addr), Listener: tc.listener, Logger: quietLogger(),
			})
			require.ErrorIs(t, err, membership.ErrAlreadyRegistered)
			assert.EqualError(t, err, "membership: replica thinker/"+strconv.Itoa(i)+" already registered by "+tc.holder)

			got, err := cli.Get(ctx, key)
			require.NoError(t, err)
			require.Len(t, got.Kvs, 1)
			assert.Equal(t, tc.held, string(got.Kvs[0].Value), "untouched")
			assert.Equal(t, int64(lease), got.Kvs[0].Lease)
			leasesAfter, err := cli.Leases(ctx)
			require.NoError(t, err)
			assert.Len(t, leasesAfter.Leases, len(leasesBefore.Leases), "the refused registration's lease is revoked")
		})
	}
}

// TestTakeOverRaceHasOneWinner: two takers that read the same dead
// record race for it; the compare-and-swap lets one win, the other is
// refused with the winner's addr and keeps no lease.
func TestTakeOverRaceHasOneWinner(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	ctx := testCtx(t)
	lis := listen(t)
	addr := lis.Addr().String()
	key := membership.MemberKey(membership.DefaultCluster, "thinker", 0)
	old := plant(t, cli, key, encode(t, member("thinker", 0, addr)))

	arrived := make(chan struct{}, 2)
	release := make(chan struct{})
	lineUp := func() {
		arrived <- struct{}{}
		select {
		case <-release:
		case <-time.After(wait):
		}
	}
	type result struct {
		r   *membership.Registration
		err error
	}
	results := make(chan result, 2)
	for i := range 2 {
		go func() {
			m := member("thinker", 0, addr)
			m.Labels = map[string]string{"taker": strconv.Itoa(i)}
			r, err := membership.RegisterWithTakeOverHook(ctx, cli, membership.RegisterConfig{
				Member: m, TTL: 60 * time.Second, Listener: lis, Logger: quietLogger(),
			}, lineUp)
			results <- result{r, err}
		}()
	}
	for range 2 {
		select {
		case <-arrived:
		case <-time.After(wait):
			t.Fatal("the takers did not both read the dead record")
		}
	}
	close(release)

	var won []*membership.Registration
	var lost []error
	for range 2 {
		select {
		case res := <-results:
			if res.err != nil {
				lost = append(lost, res.err)
				continue
			}
			won = append(won, res.r)
			t.Cleanup(func() {
				cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				_ = res.r.Close(cctx)
			})
		case <-time.After(wait):
			t.Fatal("a taker did not return")
		}
	}
	require.Len(t, won, 1, "one winner")
	require.Len(t, lost, 1)
	var are *membership.AlreadyRegisteredError
	require.True(t, errors.As(lost[0], &are), "%v", lost[0])
	assert.Equal(t, addr, are.Addr)

	got, err := cli.Get(ctx, key)
	require.NoError(t, err)
	require.Len(t, got.Kvs, 1)
	assert.Equal(t, int64(won[0].Lease()), got.Kvs[0].Lease)
	assert.JSONEq(t, encode(t, won[0].Member()), string(got.Kvs[0].Value))
	leases, err := cli.Leases(ctx)
	require.NoError(t, err)
	ids := make([]clientv3.LeaseID, 0, len(leases.Leases))
	for _, l := range leases.Leases {
		ids = append(ids, l.ID)
	}
	assert.ElementsMatch(t, []clientv3.LeaseID{old, won[0].Lease()}, ids, "the loser's lease is revoked, the old one left to expire")
}

func TestListensOn(t *testing.T) {
	ctx := testCtx(t)
	loopback := &net.TCPAddr{IP: net.ParseIP("127.0.0.1"), Port: 7000}
	every := &net.TCPAddr{IP: net.IPv6unspecified, Port: 7000}
	for _, tc := range []struct {
		bound net.Addr
		addr  string
		ok    bool
	}{
		{loopback, "127.0.0.1:7000", true},
		{loopback, "127.0.0.1:7001", false},
		{loopback, "127.0.0.2:7000", false},
		{every, "127.0.0.1:7000", true},
		{every, "192.0.2.1:7000", false},
		{every, "127.0.0.1:7001", false},
		{&net.UDPAddr{IP: net.ParseIP("127.0.0.1"), Port: 7000}, "127.0.0.1:7000", false},
	} {
		err := membership.ListensOn(ctx, tc.bound, tc.addr)
		if tc.ok {
			assert.NoError(t, err, "%s on %s", tc.addr, tc.bound)
		} else {
			assert.Error(t, err, "%s on %s", tc.addr, tc.bound)
		}
	}
}
