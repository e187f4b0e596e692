package sim

import (
	"slices"

	"google.golang.org/protobuf/proto"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// blockPool is the KV cache: a fixed number of blocks, reference counted,
// with a prefix cache in the style of vLLM v1. A full block that has been
// computed is "committed" under the chained hash of its tokens; when its
// last user lets go it stays cached on the free list (least recently freed
// first out) until a fresh allocation evicts it. Owned by the scheduler
// goroutine; not safe for concurrent use.
type blockPool struct {
	blocks  []kvBlock
	head    int32 // sentinel index of the circular free list (len(blocks))
	numFree int
	used    int // blocks with ref > 0
	cached  map[uint64]int32
	events  kvEventLog
}

// kvEventLog collects what the prefix cache stored and evicted since the
// last report, coalesced per hash to the state at the end of the period.
type kvEventLog struct {
	seq     uint64
	cleared bool
	pending map[uint64]bool // hash → stored (true) or removed (false)
	// watchers get every report take makes (see Engine.WatchCache).
	watchers map[*cacheWatcher]struct{}
}

// cacheWatcher is one Engine.WatchCache registration.
type cacheWatcher struct{ fn func(*stagepb.KvEvents) }

// snapshot is a report of every block in cached, as of the last report
// taken: a watcher that applies it, then every later report, holds what
// the engine holds (a block changed since the last take is in the
// snapshot already and again in the next report, which states its final
// state, so applying both is harmless).
func (l *kvEventLog) snapshot(cached map[uint64]int32) *stagepb.KvEvents {
	ev := &stagepb.KvEvents{Seq: l.seq, Cleared: true, Snapshot: true, Stored: make([]uint64, 0, len(cached))}
	for h := range cached {
		ev.Stored = append(ev.Stored, h)
	}
	slices.Sort(ev.Stored)
	return ev
}

func (l *kvEventLog) record(hash uint64, stored bool) {
	if l.pending == nil {
		l.pending = map[uint64]bool{}
	}
	l.pending[hash] = stored
}

// take returns the events since the last take, or nil when there are none.
func (l *kvEventLog) take() *stagepb.KvEvents {
	if len(l.pending) == 0 && !l.cleared {
		return nil
	}
	l.seq++
	ev := &stagepb.KvEvents{Seq: l.seq, Cleared: l.cleared}
	for h, stored := range l.pending {
		if stored {
			ev.Stored = append(ev.Stored, h)
		} else {
			ev.Removed = append(ev.Removed, h)
		}
	}
	slices.Sort(ev.Stored) // deterministic reports
	slices.Sort(ev.Removed)
	clear(l.pending)
	l.cleared = false
	if len(l.watchers) > 0 {
		shared := proto.Clone(ev).(*stagepb.KvEvents) // the chunk's copy may be merged into others
		for w := range l.watchers {
			w.fn(shared)
		}
	}
	return ev
}

type kvBlock struct {
	ref        int
	hash       uint64
	hashed     bool // committed: cached[hash] == this block
	prev, next int32
	free       bool
}

func newBlockPool(n int) *blockPool {
	p := &blockPool{blocks: make([]kvBlock, n+1), head: int32(n), cached: map[uint64]int32{}}
	p.blocks[p.head].prev, p.blocks[p.head].next = p.head, p.head
	for i := range n {
		p.pushBack(int32(i))
	}
	return p
}

func (p *blockPool) size() int { return len(p.blocks) - 1 }

func (p *blockPool) pushBack(id int32) {
	b, h := &p.blocks[id], &p.blocks[p.head]
	b.prev, b.next = h.prev, p.head
	p.blocks[h.prev].next = id
	h.prev = id
	b.free = true
	p.numFree++
}

func (p *blockPool) unlink(id int32) {
	b := &p.blocks[id]
	p.blocks[b.prev].next = b.next
	p.blocks[b.next].prev = b.prev
	b.free = false
	p.numFree--
}

// lookup returns the blocks that hold the longest cached prefix of hashes.
func (p *blockPool) lookup(hashes []uint64) []int32 {
	var hits []int32
	for _, h := range hashes {
		id, ok := p.cached[h]
		if !ok {
			break
		}
		hits = append(hits, id)
	}
	return hits
}

// canAllocate reports whether n fresh blocks fit once hits are taken
// (a hit on a cached free block takes it off the free list).
func (p *blockPool) canAllocate(n int, hits []int32) bool {
	free := p.numFree
	for _, id := range hits {
		if p.blocks[id].free {
			free--
		}
	}
	return n <= free
}

// acquire takes a reference on cache hits.
func (p *blockPool) acquire(hits []int32) {
	for _, id := range hits {
		b := &p.blocks[id]
		if b.free {
			p.unlink(id)
		}
		if b.ref == 0 {
			p.used++
		}
		b.ref++
	}
}

// allocate takes n fresh blocks from the front of the free list, evicting
// their cached content. The caller checked canAllocate.
func (p *blockPool) allocate(n int) []int32 {
	ids := make([]int32, 0, n)
	for range n {
		id := p.blocks[p.head].next
		p.unlink(id)
		b := &p.blocks[id]
		if b.hashed {
			delete(p.cached, b.hash)
			b.hashed = false
			p.events.record(b.hash, false)
		}
		b.ref = 1
		p.used++
		ids = append(ids, id)
	}
	return ids
}

// release drops one reference on each block, tail first, so that when they
// fall free the tail of a sequence is evicted before its shared prefix.
func (p *blockPool) release(ids []int32) {
	for i := len(ids) - 1; i >= 0; i-- {
		b := &p.blocks[ids[i]]
		b.ref--
		if b.ref == 0 {
			p.used--
			p.pushBack(ids[i])
		}
	}
}

// commit caches a computed full block under its chained hash, unless
// another block already holds the same content.
func (p *blockPool) commit(id int32, hash uint64) {
	if _, dup := p.cached[hash]; dup {
		return
	}
	b := &p.blocks[id]
	b.hash, b.hashed = hash, true
	p.cached[hash] = id
	p.events.record(hash, true)
}

// reset forgets the prefix cache (sleep level 2).
func (p *blockPool) reset() {
	for i := range p.blocks {
		p.blocks[i].hashed = false
	}
	clear(p.cached)
	clear(p.events.pending)
	p.events.cleared = true
}

// chainHash is the hash of a full block given its parent's hash: the
// protocol's block hash, so the blocks named in KvEvents are the ones the
// head computes from a prompt.
func chainHash(parent uint64, tokens []uint32) uint64 { return stagepb.BlockHash(parent, tokens) }
