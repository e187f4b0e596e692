package stats

import (
	"math"
	"runtime"
	"sort"
	"sync/atomic"
)

// histogram is one replica's classic histogram: a count per bucket (the last
// one is +Inf) and the sum, all atomic, so observe takes no lock and does not
// allocate. The bounds are shared by every replica of the family.
//
// Consistency of a read (snapshot): the buckets are read one after the other
// and the count is their total, so in every read the count equals the +Inf
// bucket and the cumulative buckets never decrease, as with client_golang.
// The sum is read after the buckets; it may include an observation in
// flight whose bucket was read just before it landed, or miss one whose
// bucket was read just after: it is off by at most the observations that
// run concurrently with the read. Between reads no value ever decreases.
type histogram struct {
	bounds []float64       // shared, ascending, +Inf not included
	counts []atomic.Uint64 // len(bounds)+1, not cumulative; last is +Inf
	sum    atomic.Uint64   // float64 bits
	// ex holds the last exemplar of each bucket (TTFT and e2e only; nil
	// for the others), as client_golang keeps one per bucket.
	ex []exemplarSlot
}

// init sets the bounds and makes the buckets, all at 0.
func (h *histogram) init(bounds []float64, exemplars bool) {
	h.bounds = bounds
	h.counts = make([]atomic.Uint64, len(bounds)+1)
	if exemplars {
		h.ex = make([]exemplarSlot, len(bounds)+1)
	}
}

// bucketOf is the index of the first bound >= v (len(bounds) for +Inf).
func (h *histogram) bucketOf(v float64) int {
	return sort.SearchFloat64s(h.bounds, v)
}

// observe adds one sample. Safe for concurrent use; does not allocate.
func (h *histogram) observe(v float64) {
	h.counts[h.bucketOf(v)].Add(1)
	addFloat(&h.sum, v)
}

// observeWithExemplar adds one sample and makes traceID (not empty) with
// the time nowNanos the exemplar of its bucket.
func (h *histogram) observeWithExemplar(v float64, traceID string, nowNanos int64) {
	i := h.bucketOf(v)
	h.counts[i].Add(1)
	addFloat(&h.sum, v)
	if h.ex != nil {
		h.ex[i].store(v, traceID, nowNanos)
	}
}

// read fills counts (len(h.counts), cumulative) and returns the total count
// and the sum; see histogram for the consistency it gives.
func (h *histogram) read(counts []uint64) (count uint64, sum float64) {
	for i := range h.counts {
		count += h.counts[i].Load()
		counts[i] = count
	}
	return count, math.Float64frombits(h.sum.Load())
}

// addFloat adds v to the float64 whose bits a holds.
func addFloat(a *atomic.Uint64, v float64) {
	for {
		old := a.Load()
		if a.CompareAndSwap(old, math.Float64bits(math.Float64frombits(old)+v)) {
			return
		}
	}
}

// exemplarInline is how many bytes of a trace id an exemplarSlot holds
// without allocating: a W3C trace id is 32 hex digits. A longer one (at most
// what ExemplarMaxRunes allows) is stored as one allocated string.
const exemplarInline = 48

// exemplarSlot is one exemplar: a value, a timestamp and a trace id, stored
// with a sequence lock made of atomics only, so neither side takes a lock or
// (for trace ids up to exemplarInline bytes) allocates.
//
// Writers: a store that finds another store in progress drops its exemplar
// (the other one is as recent); Readers retry while a store is in progress,
// and give up (no exemplar in that read) after a bounded number of tries.
type exemplarSlot struct {
	seq    atomic.Uint64 // odd while a store is in progress
	value  atomic.Uint64 // float64 bits
	ts     atomic.Int64  // unix nanoseconds; 0: no exemplar yet
	n      atomic.Uint32 // trace id length in bytes
	inline [exemplarInline / 8]atomic.Uint64
	long   atomic.Pointer[string] // the trace id when longer than exemplarInline
}

func (s *exemplarSlot) store(v float64, traceID string, nowNanos int64) {
	seq := s.seq.Load()
	if seq&1 != 0 || !s.seq.CompareAndSwap(seq, seq+1) {
		return
	}
	s.value.Store(math.Float64bits(v))
	s.ts.Store(nowNanos)
	s.n.Store(uint32(len(traceID)))
	if len(traceID) <= exemplarInline {
		for w := 0; w*8 < len(traceID); w++ {
			var word uint64
			for b := 0; b < 8 && w*8+b < len(traceID); b++ {
				word |= uint64(traceID[w*8+b]) << (8 * b)
			}
			s.inline[w].Store(word)
		}
	} else {
		id := traceID
		s.long.Store(&id)
	}
	s.seq.Store(seq + 2)
}

// exemplarReadTries bounds a reader's retries against concurrent stores.
const exemplarReadTries = 64

// load appends the trace id to dst and returns it with the value and
// timestamp; ok is false when the slot holds no exemplar (or stayed busy).
func (s *exemplarSlot) load(dst []byte) (id []byte, v float64, tsNanos int64, ok bool) {
	for try := 0; try < exemplarReadTries; try++ {
		seq := s.seq.Load()
		if seq&1 != 0 {
			runtime.Gosched()
			continue
		}
		ts := s.ts.Load()
		if ts == 0 {
			return dst, 0, 0, false
		}
		v = math.Float64frombits(s.value.Load())
		n := int(s.n.Load())
		id = dst
		if n <= exemplarInline {
			for w := 0; w*8 < n; w++ {
				word := s.inline[w].Load()
				for b := 0; b < 8 && w*8+b < n; b++ {
					id = append(id, byte(word>>(8*b)))
				}
			}
		} else if p := s.long.Load(); p != nil {
			id = append(id, *p...)
		}
		if s.seq.Load() == seq {
			return id, v, ts, true
		}
	}
	return dst, 0, 0, false
}
