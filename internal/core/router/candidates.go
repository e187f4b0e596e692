package router

import (
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
)

// loadSample is how many replicas a large pick draws at random for their
// load. The least loaded of k uniform draws is, in expectation, at rank
// N/(k+1) of N (about the least loaded 3% for 32), and is outside the
// least loaded 10% with probability 0.9^32 ≈ 3.4% (see
// TestLargeStageLoadQuality).
const loadSample = 32

// sampleTries bounds the draws of one sample: a stage where most replicas
// are out (asleep, ejected, excluded) falls back to the filtered path.
const sampleTries = 4 * loadSample

// hintSlots is how many of a large stage's latest load winners a
// least_loaded or deadline pick also reads (the memory of "power of d
// choices with memory": a replica that was the lightest a moment ago
// usually still is among the lightest).
const hintSlots = 2

// stageHints are a stage's latest load winners. Written by any pick,
// lock-free; a hint is only a candidate, checked for eligibility as a
// draw is.
type stageHints struct {
	next  atomic.Uint32
	slots [hintSlots]atomic.Pointer[Replica]
}

func (h *stageHints) record(rep *Replica) {
	if rep != nil {
		h.slots[h.next.Add(1)%hintSlots].Store(rep)
	}
}

// largeScratch is a large pick's working memory, reused through a pool
// so that a pick allocates nothing that grows with the stage.
type largeScratch struct {
	c    []*Replica
	tmp  []*Replica
	ids  []uint64
	keys []Key
	ord  order
}

// scratchCap is the room a new largeScratch starts with: enough for a
// pick's usual candidates, so that a pool miss (frequent under -race,
// where sync.Pool drops items on purpose) costs a fixed few allocations,
// not a slice growing step by step.
const scratchCap = 128

var largePool = sync.Pool{New: func() any {
	return &largeScratch{
		c:   make([]*Replica, 0, scratchCap),
		tmp: make([]*Replica, 0, scratchCap),
		ids: make([]uint64, 0, scratchCap),
	}
}}

// pickLarge decides for a stage of more than LargeStage replicas from a
// bounded candidate set (docs/routing.md, Large stages): loadSample
// random eligible replicas, plus what the policy needs to find by name
// rather than by chance: the session's or the prefix's first replicas in
// their rendezvous order (order.top), the replicas holding the input's
// longest cached prefix (PrefixIndex.deepest), and for least_loaded and
// deadline the stage's latest winners. The policy then decides over that
// set as it decides over a small stage. ok is false when the draws found
// nothing eligible.
func (r *Router) pickLarge(s *Snapshot, stage int, req *Request, all *Replicas, exclude []*Replica, o *stageOrder) (Decision, bool) {
	ls := largePool.Get().(*largeScratch)
	defer largePool.Put(ls)
	ls.ord.reset(o)
	c := ls.c[:0]
	defer func() { clear(c); clear(ls.tmp); ls.c, ls.ord.o = c[:0], nil }() // the pool holds no replica
	for range sampleTries {
		if len(c) == loadSample {
			break
		}
		if rep := all.At(rand.IntN(all.Len())); eligible(rep, exclude) {
			c = append(c, rep)
		}
	}
	if len(c) == 0 {
		return Decision{}, false
	}
	st := r.stages[stage]
	session := st.SessionAffinity && req.SessionKey != ""
	hints := &r.hints[stage]
	switch p := st.Policy.(type) {
	case LeastLoaded, *Deadline:
		if !session {
			for i := range hintSlots {
				if rep := hints.slots[i].Load(); rep != nil && rep.Key.Stage == stage && eligible(rep, exclude) {
					c = append(c, rep)
				}
			}
		}
	case *PrefixAware:
		if !session {
			c, ls.keys = p.largeCandidates(req, s, stage, &ls.ord, c, exclude, ls.keys)
		}
	case *RoundRobin, PowerOfTwo:
	default:
		return Decision{}, false // a policy not written for a sample reads the stage
	}
	if session {
		c = ls.ord.top(sessionHash(req.SessionKey), c, exclude)
	}
	// Sorted by id, without repeats, as a small stage's candidates are:
	// ties then go alike on every head, and the index matches them fast.
	c, ls.ids, ls.tmp = sortByID(c, ls.ids, ls.tmp)
	c = slices.Compact(c)
	if session {
		rep, first := affinityOf(st.Policy).pick(req.SessionKey, c, &ls.ord)
		d := Decision{Replica: rep, Policy: st.Policy.Name(), Reason: ReasonAffinity}
		if !first {
			d.Reason = ReasonLoadFallback
		}
		return d, true
	}
	req.order = &ls.ord
	d := st.Policy.Pick(req, c)
	req.order = nil
	if d.Reason != ReasonDeadlineShed {
		hints.record(d.Replica)
	}
	return d, true
}

// sortByID sorts c by replica id, stably, through ids and tmp (scratch,
// returned for reuse): the ids packed with their positions sort as plain
// integers, without a comparison call that reads two replicas.
func sortByID(c []*Replica, ids []uint64, tmp []*Replica) ([]*Replica, []uint64, []*Replica) {
	ids, tmp = ids[:0], append(tmp[:0], c...)
	for i, rep := range c {
		ids = append(ids, uint64(rep.Key.Replica)<<32|uint64(i))
	}
	slices.Sort(ids)
	for i, id := range ids {
		c[i] = tmp[uint32(id)]
	}
	return c, ids, tmp
}
