package membership

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// DefaultReconcileInterval is the full re-list period when
// WatchConfig.ReconcileInterval is zero.
const DefaultReconcileInterval = 30 * time.Second

// listTimeout bounds one list; an unreachable etcd is retried with backoff.
const listTimeout = 10 * time.Second

// WatchConfig configures a Watcher.
type WatchConfig struct {
	Cluster           string
	Stages            []string      // known stage names; a record for another stage is invalid. Empty: any.
	ReconcileInterval time.Duration // full re-list period; default DefaultReconcileInterval
	// OnInvalid is called, from Run's goroutine, once per malformed record
	// (per key and mod revision). It must not block.
	OnInvalid func(key string, err error)
	Logger    *slog.Logger
}

// Watcher turns the member keys of one cluster into ordered Events.
//
// Run opens a watch from etcd's current revision, lists the members at
// the revision C the watch was created at, sends the difference to what it
// knew, then sends the watch's events after C (those at or before C are
// the list's), so no change is missed and none is applied twice. The watch
// opens first so that etcd counts it in sync at once: a watch from a past
// revision waits for etcd's next resync of slow watchers (every 100 ms)
// before it delivers anything. When the watch is compacted or breaks it
// watches and lists again and sends the difference; every
// ReconcileInterval it does so anyway, to repair any silent drift. While
// etcd is unreachable it keeps the last known membership (no Leave is
// invented) and retries with backoff.
//
// Per key, events come in revision order: a Join, possibly more Joins when
// the record changes (a new mod revision: new addr, new lease), then a Leave
// carrying the last record. A record that does not decode, does not match
// its key, or names an unknown stage is skipped and reported; if the key
// held a valid record before, that record gets a Leave.
type Watcher struct {
	cli       *clientv3.Client
	prefix    string
	cluster   string
	stages    map[string]bool
	reconcile time.Duration
	onInvalid func(key string, err error)
	lg        *slog.Logger
	cfgErr    error

	listTimeout time.Duration
	listPage    int64                      // records per request of a list (listPage)
	onResync    func(rev int64, err error) // test hook: after each list
	dropEvent   func(*clientv3.Event) bool // test hook: lose a watch event silently

	running atomic.Bool
	// lastContact is when etcd last answered the watcher (a list, a watch
	// response or a progress notification), in Unix nanoseconds; 0 before
	// the first list. See LastContact.
	lastContact atomic.Int64
	// Owned by the goroutine in Run.
	known   map[string]knownRecord // valid records, as last sent
	invalid map[string]int64       // key → mod revision of the malformed record reported
}

type knownRecord struct {
	member Member
	modRev int64
}

// NewWatcher returns a Watcher; it starts nothing. A bad config is
// reported by Run.
func NewWatcher(cli *clientv3.Client, cfg WatchConfig) *Watcher {
	cluster := cfg.Cluster
	if cluster == "" {
		cluster = DefaultCluster
	}
	w := &Watcher{
		cli:       cli,
		cluster:   cluster,
		prefix:    MembersPrefix(cluster),
		reconcile: cfg.ReconcileInterval,
		onInvalid: cfg.OnInvalid,
		lg:        cfg.Logger,
		known:     map[string]knownRecord{},
		invalid:   map[string]int64{},

		listTimeout: listTimeout,
		listPage:    listPage,
	}
	if w.reconcile <= 0 {
		w.reconcile = DefaultReconcileInterval
	}
	if w.lg == nil {
		w.lg = slog.Default()
	}
	if len(cfg.Stages) > 0 {
		w.stages = map[string]bool{}
		for _, s := range cfg.Stages {
			w.stages[s] = true
		}
	}
	switch {
	case cli == nil:
		w.cfgErr = errors.New("membership: watch: nil etcd client")
	default:
		w.cfgErr = ValidateCluster(cluster)
	}
	return w
}

// Run sends events to out until ctx ends, then returns ctx.Err(). It
// returns another error only for a bad config or a concurrent Run. It never
// closes out; every send also waits on ctx. Run may be called again after
// it returned: it continues from the membership it last sent, so the first
// list reports only what changed meanwhile.
func (w *Watcher) Run(ctx context.Context, out chan<- Event) error {
	if w.cfgErr != nil {
		return w.cfgErr
	}
	if !w.running.CompareAndSwap(false, true) {
		return errors.New("membership: watcher is already running")
	}
	defer w.running.Store(false)

	listWait := newBackoff(100*time.Millisecond, 5*time.Second)
	watchWait := newBackoff(100*time.Millisecond, 5*time.Second)
	var lastListWarn time.Time
	for {
		end, watched, err := w.session(ctx, out, func(rev int64, err error) {
			if w.onResync != nil {
				w.onResync(rev, err)
			}
			if err == nil && !lastListWarn.IsZero() {
				w.lg.Info("membership: listing members again", "prefix", w.prefix, "revision", rev)
				lastListWarn = time.Time{}
			}
		})
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if end == watchNotListed {
			if time.Since(lastListWarn) >= 30*time.Second {
				lastListWarn = time.Now()
				w.lg.Warn("membership: cannot list members; keeping the last known membership and retrying",
					"prefix", w.prefix, "members", len(w.known), "err", err)
			}
			if !sleep(ctx, listWait) {
				return ctx.Err()
			}
			continue
		}
		listWait.Reset() // it listed
		switch end {
		case watchReconcile:
			w.lg.Debug("membership: periodic reconcile", "prefix", w.prefix)
			continue
		case watchCompacted:
			w.lg.Warn("membership: watch compacted; re-listing", "prefix", w.prefix, "err", err)
		case watchBroken:
			w.lg.Warn("membership: watch broken; re-listing", "prefix", w.prefix, "err", err)
		}
		// A watch that breaks at once (no leader, denied) must not spin.
		if watched > 10*time.Second {
			watchWait.Reset()
		}
		if !sleep(ctx, watchWait) {
			return ctx.Err()
		}
	}
}

// progressInterval is how often a watch asks etcd for a progress
// notification, so that a quiet but healthy watch still hears from etcd and
// LastContact stays within about this much of now.
const progressInterval = 2 * time.Second

// LastContact is when etcd last answered this watcher: its latest list,
// watch response or progress notification; zero before the first list. Now
// minus it is the watch's lag: how stale the membership may be. Safe for
// concurrent use.
func (w *Watcher) LastContact() time.Time {
	if n := w.lastContact.Load(); n != 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}

func (w *Watcher) heard() { w.lastContact.Store(time.Now().UnixNano()) }

// resync lists the members at revision rev and sends the difference to
// the known state.
func (w *Watcher) resync(ctx context.Context, out chan<- Event, rev int64) error {
	kvs, err := w.list(ctx, rev)
	if err != nil {
		return err
	}
	seen := make(map[string]bool, len(kvs))
	var leaves, joins []Event
	for _, kv := range kvs {
		key := string(kv.Key)
		seen[key] = true
		m, err := w.decode(key, kv.Value, kv.Lease)
		if err != nil {
			w.reportInvalid(key, kv.ModRevision, err)
			if old, ok := w.known[key]; ok {
				leaves = append(leaves, Event{Type: Leave, Key: key, Member: old.member, Revision: kv.ModRevision})
			}
			continue
		}
		delete(w.invalid, key)
		if old, ok := w.known[key]; ok && old.modRev == kv.ModRevision {
			continue
		}
		joins = append(joins, Event{Type: Join, Key: key, Member: m, Revision: kv.ModRevision})
	}
	for key, old := range w.known {
		if !seen[key] {
			leaves = append(leaves, Event{Type: Leave, Key: key, Member: old.member, Revision: rev})
		}
	}
	for key := range w.invalid {
		if !seen[key] {
			delete(w.invalid, key)
		}
	}
	// Leaves first (they happened at or before rev), then joins in the
	// order they were written.
	slices.SortFunc(leaves, func(a, b Event) int { return cmp.Compare(a.Key, b.Key) })
	slices.SortFunc(joins, func(a, b Event) int {
		return cmp.Or(cmp.Compare(a.Revision, b.Revision), cmp.Compare(a.Key, b.Key))
	})
	for _, ev := range append(leaves, joins...) {
		if !w.send(ctx, out, ev) {
			return ctx.Err()
		}
	}
	return nil
}

// listPage is how many records one request of a list reads.
const listPage = 1000

// list reads every record under the prefix at revision rev, listPage at a
// time, so that the pages make one consistent list. Each page has its own
// listTimeout: a busy etcd answers bounded requests one by one, where one
// answer of a large membership may never come in time and its retries keep
// etcd saturated. A failed page or a revision compacted meanwhile fails the
// list, which Run retries with backoff.
func (w *Watcher) list(ctx context.Context, rev int64) ([]*mvccpb.KeyValue, error) {
	end := clientv3.GetPrefixRangeEnd(w.prefix)
	from := w.prefix
	var kvs []*mvccpb.KeyValue
	for {
		lctx, cancel := context.WithTimeout(ctx, w.listTimeout)
		resp, err := w.cli.Get(lctx, from, clientv3.WithRange(end), clientv3.WithLimit(w.listPage), clientv3.WithRev(rev))
		cancel()
		if err != nil {
			return nil, err
		}
		w.heard()
		kvs = append(kvs, resp.Kvs...)
		if !resp.More || len(resp.Kvs) == 0 {
			return kvs, nil
		}
		from = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
}

type watchEnd uint8

const (
	watchNotListed watchEnd = iota + 1 // the watch did not open or the list failed
	watchReconcile
	watchCompacted
	watchBroken
)

// session opens a watch, lists at the revision it was created at (listed
// is called with that revision and the list's error), then applies the
// watch's later changes until the watch ends, ctx ends, or it is time to
// reconcile. watched is how long the watch ran after the list.
func (w *Watcher) session(ctx context.Context, out chan<- Event, listed func(rev int64, err error)) (end watchEnd, watched time.Duration, err error) {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// RequireLeader: a member cut off from the leader ends the watch
	// instead of serving silence; the list that follows then fails and
	// is retried while the last membership is kept.
	wctx = clientv3.WithRequireLeader(wctx)
	// From etcd's current revision (no WithRev): such a watch is in sync
	// when it is created, and etcd answers its progress requests. Until
	// it is created, listTimeout bounds it: while etcd is away the client
	// does not even take the request, so Watch itself blocks.
	timeout := time.AfterFunc(w.listTimeout, cancel)
	wch := w.cli.Watch(wctx, w.prefix, clientv3.WithPrefix(), clientv3.WithCreatedNotify())
	rev, err := w.created(ctx, wch)
	if !timeout.Stop() {
		err = fmt.Errorf("membership: watch not created within %v", w.listTimeout)
	}
	if err == nil {
		err = w.resync(ctx, out, rev)
	}
	if ctx.Err() != nil {
		return 0, 0, ctx.Err()
	}
	listed(rev, err)
	if err != nil {
		return watchNotListed, 0, err
	}
	started := time.Now()
	end, err = w.follow(ctx, wctx, out, wch, rev)
	return end, time.Since(started), err
}

// created waits for the watch's created notification and returns the
// revision it was created at: every change after it comes through the
// watch.
func (w *Watcher) created(ctx context.Context, wch clientv3.WatchChan) (int64, error) {
	select {
	case <-ctx.Done():
		return 0, ctx.Err()
	case wr, ok := <-wch:
		switch {
		case !ok:
			return 0, errors.New("membership: watch channel closed")
		case wr.Err() != nil:
			return 0, fmt.Errorf("membership: watch: %w", wr.Err())
		case !wr.Created:
			return 0, errors.New("membership: watch sent events before its created notification")
		}
		w.heard()
		return wr.Header.Revision, nil
	}
}

// follow applies the watch's changes after revision listed (the list's:
// the changes at or before it are in the list) until the watch ends, ctx
// ends, or it is time to reconcile. wctx is the watch's context.
func (w *Watcher) follow(ctx, wctx context.Context, out chan<- Event, wch clientv3.WatchChan, listed int64) (watchEnd, error) {
	reconcile := time.NewTimer(w.reconcile)
	defer reconcile.Stop()
	progress := time.NewTicker(progressInterval)
	defer progress.Stop()
	for {
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-reconcile.C:
			return watchReconcile, nil
		case <-progress.C:
			// A ctx derived from the watch's (same metadata) names its
			// stream; bounded, since the request waits while the stream
			// reconnects. An error only means etcd is away: the lag shows it.
			pctx, cancel := context.WithTimeout(wctx, time.Second)
			_ = w.cli.RequestProgress(pctx)
			cancel()
		case wr, ok := <-wch:
			if !ok {
				return watchBroken, errors.New("watch channel closed")
			}
			if wr.CompactRevision != 0 {
				return watchCompacted, fmt.Errorf("revision %d compacted (now %d): %w", listed, wr.CompactRevision, wr.Err())
			}
			if err := wr.Err(); err != nil {
				return watchBroken, err
			}
			w.heard() // events, or a progress notification
			for _, ev := range wr.Events {
				if ev.Kv.ModRevision <= listed || (w.dropEvent != nil && w.dropEvent(ev)) {
					continue
				}
				if !w.apply(ctx, out, ev) {
					return 0, ctx.Err()
				}
			}
		}
	}
}

// apply turns one watch event into at most one Event; false when ctx ended.
func (w *Watcher) apply(ctx context.Context, out chan<- Event, ev *clientv3.Event) bool {
	key := string(ev.Kv.Key)
	rev := ev.Kv.ModRevision
	old, known := w.known[key]
	if ev.Type == mvccpb.DELETE {
		delete(w.invalid, key)
		if !known {
			return true
		}
		return w.send(ctx, out, Event{Type: Leave, Key: key, Member: old.member, Revision: rev})
	}
	m, err := w.decode(key, ev.Kv.Value, ev.Kv.Lease)
	if err != nil {
		w.reportInvalid(key, rev, err)
		if !known {
			return true
		}
		return w.send(ctx, out, Event{Type: Leave, Key: key, Member: old.member, Revision: rev})
	}
	delete(w.invalid, key)
	if known && old.modRev >= rev {
		return true // already sent
	}
	return w.send(ctx, out, Event{Type: Join, Key: key, Member: m, Revision: rev})
}

// send delivers ev and only then records it as known, so an event that was
// not delivered is found again by the next list.
func (w *Watcher) send(ctx context.Context, out chan<- Event, ev Event) bool {
	select {
	case out <- ev:
	case <-ctx.Done():
		return false
	}
	switch ev.Type {
	case Join:
		w.known[ev.Key] = knownRecord{member: ev.Member, modRev: ev.Revision}
	case Leave:
		delete(w.known, ev.Key)
	}
	return true
}

// decode checks a record: its JSON, its key, its stage, and that it lives
// under a lease (one written without would never leave).
func (w *Watcher) decode(key string, value []byte, lease int64) (Member, error) {
	m, err := DecodeMember(w.cluster, key, value)
	if err != nil {
		return Member{}, err
	}
	if lease == 0 {
		return Member{}, fmt.Errorf("membership: record at %q has no lease: it would never expire, so it is not routed", key)
	}
	if w.stages != nil && !w.stages[m.Stage] {
		return Member{}, fmt.Errorf("membership: record at %q: unknown stage %q", key, m.Stage)
	}
	return m, nil
}

// reportInvalid logs and counts a malformed record once per key and mod
// revision: the periodic re-list finds it again and must not recount it.
func (w *Watcher) reportInvalid(key string, modRev int64, err error) {
	if r, ok := w.invalid[key]; ok && r == modRev {
		return
	}
	w.invalid[key] = modRev
	w.lg.Warn("membership: skipping invalid member record", "key", key, "mod_revision", modRev, "err", err)
	if w.onInvalid != nil {
		w.onInvalid(key, err)
	}
}
