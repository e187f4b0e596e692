package router

import (
	"cmp"
	"slices"
	"sync"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// DefaultIndexCapacity bounds a prefix index: about 256k blocks, a few
// tens of MB at most, enough for every block of a few hundred long
// conversations on each of dozens of replicas.
const DefaultIndexCapacity = 1 << 18

// PrefixIndex maps block hashes (chained, so a hash names a whole prefix)
// to the replicas believed to hold them, for one stage. It is bounded: past
// its capacity the least recently used block is forgotten first, and since
// a shared prefix is used more often than the tails that extend it, tails
// go first.
//
// Beliefs come from two sources. Insert records the head's own guess (it
// sent this prompt there, so the replica probably caches it). Apply records
// what an engine reported (stagepb.KvEvents): per block and replica the
// index keeps the state of the highest report seq seen, including
// "evicted", so reports that arrive out of order cannot resurrect a block.
//
// All methods are safe for concurrent use: request goroutines Match and
// Insert; Forget runs when a replica leaves.
type PrefixIndex struct {
	mu       sync.Mutex
	capacity int
	entries  map[uint64]*prefixEntry
	lru      prefixEntry // sentinel: lru.next is the most recently used
	// clearedAt is, per replica, the seq of its latest "cache cleared"
	// report: older reports are stale.
	clearedAt map[Key]uint64
}

type prefixEntry struct {
	hash    uint64
	holders []holder
	// at indexes holders by key once there are more than holderIndexMin
	// of them (a prefix shared across a large stage), so that find stays
	// O(1) there; nil below.
	at         map[Key]int
	prev, next *prefixEntry
}

// holderIndexMin is how many holders an entry finds by a linear scan
// before it keeps them indexed by key.
const holderIndexMin = 16

// holder is one replica's state for a block.
type holder struct {
	key  Key
	seq  uint64 // report seq; 0 for the head's guess
	held bool   // false: evicted as of seq (a tombstone)
}

// NewPrefixIndex returns an empty index holding at most capacity blocks
// (capacity <= 0: DefaultIndexCapacity).
func NewPrefixIndex(capacity int) *PrefixIndex {
	if capacity <= 0 {
		capacity = DefaultIndexCapacity
	}
	x := &PrefixIndex{capacity: capacity, entries: map[uint64]*prefixEntry{}, clearedAt: map[Key]uint64{}}
	x.lru.prev, x.lru.next = &x.lru, &x.lru
	return x
}

// Len is the number of blocks the index holds (tombstones included).
func (x *PrefixIndex) Len() int {
	x.mu.Lock()
	defer x.mu.Unlock()
	return len(x.entries)
}

// Match returns, for each key, how many leading hashes that replica holds.
// Blocks on a matched path count as used.
func (x *PrefixIndex) Match(hashes []uint64, keys []Key) []int {
	out := make([]int, len(keys))
	x.match(hashes, keys, out, nil)
	return out
}

// match is Match into out (len(keys), zeroed). Its cost follows the
// replicas that hold the first block, not len(keys), when keys are sorted
// (as a stage's candidates are); live is scratch space it may reuse.
func (x *PrefixIndex) match(hashes []uint64, keys []Key, out, live []int) []int {
	if len(hashes) == 0 || len(keys) == 0 {
		return live
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	e := x.entries[hashes[0]]
	if e == nil {
		return live
	}
	// live: the keys that hold every block so far.
	live = live[:0]
	switch {
	case e.at != nil && len(e.holders) > 4*len(keys):
		// Far more holders than keys (a large stage's few candidates):
		// look each key up instead.
		for k, key := range keys {
			if e.holds(key) {
				live = append(live, k)
			}
		}
	case slices.IsSortedFunc(keys, compareKeys):
		for _, hd := range e.holders {
			if k, ok := slices.BinarySearchFunc(keys, hd.key, compareKeys); ok && hd.held {
				live = append(live, k)
			}
		}
		slices.Sort(live) // the order of keys, as the linear scan below gives
	default:
		for k, key := range keys {
			if e.holds(key) {
				live = append(live, k)
			}
		}
	}
	for i := 0; len(live) > 0; {
		for _, k := range live {
			out[k]++
		}
		x.touch(e)
		if i++; i == len(hashes) {
			break
		}
		if e = x.entries[hashes[i]]; e == nil {
			break
		}
		live = slices.DeleteFunc(live, func(k int) bool { return !e.holds(keys[k]) })
	}
	return live
}

// compareKeys orders keys by stage, then replica id.
func compareKeys(a, b Key) int {
	if c := cmp.Compare(a.Stage, b.Stage); c != 0 {
		return c
	}
	return cmp.Compare(a.Replica, b.Replica)
}

// Insert records the head's guess that key now holds every block of hashes.
// It never overrides what the engine itself reported about a block.
func (x *PrefixIndex) Insert(key Key, hashes []uint64) {
	x.mu.Lock()
	defer x.mu.Unlock()
	for _, h := range hashes {
		e := x.entry(h)
		if i := e.find(key); i >= 0 {
			if e.holders[i].seq == 0 {
				e.holders[i].held = true
			}
		} else {
			e.add(holder{key: key, held: true})
		}
		x.touch(e)
	}
	x.evict()
}

// Apply records an engine's report for key.
func (x *PrefixIndex) Apply(key Key, ev *stagepb.KvEvents) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.applyLocked(key, ev)
}

// Reset replaces what the index holds of key with an engine's snapshot of
// its cache (stored: every block it holds at seq): every older belief about
// key is dropped; a report newer than the snapshot that was applied first
// stays.
func (x *PrefixIndex) Reset(key Key, snap *stagepb.KvEvents) {
	seq := snap.GetSeq()
	x.mu.Lock()
	defer x.mu.Unlock()
	x.clearedAt[key] = seq
	x.dropLocked(func(hd holder) bool { return hd.key == key && hd.seq <= seq })
	x.applyLocked(key, &stagepb.KvEvents{Seq: seq, Stored: snap.GetStored()})
}

func (x *PrefixIndex) applyLocked(key Key, ev *stagepb.KvEvents) {
	seq := ev.GetSeq()
	if ev.GetCleared() && seq > x.clearedAt[key] {
		x.clearedAt[key] = seq
		x.dropLocked(func(hd holder) bool { return hd.key == key && hd.seq < seq })
	}
	if seq < x.clearedAt[key] {
		return // from before a clear that is already applied
	}
	set := func(h uint64, held bool) {
		e := x.entry(h)
		if i := e.find(key); i >= 0 {
			if e.holders[i].seq <= seq {
				e.holders[i] = holder{key: key, seq: seq, held: held}
			}
		} else {
			e.add(holder{key: key, seq: seq, held: held})
		}
		x.touch(e)
	}
	for _, h := range ev.GetRemoved() {
		set(h, false)
	}
	for _, h := range ev.GetStored() {
		set(h, true)
	}
	x.evict()
}

// Forget drops everything known about key: a replica that left, or one
// whose cache was discarded.
func (x *PrefixIndex) Forget(key Key) {
	x.mu.Lock()
	defer x.mu.Unlock()
	delete(x.clearedAt, key)
	x.dropLocked(func(hd holder) bool { return hd.key == key })
}

// dropLocked removes the holders drop selects, and the blocks left with none.
func (x *PrefixIndex) dropLocked(drop func(holder) bool) {
	for h, e := range x.entries {
		n := 0
		for _, hd := range e.holders {
			if !drop(hd) {
				e.holders[n] = hd
				n++
			}
		}
		if n != len(e.holders) {
			clear(e.holders[n:])
			e.holders = e.holders[:n]
			e.reindex()
		}
		if n == 0 {
			x.unlink(e)
			delete(x.entries, h)
		}
	}
}

// entry returns the block's entry, creating it (most recently used).
func (x *PrefixIndex) entry(h uint64) *prefixEntry {
	e := x.entries[h]
	if e == nil {
		e = &prefixEntry{hash: h}
		x.entries[h] = e
		x.pushFront(e)
	}
	return e
}

// evict forgets least recently used blocks beyond the capacity.
func (x *PrefixIndex) evict() {
	for len(x.entries) > x.capacity {
		e := x.lru.prev
		x.unlink(e)
		delete(x.entries, e.hash)
	}
}

func (x *PrefixIndex) touch(e *prefixEntry) {
	if x.lru.next != e {
		x.unlink(e)
		x.pushFront(e)
	}
}

func (x *PrefixIndex) pushFront(e *prefixEntry) {
	e.prev, e.next = &x.lru, x.lru.next
	x.lru.next.prev = e
	x.lru.next = e
}

func (x *PrefixIndex) unlink(e *prefixEntry) {
	e.prev.next = e.next
	e.next.prev = e.prev
	e.prev, e.next = nil, nil
}

// add appends a holder (of a key the entry does not hold yet).
func (e *prefixEntry) add(hd holder) {
	e.holders = append(e.holders, hd)
	switch {
	case e.at != nil:
		e.at[hd.key] = len(e.holders) - 1
	case len(e.holders) > holderIndexMin:
		e.reindex()
	}
}

// reindex rebuilds at after holders changed.
func (e *prefixEntry) reindex() {
	if len(e.holders) <= holderIndexMin {
		e.at = nil
		return
	}
	e.at = make(map[Key]int, len(e.holders))
	for i, hd := range e.holders {
		e.at[hd.key] = i
	}
}

func (e *prefixEntry) find(key Key) int {
	if e.at != nil {
		if i, ok := e.at[key]; ok {
			return i
		}
		return -1
	}
	for i, hd := range e.holders {
		if hd.key == key {
			return i
		}
	}
	return -1
}

func (e *prefixEntry) holds(key Key) bool {
	i := e.find(key)
	return i >= 0 && e.holders[i].held
}
