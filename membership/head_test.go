package membership_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/membership/membershiptest"
)

func headRecord(id, addr string) membership.Head {
	return membership.Head{ID: id, Addr: addr, Version: "test", StartedAt: time.Now().UTC().Truncate(time.Second)}
}

func registerHead(t *testing.T, cli *clientv3.Client, cfg membership.HeadConfig) *membership.HeadRegistration {
	t.Helper()
	cfg.Logger = quietLogger()
	r, err := membership.RegisterHead(testCtx(t), cli, cfg)
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = r.Close(ctx)
	})
	return r
}

// TestHeadRegistration: a head's record lives under its lease at
// /troupe/<cluster>/heads/<id>, is listed with its TTL, refuses a second
// holder of the id without overwriting it, and goes at Close.
func TestHeadRegistration(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	ctx := testCtx(t)
	b := registerHead(t, cli, membership.HeadConfig{Head: headRecord("head-b", "10.0.0.2:8000"), TTL: 7 * time.Second})
	a := registerHead(t, cli, membership.HeadConfig{Head: headRecord("head-a", "10.0.0.1:8000"), TTL: 7 * time.Second})
	require.Equal(t, "/troupe/default/heads/head-a", a.Key())
	require.Equal(t, "head-a", a.Head().ID)
	registerHead(t, cli, membership.HeadConfig{Cluster: "other", Head: headRecord("head-a", "10.0.0.9:8000")})
	_, err := cli.Put(ctx, "/troupe/default/heads/junk", "{")
	require.NoError(t, err)

	got, err := cli.Get(ctx, a.Key())
	require.NoError(t, err)
	require.Equal(t, int64(a.Lease()), got.Kvs[0].Lease)
	require.JSONEq(t, `{"id":"head-a","addr":"10.0.0.1:8000","version":"test","started_at":"`+a.Head().StartedAt.Format(time.RFC3339)+`"}`, string(got.Kvs[0].Value))

	_, err = membership.RegisterHead(ctx, cli, membership.HeadConfig{Head: headRecord("head-a", "10.0.0.3:8000"), Logger: quietLogger()})
	require.ErrorIs(t, err, membership.ErrAlreadyRegistered)
	require.EqualError(t, err, "membership: head head-a already registered by 10.0.0.1:8000")

	list, err := membership.ListHeads(ctx, cli, "")
	require.NoError(t, err)
	require.Len(t, list, 3)
	require.Equal(t, "head-a", list[0].Record.ID)
	require.Equal(t, "10.0.0.1:8000", list[0].Record.Addr)
	require.Equal(t, "head-b", list[1].Record.ID)
	for _, l := range list[:2] {
		require.NoError(t, l.Invalid)
		require.Greater(t, l.TTLLeft, time.Duration(0))
		require.LessOrEqual(t, l.TTLLeft, 7*time.Second)
		require.Equal(t, 7*time.Second, l.TTL, "the granted TTL")
	}
	require.Error(t, list[2].Invalid)
	require.Equal(t, time.Duration(-1), list[2].TTLLeft)

	// Heads are not members: a member watcher and List see none of them.
	members, err := membership.List(ctx, cli, "")
	require.NoError(t, err)
	require.Empty(t, members)

	require.NoError(t, b.Close(ctx))
	list, err = membership.ListHeads(ctx, cli, "")
	require.NoError(t, err)
	require.Len(t, list, 2, "the closed head is gone at once")
	require.Equal(t, "head-a", list[0].Record.ID)
}

// TestHeadReregistersAfterLeaseLoss: the head's record comes back under a
// new lease when its lease is revoked, as a replica's does.
func TestHeadReregistersAfterLeaseLoss(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	ctx := testCtx(t)
	r := registerHead(t, cli, membership.HeadConfig{Head: headRecord("h1", "127.0.0.1:8000"), TTL: 2 * time.Second})
	old := r.Lease()
	_, err := cli.Revoke(ctx, old)
	require.NoError(t, err)
	again := regEvent(t, r, membership.Reregistered)
	require.NotEqual(t, old, again.Lease)
	got, err := cli.Get(ctx, r.Key())
	require.NoError(t, err)
	require.Len(t, got.Kvs, 1)
	require.Equal(t, int64(again.Lease), got.Kvs[0].Lease)
}

func TestRegisterHeadRejectsBadInput(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	ctx := testCtx(t)
	for _, tc := range []struct {
		cfg  membership.HeadConfig
		want string
	}{
		{membership.HeadConfig{Head: headRecord("", "h:1")}, `invalid head id ""`},
		{membership.HeadConfig{Head: headRecord("a/b", "h:1")}, `invalid head id "a/b"`},
		{membership.HeadConfig{Head: headRecord("h", "")}, "empty addr"},
		{membership.HeadConfig{Head: headRecord("h", "h:1"), Cluster: "a b"}, "invalid cluster name"},
		{membership.HeadConfig{Head: headRecord("h", "h:1"), TTL: time.Millisecond}, "below 1s"},
	} {
		_, err := membership.RegisterHead(ctx, cli, tc.cfg)
		require.ErrorContains(t, err, tc.want)
	}
	_, err := membership.RegisterHead(ctx, nil, membership.HeadConfig{Head: headRecord("h", "h:1")})
	require.ErrorContains(t, err, "nil etcd client")
	list, err := membership.ListHeads(ctx, cli, "")
	require.NoError(t, err)
	require.Empty(t, list)
}
