package stats

import (
	"bytes"
	"errors"
	"io"
	"math"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// nativeBuckets decodes a native histogram's positive spans and deltas into
// bucket index -> count, failing on a malformed encoding (a span length
// that does not match the deltas, a negative count).
func nativeBuckets(t *testing.T, h *dto.Histogram) map[int32]uint64 {
	t.Helper()
	out := map[int32]uint64{}
	var idx int32
	var count int64
	d := 0
	for i, s := range h.GetPositiveSpan() {
		if i == 0 {
			idx = s.GetOffset()
		} else {
			require.GreaterOrEqual(t, s.GetOffset(), int32(0), "span offset")
			idx += s.GetOffset()
		}
		require.Positive(t, s.GetLength(), "span length")
		for range s.GetLength() {
			require.Less(t, d, len(h.GetPositiveDelta()), "more span length than deltas")
			count += h.GetPositiveDelta()[d]
			d++
			require.GreaterOrEqual(t, count, int64(0), "bucket count")
			if count > 0 {
				out[idx] = uint64(count)
			}
			idx++
		}
	}
	require.Equal(t, len(h.GetPositiveDelta()), d, "deltas beyond the spans")
	return out
}

// wantIndex is v's schema-0 bucket, computed apart from the code: the
// smallest i with v <= 2^i, clamped to the range.
func wantIndex(v float64, r nativeRange) int32 {
	i := int32(math.Ceil(math.Log2(v)))
	return min(i, r.max)
}

// TestNativeHistogramBuckets records known values and reads, from Gather
// and after a protobuf round trip (what a Prometheus with native histograms
// scrapes), every native bucket of the e2e and prompt-token histograms,
// next to the classic buckets that are still there.
func TestNativeHistogramBuckets(t *testing.T) {
	reg, l := newTestLogger(t, Options{})
	require.NoError(t, l.Register(0, replica(0, 7)))
	e2e := []time.Duration{0, 100 * time.Nanosecond, 3 * time.Microsecond, time.Millisecond, 1500 * time.Microsecond,
		300 * time.Millisecond, 500 * time.Millisecond, 8 * time.Second, 8 * time.Second, 100000 * time.Second}
	prompt := []int{0, 1, 3, 3, 1000, 1 << 25}
	for i, d := range e2e {
		f := Finished{Reason: stagepb.FinishReason_FINISH_REASON_STOP, E2E: d}
		if i < len(prompt) {
			f.PromptTokens = prompt[i]
		}
		require.NoError(t, l.RecordFinished(0, f))
	}

	want := func(values []float64, r nativeRange) (zero uint64, buckets map[int32]uint64) {
		buckets = map[int32]uint64{}
		for _, v := range values {
			if v <= math.Ldexp(1, int(r.min)-1) {
				zero++
				continue
			}
			buckets[wantIndex(v, r)]++
		}
		return zero, buckets
	}
	var e2eSeconds, promptValues []float64
	for _, d := range e2e {
		e2eSeconds = append(e2eSeconds, d.Seconds())
	}
	promptValues = make([]float64, len(e2e)) // the other requests had 0 prompt tokens
	for i, p := range prompt {
		promptValues[i] = float64(p)
	}

	check := func(mfs []*dto.MetricFamily) {
		seen := 0
		for _, mf := range mfs {
			var values []float64
			var r nativeRange
			switch mf.GetName() {
			case "troupe_e2e_request_latency_seconds":
				values, r = e2eSeconds, nativeSeconds
			case "troupe_request_prompt_tokens":
				values, r = promptValues, nativeCounts
			default:
				if mf.GetType() == dto.MetricType_HISTOGRAM {
					for _, m := range mf.GetMetric() {
						require.NotNil(t, m.GetHistogram().Schema, "%s has native buckets", mf.GetName())
					}
				}
				continue
			}
			seen++
			require.Len(t, mf.GetMetric(), 1)
			h := mf.GetMetric()[0].GetHistogram()
			require.Equal(t, int32(0), h.GetSchema())
			require.Equal(t, math.Ldexp(1, int(r.min)-1), h.GetZeroThreshold())
			zero, buckets := want(values, r)
			require.Equal(t, zero, h.GetZeroCount(), "%s zero bucket", mf.GetName())
			require.Equal(t, buckets, nativeBuckets(t, h), "%s native buckets", mf.GetName())
			require.Equal(t, uint64(len(values)), h.GetSampleCount())
			require.NotEmpty(t, h.GetBucket(), "%s keeps its classic buckets", mf.GetName())
			require.Equal(t, uint64(len(values)), h.GetBucket()[len(h.GetBucket())-1].GetCumulativeCount()+
				countAbove(values, h.GetBucket()[len(h.GetBucket())-1].GetUpperBound()), "classic buckets")
		}
		require.Equal(t, 2, seen)
	}

	mfs, err := reg.Gather()
	require.NoError(t, err)
	check(mfs)

	var buf bytes.Buffer
	enc := expfmt.NewEncoder(&buf, expfmt.NewFormat(expfmt.TypeProtoDelim))
	for _, mf := range mfs {
		require.NoError(t, enc.Encode(mf))
	}
	dec := expfmt.NewDecoder(&buf, expfmt.NewFormat(expfmt.TypeProtoDelim))
	var decoded []*dto.MetricFamily
	for {
		mf := &dto.MetricFamily{}
		if err := dec.Decode(mf); errors.Is(err, io.EOF) {
			break
		} else {
			require.NoError(t, err)
		}
		decoded = append(decoded, mf)
	}
	check(decoded)
}

func countAbove(values []float64, bound float64) (n uint64) {
	for _, v := range values {
		if v > bound {
			n++
		}
	}
	return n
}

// TestNativeSlot puts values of each bucket (2^(i-1), 2^i], its bounds and
// their neighbours included, in bucket i, over the whole range.
func TestNativeSlot(t *testing.T) {
	for _, r := range []nativeRange{nativeSeconds, nativeCounts} {
		require.Equal(t, 0, r.slot(0))
		require.Equal(t, 0, r.slot(r.zeroThreshold()))
		require.Equal(t, r.len()-1, r.slot(math.Inf(1)))
		require.Equal(t, r.len()-1, r.slot(math.Ldexp(1, int(r.max)+5)))
		for i := r.min; i <= r.max; i++ {
			top := math.Ldexp(1, int(i))
			for _, v := range []float64{top, math.Nextafter(top, 0), top * 0.75, math.Nextafter(top/2, math.Inf(1))} {
				require.Equal(t, int(i-r.min)+1, r.slot(v), "value %g", v)
			}
		}
	}
}

// TestNativeConsistentUnderRecords gathers while requests are recorded:
// every native histogram's buckets add up to exactly its count (Prometheus
// rejects a native histogram whose buckets do not), no classic bucket is
// above the count, and the count never decreases.
func TestNativeConsistentUnderRecords(t *testing.T) {
	reg, l := newTestLogger(t, Options{})
	const replicas, recorders = 3, 3
	for i := range replicas {
		require.NoError(t, l.Register(i, replica(i%3, uint32(i))))
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range recorders {
		wg.Go(func() {
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				if err := l.RecordFinished((w+n)%replicas, Finished{
					Reason: stagepb.FinishReason_FINISH_REASON_STOP, E2E: time.Duration(n%50) * 100 * time.Millisecond,
					TTFT: time.Duration(n%7) * time.Millisecond, PromptTokens: n % 3000, TraceID: "abc",
				}); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	defer func() { close(stop); wg.Wait() }()

	last := map[string]uint64{}
	for range 30 {
		mfs, err := reg.Gather()
		require.NoError(t, err)
		for _, mf := range mfs {
			for _, m := range mf.GetMetric() {
				h := m.GetHistogram()
				if h == nil {
					continue
				}
				key := mf.GetName() + labelString(m.GetLabel())
				total := h.GetZeroCount()
				for _, c := range nativeBuckets(t, h) {
					total += c
				}
				require.Equal(t, h.GetSampleCount(), total, "%s native total == count", key)
				for _, b := range h.GetBucket() {
					require.LessOrEqual(t, b.GetCumulativeCount(), h.GetSampleCount(), "%s classic bucket <= count", key)
				}
				require.GreaterOrEqual(t, h.GetSampleCount(), last[key], "%s count never decreases", key)
				last[key] = h.GetSampleCount()
			}
		}
	}
}
