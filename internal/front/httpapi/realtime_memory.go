package httpapi

import (
	"fmt"
	"slices"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// What realtime sessions hold, and its bounds (docs/api.md, "Realtime
// memory"). A session holds its conversation items (their text and the
// WAV files of their audio) and its input audio buffer; each has a limit
// of its own (RealtimeConfig.MaxItems, MaxItemsBytes, MaxInputAudioBytes),
// and every session's bytes together are taken from one budget per Server
// (RealtimeConfig.MemoryBudget), so the head never holds more than the
// budget however many sessions fill up at once. A session gives back all
// it took when it ends.

// rtBudget is the head-wide budget of the bytes realtime sessions hold.
type rtBudget struct {
	limit int64
	used  atomic.Int64
	gauge prometheus.Gauge // troupe_realtime_buffered_bytes; nil without metrics
}

// take reserves n bytes, or reports false, reserving nothing, when they
// would take the budget past its limit.
func (b *rtBudget) take(n int64) bool {
	if n <= 0 {
		return true
	}
	for {
		u := b.used.Load()
		if u+n > b.limit {
			return false
		}
		if b.used.CompareAndSwap(u, u+n) {
			if b.gauge != nil {
				b.gauge.Add(float64(n))
			}
			return true
		}
	}
}

// give returns n bytes to the budget.
func (b *rtBudget) give(n int64) {
	if n <= 0 {
		return
	}
	b.used.Add(-n)
	if b.gauge != nil {
		b.gauge.Sub(float64(n))
	}
}

// rtLimit is a limit a client event ran into: the error event's code and
// message. The event changed nothing.
type rtLimit struct {
	code, msg string
}

// Error codes of the realtime memory limits (docs/api.md).
const (
	codeBufferFull   = "input_audio_buffer_full"
	codeItemTooLarge = "item_too_large"
	codeBudget       = "memory_budget_exceeded"
)

// Label values of troupe_realtime_limit_hits_total: items dropped to
// make room, and events refused by each limit.
const (
	limitDropped      = "item_dropped"
	limitInputAudio   = "input_audio"
	limitBudget       = "budget"
	limitItemTooLarge = "item_too_large"
)

// hit counts a limit's action (an item dropped, an event refused).
func (c *rtSessionConn) hit(limit string, n int) {
	if m := c.s.rtMetrics(); m != nil && n > 0 {
		m.limitHits.WithLabelValues(limit).Add(float64(n))
	}
}

func (c *rtSessionConn) budgetLimit(what string, n int) *rtLimit {
	c.hit(limitBudget, 1)
	return &rtLimit{codeBudget, fmt.Sprintf("%s needs %d more bytes, and the head holds its limit of %d bytes of realtime audio and conversation across all sessions (--realtime-memory-budget): clear or commit the input audio buffer, delete items, or retry later",
		what, n, c.s.rt.budget.limit)}
}

// memBytes is what the item holds: its text, and each part's text or
// bytes (an item with audio keeps its text parts besides their join).
func (h *historyItem) memBytes() int {
	n := len(h.text)
	for _, p := range h.parts {
		n += len(p.GetText()) + len(p.GetData())
	}
	return n
}

// admitLocked makes room in the conversation for h: a new item (isNew,
// appended at the end) or one already in it that grows by grow bytes.
// credit is bytes the caller already took from the budget for it (a
// committed buffer's), which become the item's. The oldest items other
// than h and the running response's are dropped while the session is over
// MaxItems or MaxItemsBytes; they are returned, for conversation.item.deleted.
// When the limits cannot be met, or the budget cannot give what is still
// missing, nothing changes and the credit stays the caller's. c.mu is held.
func (c *rtSessionConn) admitLocked(h *historyItem, grow int, isNew bool, credit int64) ([]*historyItem, *rtLimit) {
	size := h.held + grow
	if size > c.cfg.MaxItemsBytes {
		c.hit(limitItemTooLarge, 1)
		return nil, &rtLimit{codeItemTooLarge, fmt.Sprintf("the item holds %d bytes, more than a session's conversation may hold (%d bytes, --realtime-max-items-bytes)", size, c.cfg.MaxItemsBytes)}
	}
	count, bytes := len(c.items), c.itemBytes+grow
	if isNew {
		count++
	}
	var running *historyItem
	if c.turn != nil {
		running = c.turn.item
	}
	var drop []*historyItem
	freed := 0
	for _, it := range c.items {
		if count <= c.cfg.MaxItems && bytes <= c.cfg.MaxItemsBytes {
			break
		}
		if it == h || it == running {
			continue
		}
		drop = append(drop, it)
		count--
		bytes -= it.held
		freed += it.held
	}
	if count > c.cfg.MaxItems || bytes > c.cfg.MaxItemsBytes {
		c.hit(limitItemTooLarge, 1)
		return nil, &rtLimit{codeItemTooLarge, fmt.Sprintf("the conversation cannot make room for the item: only the running response's item is left to drop (--realtime-max-items %d, --realtime-max-items-bytes %d)", c.cfg.MaxItems, c.cfg.MaxItemsBytes)}
	}
	need := int64(grow) - credit - int64(freed)
	if !c.s.rt.budget.take(need) {
		return nil, c.budgetLimit("the item", int(need))
	}
	c.s.rt.budget.give(-need)
	for _, it := range drop {
		c.forgetLocked(it)
	}
	if len(drop) > 0 {
		c.items = slices.DeleteFunc(c.items, func(it *historyItem) bool { return !it.in }) // clears the tail: no reference stays
		c.hit(limitDropped, len(drop))
	}
	h.held += grow
	c.itemBytes += grow
	if isNew {
		h.in = true
		c.items = append(c.items, h)
		if c.byID == nil {
			c.byID = map[string]*historyItem{}
		}
		c.byID[h.id] = h
	}
	return drop, nil
}

// forgetLocked takes it out of the index and the session's count (the
// caller removes it from items); its bytes are the budget's again once
// the caller has given them back.
func (c *rtSessionConn) forgetLocked(it *historyItem) {
	if c.byID[it.id] == it {
		delete(c.byID, it.id)
	}
	c.itemBytes -= it.held
	it.held, it.in = 0, false
}

// removeLocked deletes it from the conversation and gives its bytes back.
func (c *rtSessionConn) removeLocked(it *historyItem) {
	n := it.held
	c.forgetLocked(it)
	c.items = slices.DeleteFunc(c.items, func(x *historyItem) bool { return x == it })
	c.s.rt.budget.give(int64(n))
}

// shrinkLocked gives back what an item lost (a truncated text).
func (c *rtSessionConn) shrinkLocked(h *historyItem) {
	if !h.in {
		return
	}
	if n := h.held - h.memBytes(); n > 0 {
		h.held -= n
		c.itemBytes -= n
		c.s.rt.budget.give(int64(n))
	}
}

// growBufferLocked makes room for n more bytes in the input audio buffer,
// whose capacity is what it holds against the budget: it doubles, within
// MaxInputAudioBytes, or grows by what the budget still has.
func (c *rtSessionConn) growBufferLocked(n int) *rtLimit {
	need := len(c.audioIn) + n
	if need > c.cfg.MaxInputAudioBytes {
		c.hit(limitInputAudio, 1)
		return &rtLimit{codeBufferFull, fmt.Sprintf("the input audio buffer holds at most %d bytes (--realtime-max-input-audio-bytes) and holds %d: commit or clear it", c.cfg.MaxInputAudioBytes, len(c.audioIn))}
	}
	if need <= cap(c.audioIn) {
		return nil
	}
	old := cap(c.audioIn)
	newCap := min(max(need, 2*old), c.cfg.MaxInputAudioBytes)
	if !c.s.rt.budget.take(int64(newCap - old)) {
		newCap = need
		if !c.s.rt.budget.take(int64(newCap - old)) {
			return c.budgetLimit("the input audio buffer", newCap-old)
		}
	}
	buf := make([]byte, len(c.audioIn), newCap)
	copy(buf, c.audioIn)
	c.audioIn = buf
	return nil
}

// dropBufferLocked empties the input audio buffer and gives its bytes back.
func (c *rtSessionConn) dropBufferLocked() {
	c.s.rt.budget.give(int64(cap(c.audioIn)))
	c.audioIn = nil
	if c.vad != nil {
		c.vad.reset()
	}
}

// release gives back everything the session holds and drops its
// references, once the session has ended and no response runs.
func (c *rtSessionConn) release() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.dropBufferLocked()
	for _, it := range c.items {
		it.in, it.held = false, 0
	}
	c.s.rt.budget.give(int64(c.itemBytes))
	c.itemBytes, c.items, c.byID, c.vad = 0, nil, nil, nil
}

// MemoryHeld is what the Server's realtime sessions hold now against
// RealtimeConfig.MemoryBudget, in bytes (troupe_realtime_buffered_bytes).
func (s *Server) MemoryHeld() int64 { return s.rt.budget.used.Load() }
