package stats

import (
	"math"
	"runtime"
	"sort"
	"sync/atomic"

	dto "github.com/prometheus/client_model/go"
	"google.golang.org/protobuf/proto"
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
	// native is the same samples as a Prometheus native histogram (see
	// nativeRange): zero bucket first, then one count per exponential
	// bucket of the family's range. The native buckets of all of a
	// replica's histograms are one allocation, apart from the classic
	// counts, so the text scrape, which reads only the classic ones, does
	// not walk them.
	native []atomic.Uint64
	nr     nativeRange
}

// init sets the bounds, makes the classic buckets, all at 0, and takes
// native (nr.len() counters at 0) as its native buckets.
func (h *histogram) init(bounds []float64, nr nativeRange, native []atomic.Uint64, exemplars bool) {
	h.bounds = bounds
	h.nr = nr
	h.counts = make([]atomic.Uint64, len(bounds)+1)
	h.native = native
	if exemplars {
		h.ex = make([]exemplarSlot, len(bounds)+1)
	}
}

// nativeSchema is the schema of every native histogram: 0, each bucket twice
// as wide as the one below it, bucket i holding (2^(i-1), 2^i]. That is the
// resolution of the classic 1-2.5-5 buckets, and an index is math.Frexp's
// exponent, with no table and no logarithm.
const nativeSchema = 0

// nativeRange is a family's fixed span of native bucket indices, min..max
// (schema 0). Samples at or below 2^(min-1) (0 included) count in the zero
// bucket, whose threshold is that bound; samples above 2^max count in the
// top bucket (the classic +Inf bucket and the sum still see their value).
// A fixed range keeps observe allocation-free and the memory per replica
// known: 8 bytes per index plus 8 for the zero bucket.
type nativeRange struct{ min, max int32 }

var (
	// nativeSeconds spans 2^-21 s (0.48 µs: the zero threshold) to 2^16 s
	// (18 h): sim stages' microsecond gaps up past vLLM's largest bound
	// (7680 s). 37 buckets.
	nativeSeconds = nativeRange{min: -20, max: 16}
	// nativeCounts spans 0.5 (zero threshold: a count of 0) to 2^24
	// (16.7 M tokens). 25 buckets.
	nativeCounts = nativeRange{min: 0, max: 24}
)

// len is how many counters the range needs: its buckets and the zero bucket.
func (r nativeRange) len() int { return int(r.max-r.min) + 2 }

// zeroThreshold is the upper bound of the zero bucket, 2^(min-1).
func (r nativeRange) zeroThreshold() float64 { return math.Ldexp(1, int(r.min)-1) }

// slot is v's counter in a native slice: 0 for the zero bucket, else 1 plus
// its bucket's offset from min (clamped into the range).
func (r nativeRange) slot(v float64) int {
	if !(v > r.zeroThreshold()) { // 0, negative, NaN
		return 0
	}
	if math.IsInf(v, 1) {
		return r.len() - 1
	}
	frac, exp := math.Frexp(v) // v = frac * 2^exp, frac in [0.5, 1)
	if frac == 0.5 {
		exp-- // 2^k is the top of bucket k
	}
	i := int32(exp)
	if i > r.max {
		i = r.max
	}
	return int(i-r.min) + 1
}

// bucketOf is the index of the first bound >= v (len(bounds) for +Inf).
func (h *histogram) bucketOf(v float64) int {
	return sort.SearchFloat64s(h.bounds, v)
}

// observe adds one sample. Safe for concurrent use; does not allocate.
//
// The native bucket is counted before the classic one, so a read that takes
// the classic buckets first and the native ones after (collectHistogram)
// never sees more classic than native samples.
func (h *histogram) observe(v float64) {
	h.native[h.nr.slot(v)].Add(1)
	h.counts[h.bucketOf(v)].Add(1)
	addFloat(&h.sum, v)
}

// observeWithExemplar adds one sample and makes traceID (not empty) with
// the time nowNanos the exemplar of its bucket.
func (h *histogram) observeWithExemplar(v float64, traceID string, nowNanos int64) {
	h.native[h.nr.slot(v)].Add(1)
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

// readNative returns the native histogram's zero count, its buckets as
// spans and deltas (Prometheus' encoding: a span's offset is the gap since
// the previous span, the first one's is the absolute index of its first
// bucket; each delta is a bucket's count minus the previous bucket's), and
// its total, zero bucket included. Gaps of up to two empty buckets stay
// inside a span, as client_golang does; longer ones start a new span.
func (h *histogram) readNative() (zero uint64, spans []*dto.BucketSpan, deltas []int64, total uint64) {
	zero = h.native[0].Load()
	total = zero
	var prev int64
	last := int32(0)
	for s := 1; s < len(h.native); s++ {
		c := h.native[s].Load()
		if c == 0 {
			continue
		}
		total += c
		idx := h.nr.min + int32(s-1)
		switch gap := idx - last - 1; {
		case len(spans) == 0:
			spans = append(spans, &dto.BucketSpan{Offset: proto.Int32(idx), Length: proto.Uint32(1)})
		case gap <= 2:
			for range gap {
				deltas = append(deltas, -prev)
				prev = 0
			}
			*spans[len(spans)-1].Length += uint32(gap) + 1
		default:
			spans = append(spans, &dto.BucketSpan{Offset: proto.Int32(gap), Length: proto.Uint32(1)})
		}
		deltas = append(deltas, int64(c)-prev)
		prev = int64(c)
		last = idx
	}
	return zero, spans, deltas, total
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
