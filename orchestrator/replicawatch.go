package orchestrator

import (
	"context"
	"iter"
	"slices"
	"sync/atomic"
	"time"

	"github.com/troupe-serving/troupe/internal/core/router"
)

// viewChange is one entry of the head's journal of publishes (Head.journal):
// the keys whose records a publish changed and the entry after it. The
// loop fills keys and next, then closes done; readers read them only once
// done is closed, and never write them. An entry nobody holds is garbage:
// the journal keeps no history for watches that are not there.
type viewChange struct {
	keys []router.Key
	next *viewChange
	done chan struct{}
}

// append fills in c, the journal's open entry, with the keys (sorted) of
// a publish whose records are already in the view, opens the next entry
// in tail, then wakes c's readers. The loop's goroutine only.
func (c *viewChange) append(keys []router.Key, tail *atomic.Pointer[viewChange]) {
	c.keys, c.next = keys, &viewChange{done: make(chan struct{})}
	tail.Store(c.next)
	close(c.done)
}

// liveCheckInterval is how often the loop checks the states that a
// replica's requests and connection change without an input to the loop
// (checkLive): a watch sees those within it; joins, attaches, refusals,
// leaves and records at once.
const liveCheckInterval = time.Second

// checkLive publishes the routed replicas whose row state (stateOf)
// changed since it last looked: a failing connection, a draining
// refusal, the breaker, sleep change it without an input to the loop,
// and watches follow the loop's publishes only. The loop's goroutine
// only, within a batch. O(N) map lookups and atomic loads, once a second
// whatever the watches.
func (f *fleet) checkLive() {
	snap := f.router.Snapshot()
	for stage := range f.cfg.Pipeline.Stages {
		for rep := range snap.Stage(stage).All() {
			t := f.known[rep.Key]
			if t == nil || !t.routed {
				continue
			}
			if state, reason := stateOf(t, rep, true); state != t.live.state || reason != t.live.reason {
				t.live = rowState{state, reason}
				f.publish(t.key)
			}
		}
	}
}

// ReplicaWatch follows GET /v1/replicas rows as they change (GET
// /v1/replicas?watch=true): Head.WatchReplicas gives the rows at its
// start, Next each change after them. It reads the journal of the head's
// publishes, so a change costs a watch the rows it touched, not the
// fleet's, and a quiet fleet costs it nothing. One goroutine calls Next
// at a time; watches are independent.
type ReplicaWatch struct {
	h     *fleet
	stage int // the stage it follows; -1: every stage
	at    *viewChange
	sent  map[router.Key]rowMark
}

// rowMark is what makes a row news: a row is sent again when one of these
// changes, not when only its load, in-flight count or ages do.
type rowMark struct {
	state       ReplicaState
	reason      string
	addr        string
	metricsAddr string
	engineIndex int
	joinedAt    time.Time
	leaseLost   time.Time
}

func markOf(s *ReplicaStatus) rowMark {
	m := rowMark{state: s.State, reason: s.Reason, addr: s.Addr, metricsAddr: s.MetricsAddr, engineIndex: s.EngineIndex, joinedAt: s.JoinedAt}
	if s.LeaseLostUntil != nil {
		m.leaseLost = *s.LeaseLostUntil
	}
	return m
}

// WatchReplicas starts a watch of stage's rows (-1: every stage's) and
// returns it with the rows as they are now, in key order.
func (h *Head) WatchReplicas(stage int) (*ReplicaWatch, []ReplicaStatus) {
	return h.fleet.watchReplicas(stage)
}

func (f *fleet) watchReplicas(stage int) (*ReplicaWatch, []ReplicaStatus) {
	// The journal's entry first: a publish after it is news to the
	// watch, even when the rows below already show it (then its marks
	// match and nothing is sent twice).
	w := &ReplicaWatch{h: f, stage: stage, at: f.journal.Load()}
	w.sent = make(map[router.Key]rowMark, f.view.Load().Len())
	return w, w.readAll()
}

// Next waits until rows of the watch change, or ctx ends, and returns the
// changed rows in key order (each the row as it is now). Its error is
// ctx's. A nil watch has no changes: it waits for ctx.
func (w *ReplicaWatch) Next(ctx context.Context) ([]ReplicaStatus, error) {
	if w == nil {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	for {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-w.at.done:
			if rows := w.read(w.catchUp()); len(rows) > 0 {
				return rows, nil
			}
		}
	}
}

// catchUp moves the watch past every publish so far and returns the keys
// they changed, sorted, once each.
func (w *ReplicaWatch) catchUp() []router.Key {
	var keys []router.Key
	for {
		select {
		case <-w.at.done:
			keys = append(keys, w.at.keys...)
			w.at = w.at.next
			continue
		default:
		}
		break
	}
	slices.SortFunc(keys, compareKeys)
	return slices.Compact(keys)
}

// read returns the rows of keys whose marks differ from those sent, and
// notes them sent.
func (w *ReplicaWatch) read(keys []router.Key) []ReplicaStatus {
	view := w.h.view.Load()
	return w.changed(func(yield func(*tracked) bool) {
		for _, k := range keys {
			if t, ok := view.Find(k); ok && !yield(t) {
				return
			}
		}
	})
}

// readAll is read of every row the watch follows.
func (w *ReplicaWatch) readAll() []ReplicaStatus { return w.changed(w.h.view.Load().All()) }

// changed returns the rows of records whose marks differ from those sent,
// and notes them sent.
func (w *ReplicaWatch) changed(records iter.Seq[*tracked]) []ReplicaStatus {
	snap, now := w.h.router.Snapshot(), time.Now()
	var out []ReplicaStatus
	for t := range records {
		if w.stage >= 0 && t.key.Stage != w.stage {
			continue
		}
		s := w.h.statusOf(t, snap, now)
		m := markOf(&s)
		if sent, ok := w.sent[t.key]; ok && sent == m {
			continue
		}
		w.sent[t.key] = m
		out = append(out, s)
	}
	return out
}
