package stats

import (
	"bytes"
	"io"
	"runtime"
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
	return benchLoggerIn(b, n, ReplicaSeriesFull)
}

func benchLoggerIn(b *testing.B, n int, mode ReplicaSeries) (*prometheus.Registry, *Logger) {
	b.Helper()
	reg := prometheus.NewRegistry()
	l, err := New(reg, testModel, Options{Series: mode})
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
//   - gather-text, gather-protobuf: Gather of the Collector and expfmt
//     encoding, as promhttp does: the reference WriteMetrics is held to.
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
	// gatherProto is what a Prometheus with native histograms asks for:
	// every histogram carries its classic and its native buckets.
	gatherProto := func(w io.Writer, reg prometheus.Gatherer, _ *Logger) error {
		mfs, err := reg.Gather()
		if err != nil {
			return err
		}
		enc := expfmt.NewEncoder(w, expfmt.NewFormat(expfmt.TypeProtoDelim))
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
		{"gather-protobuf", gatherProto},
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

// BenchmarkScrapeFleet is one /metrics scrape of 10,000 live replicas,
// alone and with 10,000 detached, unswept replicas next to them
// (DetachedSeriesTTL 0, the default: their series are kept forever), in
// both --replica-series modes: WriteMetrics in text and OpenMetrics, and
// Gather encoded as protobuf (what a Prometheus with native histograms
// asks for). Before each scrape a chunk and a finished request are
// recorded into every live replica, outside the timing (at 10,000
// replicas they cost as much as a third of the scrape); the detached ones
// do not change. It reports ms/scrape (the scrape alone), MB written,
// series per replica (live and detached; the stage aggregates of minimal
// mode included) and the Go heap the Logger holds per replica
// (heap-KB/replica, measured after a GC once the replicas are
// registered); -benchmem's B/op and allocs/op are what one scrape
// allocates.
func BenchmarkScrapeFleet(b *testing.B) {
	const live = 10000
	text := func(f expfmt.Format) func(io.Writer, prometheus.Gatherer, *Logger) (int, error) {
		return func(w io.Writer, _ prometheus.Gatherer, l *Logger) (int, error) {
			cw := w.(*countWriter)
			err := l.WriteMetrics(w, f)
			return cw.lines, err // a line is a series (# lines are per family)
		}
	}
	proto := func(w io.Writer, reg prometheus.Gatherer, _ *Logger) (int, error) {
		mfs, err := reg.Gather()
		if err != nil {
			return 0, err
		}
		enc := expfmt.NewEncoder(w, expfmt.NewFormat(expfmt.TypeProtoDelim))
		series := 0
		for _, mf := range mfs {
			if err := enc.Encode(mf); err != nil {
				return 0, err
			}
			for _, m := range mf.GetMetric() {
				series++
				if h := m.GetHistogram(); h != nil {
					series += len(h.GetBucket()) + 2 // as the text counts them: buckets, _sum, _count
				}
			}
		}
		return series, nil
	}
	for _, mode := range []ReplicaSeries{ReplicaSeriesFull, ReplicaSeriesMinimal} {
		for _, detached := range []int{0, 10000} {
			for _, f := range []struct {
				name   string
				scrape func(io.Writer, prometheus.Gatherer, *Logger) (int, error)
			}{
				{"text", text(expfmt.NewFormat(expfmt.TypeTextPlain))},
				{"openmetrics", text(expfmt.NewFormat(expfmt.TypeOpenMetrics))},
				{"protobuf", proto},
			} {
				name := "series=" + string(mode) + "/live=10000/detached=" + strconv.Itoa(detached) + "/" + f.name
				b.Run(name, func(b *testing.B) { benchScrapeFleet(b, mode, live, detached, f.scrape) })
			}
		}
	}
}

func benchScrapeFleet(b *testing.B, mode ReplicaSeries, live, detached int, scrape func(io.Writer, prometheus.Gatherer, *Logger) (int, error)) {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	reg, l := benchLoggerIn(b, live+detached, mode)
	for i := live; i < live+detached; i++ {
		if err := l.Detach(i); err != nil {
			b.Fatal(err)
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	heapPerReplica := float64(after.HeapAlloc-before.HeapAlloc) / float64(live+detached)
	st := benchStats()
	fin := benchFinished()
	b.ReportAllocs()
	var out countWriter
	var scraping time.Duration
	series := 0
	for b.Loop() {
		b.StopTimer()
		for i := range live {
			if err := l.Record(i, st); err != nil {
				b.Fatal(err)
			}
			if err := l.RecordFinished(i, fin); err != nil {
				b.Fatal(err)
			}
		}
		out = countWriter{}
		start := time.Now()
		b.StartTimer()
		n, err := scrape(&out, reg, l)
		if err != nil {
			b.Fatal(err)
		}
		scraping += time.Since(start)
		series = n
	}
	runtime.KeepAlive(l)
	b.ReportMetric(float64(scraping.Microseconds())/1000/float64(b.N), "ms/scrape")
	b.ReportMetric(float64(out.bytes)/1e6, "MB")
	b.ReportMetric(float64(series)/float64(live+detached), "series/replica")
	b.ReportMetric(heapPerReplica/1024, "heap-KB/replica")
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
