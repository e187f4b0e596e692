package membership_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/membership/membershiptest"
)

// TestWatchRecoversFromCompaction cuts the head off from etcd; meanwhile a
// replica leaves, another joins, and the history is compacted. When the
// head reconnects its watch cannot resume, so it re-lists and reports the
// missed leave and join.
func TestWatchRecoversFromCompaction(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	px := startProxy(t, e.Endpoints()[0])
	headCli := dial(t, []string{px.url()})
	logs := &logRecorder{}
	// No periodic reconcile: only the compaction can bring the change.
	w := membership.NewWatcher(headCli, membership.WatchConfig{ReconcileInterval: time.Hour, Logger: slog.New(logs)})
	wa := startWatcher(t, w)

	gone := register(t, cli, membership.RegisterConfig{Member: member("thinker", 0, "127.0.0.1:7000")})
	stays := register(t, cli, membership.RegisterConfig{Member: member("thinker", 1, "127.0.0.1:7001")})
	wa.until(t, is(membership.Join, gone.Key()))
	wa.until(t, is(membership.Join, stays.Key()))

	px.pause()
	ctx := testCtx(t)
	require.NoError(t, gone.Close(ctx))
	newcomer := register(t, cli, membership.RegisterConfig{Member: member("thinker", 2, "127.0.0.1:7002")})
	rev, err := cli.Get(ctx, "/")
	require.NoError(t, err)
	_, err = cli.Compact(ctx, rev.Header.Revision, clientv3.WithCompactPhysical())
	require.NoError(t, err)
	wa.none(t)
	px.resume()

	var got []membership.Event
	got = append(got, wa.next(t), wa.next(t))
	require.Equal(t, membership.Leave, got[0].Type)
	require.Equal(t, gone.Key(), got[0].Key)
	require.Equal(t, "127.0.0.1:7000", got[0].Member.Addr)
	require.Equal(t, membership.Join, got[1].Type)
	require.Equal(t, newcomer.Key(), got[1].Key)
	require.Equal(t, 1, logs.count("watch compacted"), "recovered through the compaction path")

	// The watch resumed after the re-list: later changes arrive as usual.
	require.NoError(t, stays.Close(ctx))
	require.True(t, is(membership.Leave, stays.Key())(wa.next(t)))
}

// TestWatchRelistDiffsAfterRestartOfRun: a watcher that was stopped and
// runs again reports only what changed while it was away.
func TestWatchRelistDiffsAfterRestartOfRun(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	w := membership.NewWatcher(cli, membership.WatchConfig{Logger: quietLogger()})
	a := register(t, cli, membership.RegisterConfig{Member: member("thinker", 0, "127.0.0.1:7000")})
	b := register(t, cli, membership.RegisterConfig{Member: member("thinker", 1, "127.0.0.1:7001")})

	ctx, cancel := context.WithCancel(testCtx(t))
	out := make(chan membership.Event, 16)
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx, out) }()
	for range 2 {
		select {
		case ev := <-out:
			require.Equal(t, membership.Join, ev.Type)
		case <-time.After(wait):
			t.Fatal("no join")
		}
	}
	cancel()
	require.ErrorIs(t, <-done, context.Canceled)

	require.NoError(t, a.Close(testCtx(t)))
	_, err := cli.Compact(testCtx(t), mustRev(t, cli))
	require.NoError(t, err)

	wa := startWatcher(t, w)
	ev := wa.next(t)
	require.Equal(t, membership.Leave, ev.Type)
	require.Equal(t, a.Key(), ev.Key)
	require.NoError(t, b.Close(testCtx(t)))
	require.True(t, is(membership.Leave, b.Key())(wa.next(t)), "no join again for the unchanged record")
}

func mustRev(t *testing.T, cli *clientv3.Client) int64 {
	t.Helper()
	resp, err := cli.Get(testCtx(t), "/")
	require.NoError(t, err)
	return resp.Header.Revision
}

// TestWatchNoGapNoDoubleApply registers replicas while the watcher starts
// up: each appears exactly once, whether it came by the list or the watch,
// and periodic re-lists of unchanged records send nothing.
func TestWatchNoGapNoDoubleApply(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	w := membership.NewWatcher(cli, membership.WatchConfig{ReconcileInterval: 100 * time.Millisecond, Logger: quietLogger()})
	lists := hookResyncs(w, 5*time.Second)

	const n = 20
	var (
		wg sync.WaitGroup
		wa *watching
	)
	keys := make(chan string, n)
	for i := range n {
		wg.Go(func() {
			r, err := membership.Register(testCtx(t), cli, membership.RegisterConfig{
				Member: member("thinker", uint32(i), fmt.Sprintf("127.0.0.1:%d", 7000+i)), Logger: quietLogger(),
			})
			if err != nil {
				t.Error(err)
				return
			}
			t.Cleanup(func() { _ = r.Close(context.Background()) })
			keys <- r.Key()
		})
		if i == n/2 {
			wa = startWatcher(t, w) // while registrations are in flight
		}
	}
	wg.Wait()
	close(keys)
	joined := map[string]int{}
	for len(joined) < n {
		ev := wa.next(t)
		require.Equal(t, membership.Join, ev.Type)
		joined[ev.Key]++
		require.Equal(t, 1, joined[ev.Key], "joined twice: %s", ev.Key)
	}
	for k := range keys {
		require.Contains(t, joined, k)
	}
	// Several full re-lists later, still nothing new.
	for range 3 {
		lists.waitFor(t, "successful", succeeded)
	}
	wa.none(t)

	// A changed record (a new process, a new addr) joins again.
	ctx := testCtx(t)
	key := membership.MemberKey(membership.DefaultCluster, "thinker", 3)
	m := member("thinker", 3, "127.0.0.1:9999")
	lease, err := cli.Grant(ctx, 30)
	require.NoError(t, err)
	_, err = cli.Put(ctx, key, mustJSON(t, m), clientv3.WithLease(lease.ID))
	require.NoError(t, err)
	ev := wa.next(t)
	require.Equal(t, membership.Join, ev.Type)
	require.Equal(t, "127.0.0.1:9999", ev.Member.Addr)
}

func TestWatchSkipsMalformedRecords(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	ctx := testCtx(t)
	prefix := membership.MembersPrefix(membership.DefaultCluster)

	// Present before the watcher starts: found by the first list.
	_, err := cli.Put(ctx, prefix+"thinker/7", "not json")
	require.NoError(t, err)

	var mu sync.Mutex
	invalid := map[string]int{}
	w := membership.NewWatcher(cli, membership.WatchConfig{
		Stages:            []string{"thinker", "talker"},
		ReconcileInterval: 100 * time.Millisecond,
		OnInvalid: func(key string, err error) {
			mu.Lock()
			defer mu.Unlock()
			invalid[key]++
		},
		Logger: quietLogger(),
	})
	lists := hookResyncs(w, 5*time.Second)
	wa := startWatcher(t, w)
	lists.waitFor(t, "successful", succeeded)

	// Arriving through the watch.
	bad := map[string]string{
		prefix + "thinker/8":      mustJSON(t, member("thinker", 9, "a:1")),             // id mismatch
		prefix + "painter/0":      mustJSON(t, member("painter", 0, "a:1")),             // unknown stage
		prefix + "thinker/x":      mustJSON(t, member("thinker", 0, "a:1")),             // bad id in key
		prefix + "talker/0":       mustJSON(t, member("talker", 0, "")),                 // no addr
		prefix + "talker/1/extra": mustJSON(t, member("talker", 1, "a:1")),              // too deep
		prefix + "thinker/10":     `{"stage":"thinker","replica_id":"ten"}`,             // wrong type
		prefix + "thinker/11":     mustJSON(t, member("thinker", 11, "127.0.0.1:7111")), // valid, but no lease
		prefix + "thinker/12":     mustJSON(t, member("thinker", 12, "unix:/tmp/sock")), // not host:port
		prefix + "thinker/13":     mustJSON(t, member("thinker", 13, "[bad")),
	}
	for k, v := range bad {
		_, err := cli.Put(ctx, k, v)
		require.NoError(t, err)
	}
	// The watch goes on: a valid record after the bad ones joins.
	good := register(t, cli, membership.RegisterConfig{Member: member("talker", 2, "127.0.0.1:7102")})
	ev := wa.next(t)
	require.True(t, is(membership.Join, good.Key())(ev), "%+v", ev)

	// A valid record turned malformed is a leave of the old record.
	_, err = cli.Put(ctx, good.Key(), "{broken", clientv3.WithIgnoreLease())
	require.NoError(t, err)
	ev = wa.next(t)
	require.Equal(t, membership.Leave, ev.Type)
	require.Equal(t, good.Key(), ev.Key)
	require.Equal(t, "127.0.0.1:7102", ev.Member.Addr)
	// ... and the live registration writes its record back: a join again.
	ev = wa.next(t)
	require.True(t, is(membership.Join, good.Key())(ev), "%+v", ev)
	require.Equal(t, "127.0.0.1:7102", ev.Member.Addr)

	// Re-lists find the same bad records again but count them once.
	for range 3 {
		lists.waitFor(t, "successful", succeeded)
	}
	wa.none(t)
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, invalid, len(bad)+2)
	for k, n := range invalid {
		require.Equal(t, 1, n, "counted once: %s", k)
	}
}

func TestWatcherRunRules(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	ctx := testCtx(t)
	out := make(chan membership.Event)

	err := membership.NewWatcher(cli, membership.WatchConfig{Cluster: "bad/name"}).Run(ctx, out)
	require.EqualError(t, err, `membership: invalid cluster name "bad/name"`)
	err = membership.NewWatcher(nil, membership.WatchConfig{}).Run(ctx, out)
	require.Error(t, err)

	w := membership.NewWatcher(cli, membership.WatchConfig{Logger: quietLogger()})
	lists := hookResyncs(w, 5*time.Second)
	wa := startWatcher(t, w)
	lists.waitFor(t, "successful", succeeded)
	require.EqualError(t, w.Run(ctx, out), "membership: watcher is already running")
	wa.none(t)
}

func mustJSON(t *testing.T, m membership.Member) string {
	t.Helper()
	b, err := json.Marshal(m)
	require.NoError(t, err)
	return string(b)
}

// TestListReadsEveryPage: a membership larger than one page of a list is
// listed whole, each record once, in pages; a re-list finds nothing new.
func TestListReadsEveryPage(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	want := map[string]bool{}
	for id := range uint32(10) {
		r := register(t, cli, membership.RegisterConfig{Member: member("thinker", id, fmt.Sprintf("127.0.0.1:%d", 7000+id))})
		want[r.Key()] = true
	}
	w := membership.NewWatcher(cli, membership.WatchConfig{ReconcileInterval: 200 * time.Millisecond, Logger: quietLogger()})
	membership.SetListPage(w, 3)
	lists := hookResyncs(w, 5*time.Second)
	wa := startWatcher(t, w)
	got := map[string]bool{}
	for range want {
		ev := wa.next(t)
		require.Equal(t, membership.Join, ev.Type)
		require.False(t, got[ev.Key], "%s listed twice", ev.Key)
		got[ev.Key] = true
	}
	require.Equal(t, want, got)
	lists.waitFor(t, "first", func(err error) bool { return err == nil })
	lists.waitFor(t, "second", func(err error) bool { return err == nil })
	wa.none(t)
}
