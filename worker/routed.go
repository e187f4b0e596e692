package worker

import (
	"sync"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// RoutedHistoryBlocks bounds the routed blocks a worker keeps for a new
// subscriber's snapshot (8 bytes each: 128 KiB): the recent requests'
// blocks, the ones a head that subscribes late would otherwise not know
// this replica holds. Older ones the engine has likely evicted anyway.
const RoutedHistoryBlocks = 16384

// routedHub publishes the head-side blocks heads routed to this replica
// (GenerateRequest.routed_blocks) to its routed SubscribeCache
// subscribers, so that every head's head-side index learns what every
// head sent here (docs/routing.md, "Several heads"). Request goroutines
// publish; it never waits for a subscriber (each has a bounded queue and
// is dropped when that is full). Safe for concurrent use.
type routedHub struct {
	mu     sync.Mutex
	seq    uint64
	hist   [][]uint64 // the latest requests' blocks, oldest first
	blocks int        // in hist
	subs   map[*cacheSub]struct{}
}

func newRoutedHub() *routedHub { return &routedHub{subs: map[*cacheSub]struct{}{}} }

// publish reports blocks (one request's, not modified afterwards) to
// every subscriber and keeps them for the snapshot of later ones.
func (h *routedHub) publish(blocks []uint64) {
	if len(blocks) == 0 {
		return
	}
	if len(blocks) > RoutedHistoryBlocks {
		blocks = blocks[:RoutedHistoryBlocks] // the prefix: it names the rest
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.seq++
	h.hist = append(h.hist, blocks)
	h.blocks += len(blocks)
	n := 0
	for h.blocks > RoutedHistoryBlocks {
		h.blocks -= len(h.hist[n])
		h.hist[n] = nil
		n++
	}
	h.hist = h.hist[n:]
	h.send(&stagepb.KvEvents{Seq: h.seq, Stored: blocks, Routed: true})
}

// clear forgets the history and tells subscribers the cache is gone (the
// engine discarded it: sleep level 2).
func (h *routedHub) clear() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.seq++
	clear(h.hist)
	h.hist, h.blocks = h.hist[:0], 0
	h.send(&stagepb.KvEvents{Seq: h.seq, Cleared: true, Routed: true})
}

func (h *routedHub) send(ev *stagepb.KvEvents) {
	for sub := range h.subs {
		sub.push(ev)
	}
}

// watch queues a snapshot of the history (the reports up to seq, oldest
// first, so the newest are the most recently used on the head) on sub,
// then every report after it, until stop.
func (h *routedHub) watch(sub *cacheSub) (stop func()) {
	h.mu.Lock()
	defer h.mu.Unlock()
	stored := make([]uint64, 0, h.blocks)
	for _, b := range h.hist {
		stored = append(stored, b...)
	}
	sub.push(&stagepb.KvEvents{Seq: h.seq, Stored: stored, Snapshot: true, Routed: true})
	h.subs[sub] = struct{}{}
	return func() {
		h.mu.Lock()
		defer h.mu.Unlock()
		delete(h.subs, sub)
	}
}
