package membership_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/membership/membershiptest"
)

// stored reads the record at key from etcd; the zero Member when absent.
func stored(t *testing.T, cli *clientv3.Client, key string) (membership.Member, int64) {
	t.Helper()
	got, err := cli.Get(testCtx(t), key)
	require.NoError(t, err)
	if len(got.Kvs) == 0 {
		return membership.Member{}, 0
	}
	var m membership.Member
	require.NoError(t, json.Unmarshal(got.Kvs[0].Value, &m))
	return m, got.Kvs[0].Lease
}

// TestUpdateRewritesTheRecordUnderItsLease: an update is one Join with the
// new record for watchers, under the same lease; no Leave.
func TestUpdateRewritesTheRecordUnderItsLease(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	wa := startWatcher(t, membership.NewWatcher(cli, membership.WatchConfig{Logger: quietLogger()}))
	r := register(t, cli, membership.RegisterConfig{Member: member("thinker", 0, "127.0.0.1:7000"), TTL: 5 * time.Second})
	join := wa.next(t)
	require.True(t, is(membership.Join, r.Key())(join))
	lease := r.Lease()

	ctx := testCtx(t)
	require.NoError(t, r.Update(ctx, func(m *membership.Member) { m.SleepState = "weights_offloaded" }))
	// Update returned: etcd holds the record already.
	got, gotLease := stored(t, cli, r.Key())
	require.Equal(t, "weights_offloaded", got.SleepState)
	require.Equal(t, int64(lease), gotLease)
	require.Equal(t, "weights_offloaded", r.Member().SleepState)

	again := wa.next(t)
	require.True(t, is(membership.Join, r.Key())(again), "an update is a Join of the changed record: %+v", again)
	require.Greater(t, again.Revision, join.Revision)
	require.Equal(t, "weights_offloaded", again.Member.SleepState)
	require.Equal(t, lease, r.Lease())

	// Writing the same record again changes nothing in etcd.
	require.NoError(t, r.Update(ctx, func(m *membership.Member) { m.SleepState = "weights_offloaded" }))
	require.NoError(t, r.Update(ctx, func(m *membership.Member) { m.SleepState = "awake" }))
	next := wa.next(t)
	require.Equal(t, "awake", next.Member.SleepState, "no event for the unchanged record")
	wa.none(t)
}

func TestUpdateRejectsBadChanges(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	r := register(t, cli, membership.RegisterConfig{Member: member("thinker", 0, "127.0.0.1:7000")})
	before, _ := stored(t, cli, r.Key())
	ctx := testCtx(t)

	err := r.Update(ctx, func(m *membership.Member) { m.ReplicaID = 9 })
	require.EqualError(t, err, "membership: update /troupe/default/members/thinker/0: stage and replica id cannot change (got thinker/9)")
	err = r.Update(ctx, func(m *membership.Member) { m.Stage = "talker" })
	require.ErrorContains(t, err, "stage and replica id cannot change")
	err = r.Update(ctx, func(m *membership.Member) { m.SleepState = "dozing" })
	require.ErrorContains(t, err, `unknown sleep state "dozing"`)
	err = r.Update(ctx, func(m *membership.Member) { m.Addr = "" })
	require.ErrorContains(t, err, "empty addr")

	after, _ := stored(t, cli, r.Key())
	require.Equal(t, before, after, "a refused update writes nothing")
	require.Equal(t, before, r.Member(), "and keeps nothing")
}

// TestUpdateWhileEtcdIsDown: the update waits for etcd and gives up with
// ctx, but is written once etcd is back, also when the lease expired
// meanwhile and the record had to be registered again.
func TestUpdateWhileEtcdIsDown(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	r := register(t, cli, membership.RegisterConfig{Member: member("talker", 0, "127.0.0.1:7100"), TTL: time.Second})
	old := r.Lease()

	e.Stop()
	ctx, cancel := context.WithTimeout(testCtx(t), 300*time.Millisecond)
	defer cancel()
	err := r.Update(ctx, func(m *membership.Member) { m.SleepState = "discard_all" })
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorContains(t, err, "not written yet")
	require.Equal(t, "discard_all", r.Member().SleepState, "the change is kept")
	regEvent(t, r, membership.LeaseLost)

	e.Restart(t)
	regEvent(t, r, membership.Reregistered)
	got, lease := stored(t, cli, r.Key())
	require.Equal(t, "discard_all", got.SleepState, "the re-registration writes the latest record")
	require.NotEqual(t, int64(old), lease)
	require.Equal(t, int64(r.Lease()), lease)
	// And the next update goes through at once.
	require.NoError(t, r.Update(testCtx(t), func(m *membership.Member) { m.SleepState = "awake" }))
	got, _ = stored(t, cli, r.Key())
	require.Equal(t, "awake", got.SleepState)
}

// TestUpdateRestoresADeletedRecord: a record deleted from outside while its
// lease lives is written back, with the update, under the same lease.
func TestUpdateRestoresADeletedRecord(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	r := register(t, cli, membership.RegisterConfig{Member: member("thinker", 4, "127.0.0.1:7004"), TTL: 30 * time.Second})
	lease := r.Lease()
	ctx := testCtx(t)
	_, err := cli.Delete(ctx, r.Key())
	require.NoError(t, err)

	require.NoError(t, r.Update(ctx, func(m *membership.Member) { m.SleepState = "weights_offloaded" }))
	restored := regEvent(t, r, membership.Restored)
	require.Equal(t, lease, restored.Lease)
	got, gotLease := stored(t, cli, r.Key())
	require.Equal(t, "weights_offloaded", got.SleepState)
	require.Equal(t, int64(lease), gotLease, "the same lease")
}

// TestConcurrentUpdatesLandInOrder: many goroutines update; etcd ends with
// the record of the last change applied, which Member reports.
func TestConcurrentUpdatesLandInOrder(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	r := register(t, cli, membership.RegisterConfig{Member: member("thinker", 0, "127.0.0.1:7000")})
	states := []string{"awake", "weights_offloaded", "discard_all"}
	done := make(chan error, 30)
	for i := range 30 {
		go func() {
			done <- r.Update(testCtx(t), func(m *membership.Member) { m.SleepState = states[i%3] })
		}()
	}
	for range 30 {
		require.NoError(t, <-done)
	}
	got, _ := stored(t, cli, r.Key())
	require.Equal(t, r.Member(), got)
}

func TestUpdateAfterCloseFails(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	r := register(t, cli, membership.RegisterConfig{Member: member("thinker", 0, "127.0.0.1:7000")})
	require.NoError(t, r.Close(testCtx(t)))
	err := r.Update(testCtx(t), func(m *membership.Member) { m.SleepState = "discard_all" })
	require.ErrorContains(t, err, "the registration has stopped")
	got, _ := stored(t, cli, r.Key())
	require.Equal(t, membership.Member{}, got, "nothing is written after Close")
}
