package orchestrator_test

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/worker/sim"
)

// BenchmarkStreamingPipeline compares streaming between the stages with
// running them one after the other, in one run: a 3-stage sim pipeline at a
// realistic pace (5 ms decode steps, answers of 64 words), at concurrency 1
// and 16. It reports time to first audio and total latency (p50/p99), and
// the handoff latency per stage boundary (p50/p99, estimated from the
// head's histogram buckets as histogram_quantile does).
//
//	go test -run '^$' -bench StreamingPipeline -benchtime 32x ./orchestrator/
func BenchmarkStreamingPipeline(b *testing.B) {
	pace := sim.Config{DecodeTokenLatency: 5 * time.Millisecond}
	for _, conc := range []int{1, 16} {
		for _, streaming := range []bool{true, false} {
			mode := map[bool]string{true: "streaming", false: "sequential"}[streaming]
			b.Run(fmt.Sprintf("%s/c=%d", mode, conc), func(b *testing.B) {
				c := orchestratortest.Start(b, orchestratortest.Options{Pipeline: omni(streaming, 0), Sim: pace})
				var mu sync.Mutex
				var ttfa, e2e []time.Duration
				var next atomic.Int64
				var failed atomic.Int64
				b.ResetTimer()
				var wg sync.WaitGroup
				for range conc {
					wg.Add(1)
					go func() {
						defer wg.Done()
						for {
							i := next.Add(1)
							if i > int64(b.N) {
								return
							}
							start := time.Now()
							var first time.Duration
							req := orchestrator.Request{ID: fmt.Sprint(i), Prompt: fmt.Sprintf("user %d asks a question", i),
								Sampling: longAnswer(64, i), Stages: 3,
								OnAudio: func([]byte, int) error {
									if first == 0 {
										first = time.Since(start)
									}
									return nil
								}}
							if _, err := c.Head.Execute(context.Background(), req, nil); err != nil {
								failed.Add(1)
								continue
							}
							total := time.Since(start)
							mu.Lock()
							ttfa, e2e = append(ttfa, first), append(e2e, total)
							mu.Unlock()
						}
					}()
				}
				wg.Wait()
				b.StopTimer()
				if n := failed.Load(); n > 0 {
					b.Fatalf("%d requests failed", n)
				}
				b.ReportMetric(pct(ttfa, 0.5), "ttfa-p50-ms")
				b.ReportMetric(pct(ttfa, 0.99), "ttfa-p99-ms")
				b.ReportMetric(pct(e2e, 0.5), "e2e-p50-ms")
				b.ReportMetric(pct(e2e, 0.99), "e2e-p99-ms")
				if streaming {
					for _, from := range []string{"0", "1"} {
						p50, p99 := handoffQuantiles(b, c.Metrics, from)
						b.ReportMetric(p50, "handoff"+from+"-p50-µs")
						b.ReportMetric(p99, "handoff"+from+"-p99-µs")
					}
				}
			})
		}
	}
}

func pct(d []time.Duration, q float64) float64 {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return float64(s[min(len(s)-1, int(q*float64(len(s))))]) / float64(time.Millisecond)
}

// handoffQuantiles estimates p50 and p99 (µs) of the handoff histogram from
// stage from to the next, by linear interpolation in the buckets.
func handoffQuantiles(b *testing.B, g prometheus.Gatherer, from string) (p50, p99 float64) {
	mfs, err := g.Gather()
	if err != nil {
		b.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "troupe_stage_handoff_latency_seconds" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "from_stage" && l.GetValue() == from {
					h := m.GetHistogram()
					return bucketQuantile(h.GetBucket(), h.GetSampleCount(), 0.5) * 1e6, bucketQuantile(h.GetBucket(), h.GetSampleCount(), 0.99) * 1e6
				}
			}
		}
	}
	return math.NaN(), math.NaN()
}

type bucket interface {
	GetUpperBound() float64
	GetCumulativeCount() uint64
}

func bucketQuantile[B bucket](bs []B, total uint64, q float64) float64 {
	if total == 0 {
		return math.NaN()
	}
	sort.Slice(bs, func(i, j int) bool { return bs[i].GetUpperBound() < bs[j].GetUpperBound() })
	rank := q * float64(total)
	lower, prev := 0.0, uint64(0)
	for _, bk := range bs {
		if float64(bk.GetCumulativeCount()) >= rank {
			in := float64(bk.GetCumulativeCount() - prev)
			if in == 0 {
				return bk.GetUpperBound()
			}
			return lower + (bk.GetUpperBound()-lower)*(rank-float64(prev))/in
		}
		lower, prev = bk.GetUpperBound(), bk.GetCumulativeCount()
	}
	return lower
}
