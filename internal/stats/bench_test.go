package stats

import (
	"bytes"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// benchLogger returns a logger with n replicas registered at indices 0..n-1,
// spread over three stages, K=2, with a cache config.
func benchLogger(b *testing.B, n int) (*prometheus.Registry, *Logger) {
	b.Helper()
	reg := prometheus.NewRegistry()
	l, err := New(reg, testModel, Options{})
	if err != nil {
		b.Fatal(err)
	}
	for i := range n {
		if err := l.Register(i, benchReplica(i)); err != nil {
			b.Fatal(err)
		}
	}
	return reg, l
}

func benchReplica(i int) Replica {
	r := replica(i%3, uint32(i))
	r.NumSpeculativeTokens = 2
	r.Cache = &stagepb.CacheConfig{BlockSize: 16, NumKvBlocks: 4096, EnablePrefixCaching: true, MaxNumSeqs: 256}
	return r
}

// BenchmarkRegister measures one join with n replicas already registered;
// the cost must not grow with n.
func BenchmarkRegister(b *testing.B) {
	for _, n := range []int{1, 100, 1000, 10000} {
		b.Run("existing="+strconv.Itoa(n), func(b *testing.B) {
			_, l := benchLogger(b, n)
			b.ReportAllocs()
			for i := n; b.Loop(); i++ {
				if err := l.Register(i, benchReplica(i)); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkRecord is the hot path: one chunk's stats for a known replica.
func BenchmarkRecord(b *testing.B) {
	_, l := benchLogger(b, 1000)
	st := benchStats()
	b.ReportAllocs()
	for b.Loop() {
		if err := l.Record(500, st); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkRecordParallel records from all procs, each on its own replica.
func BenchmarkRecordParallel(b *testing.B) {
	_, l := benchLogger(b, 1000)
	st := benchStats()
	var next atomic.Int64
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		idx := int(next.Add(37) % 1000)
		for pb.Next() {
			if err := l.Record(idx, st); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

// BenchmarkRecordFinished is once per request and replica.
func BenchmarkRecordFinished(b *testing.B) {
	_, l := benchLogger(b, 1000)
	f := Finished{
		Reason: stagepb.FinishReason_FINISH_REASON_STOP, PromptTokens: 100, GenerationTokens: 20,
		TTFT: 40 * time.Millisecond, E2E: 800 * time.Millisecond,
		InterTokenLatencies: []time.Duration{30 * time.Millisecond, 40 * time.Millisecond},
		Queue:               time.Millisecond, Prefill: 30 * time.Millisecond, Decode: 700 * time.Millisecond,
		TraceID: "4bf92f3577b34da6a3ce929d0e0e4736",
	}
	b.ReportAllocs()
	for b.Loop() {
		if err := l.RecordFinished(500, f); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkScrape1000 is one /metrics scrape of 1000 replicas: Gather and
// text encoding, as promhttp does.
func BenchmarkScrape1000(b *testing.B) {
	reg, l := benchLogger(b, 1000)
	st := benchStats()
	for i := range 1000 {
		if err := l.Record(i, st); err != nil {
			b.Fatal(err)
		}
	}
	format := expfmt.NewFormat(expfmt.TypeTextPlain)
	b.ReportAllocs()
	var out countWriter
	for b.Loop() {
		out = countWriter{}
		mfs, err := reg.Gather()
		if err != nil {
			b.Fatal(err)
		}
		enc := expfmt.NewEncoder(&out, format)
		for _, mf := range mfs {
			if err := enc.Encode(mf); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.ReportMetric(float64(out.bytes)/1e6, "text-MB")
	b.ReportMetric(float64(out.lines)/1000, "lines/replica")
}

// countWriter counts the bytes and lines of one exposition.
type countWriter struct{ bytes, lines int }

func (w *countWriter) Write(p []byte) (int, error) {
	w.bytes += len(p)
	w.lines += bytes.Count(p, []byte{'\n'})
	return len(p), nil
}
