package stats

import (
	"bytes"
	"io"
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

// BenchmarkScrape1000 is one /metrics scrape of 1000 replicas (3 stages,
// K=2, exemplars), with a record and a finished request (with a trace id)
// on every replica before each scrape, so every series changed (the worst
// case; the records are in the timing, and cost ~1% of it):
//
//   - fast-text, fast-openmetrics: WriteMetrics, the /metrics path;
//   - gather-text: Gather of the Collector and expfmt text encoding, as
//     promhttp does; this was the /metrics path before WriteMetrics.
//
// It reports ms/scrape, the bytes of text (text-MB) and the lines per
// replica; -benchmem's B/op is what one scrape allocates.
func BenchmarkScrape1000(b *testing.B) {
	gatherText := func(w io.Writer, reg prometheus.Gatherer, _ *Logger) error {
		mfs, err := reg.Gather()
		if err != nil {
			return err
		}
		enc := expfmt.NewEncoder(w, expfmt.NewFormat(expfmt.TypeTextPlain))
		for _, mf := range mfs {
			if err := enc.Encode(mf); err != nil {
				return err
			}
		}
		return nil
	}
	fast := func(f expfmt.Format) func(io.Writer, prometheus.Gatherer, *Logger) error {
		return func(w io.Writer, _ prometheus.Gatherer, l *Logger) error { return l.WriteMetrics(w, f) }
	}
	for _, c := range []struct {
		name   string
		scrape func(io.Writer, prometheus.Gatherer, *Logger) error
	}{
		{"fast-text", fast(expfmt.NewFormat(expfmt.TypeTextPlain))},
		{"fast-openmetrics", fast(expfmt.NewFormat(expfmt.TypeOpenMetrics))},
		{"gather-text", gatherText},
	} {
		b.Run(c.name, func(b *testing.B) {
			reg, l := benchLogger(b, 1000)
			st := benchStats()
			f := benchFinished()
			b.ReportAllocs()
			var out countWriter
			for b.Loop() {
				for i := range 1000 {
					if err := l.Record(i, st); err != nil {
						b.Fatal(err)
					}
					if err := l.RecordFinished(i, f); err != nil {
						b.Fatal(err)
					}
				}
				out = countWriter{}
				if err := c.scrape(&out, reg, l); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Milliseconds())/float64(b.N), "ms/scrape")
			b.ReportMetric(float64(out.bytes)/1e6, "text-MB")
			b.ReportMetric(float64(out.lines)/1000, "lines/replica")
		})
	}
}

func benchFinished() Finished {
	return Finished{
		Reason: stagepb.FinishReason_FINISH_REASON_STOP, PromptTokens: 100, GenerationTokens: 20,
		TTFT: 40 * time.Millisecond, E2E: 800 * time.Millisecond,
		InterTokenLatencies: []time.Duration{30 * time.Millisecond, 40 * time.Millisecond},
		Queue:               time.Millisecond, Prefill: 30 * time.Millisecond, Decode: 700 * time.Millisecond,
		MaxTokensParam: 256, N: 1,
		TraceID: "4bf92f3577b34da6a3ce929d0e0e4736",
	}
}

// countWriter counts the bytes and lines of one exposition.
type countWriter struct{ bytes, lines int }

func (w *countWriter) Write(p []byte) (int, error) {
	w.bytes += len(p)
	w.lines += bytes.Count(p, []byte{'\n'})
	return len(p), nil
}
