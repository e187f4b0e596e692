package orchestrator_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"google.golang.org/grpc"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
)

// discardExporter drops spans after the SDK did all its work on them, so
// the benchmark measures what tracing costs the request path, not a
// collector's network.
type discardExporter struct{ spans atomic.Int64 }

func (d *discardExporter) ExportSpans(_ context.Context, s []sdktrace.ReadOnlySpan) error {
	d.spans.Add(int64(len(s)))
	return nil
}
func (d *discardExporter) Shutdown(context.Context) error { return nil }

// BenchmarkTracing compares head throughput with tracing off (a provider
// that never samples: what troupe runs without an endpoint), sampling 1.0
// and sampling 0.01, all in one run so the ratios are comparable. One
// thinker stage, sim at zero delay, 8 concurrent clients.
func BenchmarkTracing(b *testing.B) {
	for _, mode := range []struct {
		name    string
		sampler sdktrace.Sampler
	}{
		{"off", sdktrace.NeverSample()},
		{"ratio=1.0", sdktrace.ParentBased(sdktrace.TraceIDRatioBased(1.0))},
		{"ratio=0.01", sdktrace.ParentBased(sdktrace.TraceIDRatioBased(0.01))},
	} {
		b.Run(mode.name, func(b *testing.B) {
			exp := &discardExporter{}
			headTP := sdktrace.NewTracerProvider(sdktrace.WithSampler(mode.sampler), sdktrace.WithBatcher(exp))
			workerTP := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.NeverSample())), sdktrace.WithBatcher(exp))
			defer headTP.Shutdown(context.Background())
			defer workerTP.Shutdown(context.Background())
			prop := propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
			c := orchestratortest.Start(b, orchestratortest.Options{
				Pipeline:            thinkerOnly,
				HeadTracer:          headTP,
				HeadDialOptions:     []grpc.DialOption{grpc.WithStatsHandler(otelgrpc.NewClientHandler(otelgrpc.WithTracerProvider(headTP), otelgrpc.WithPropagators(prop)))},
				WorkerServerOptions: []grpc.ServerOption{grpc.StatsHandler(otelgrpc.NewServerHandler(otelgrpc.WithTracerProvider(workerTP), otelgrpc.WithPropagators(prop)))},
			})
			runLoad(b, c, 8, 1)
		})
	}
}

// runLoad sends b.N requests from conc clients and reports req/s and
// latency percentiles.
func runLoad(b *testing.B, c *orchestratortest.Cluster, conc, stages int) {
	ctx := context.Background()
	var mu sync.Mutex
	lat := make([]time.Duration, 0, b.N)
	var next atomic.Int64
	var failed atomic.Int64
	b.ResetTimer()
	start := time.Now()
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
				t0 := time.Now()
				_, err := c.Head.Execute(ctx, orchestrator.Request{ID: fmt.Sprint(i), Prompt: fmt.Sprintf("benchmark prompt %d", i%64), Sampling: sampling(16, i%7), Stages: stages}, nil)
				d := time.Since(t0)
				if err != nil {
					failed.Add(1)
					continue
				}
				mu.Lock()
				lat = append(lat, d)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	b.StopTimer()
	if failed.Load() > 0 {
		b.Fatalf("%d requests failed", failed.Load())
	}
	slices.Sort(lat)
	pct := func(p float64) float64 {
		if len(lat) == 0 {
			return 0
		}
		return float64(lat[min(len(lat)-1, int(p*float64(len(lat))))].Microseconds()) / 1000
	}
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "req/s")
	b.ReportMetric(pct(0.50), "p50-ms")
	b.ReportMetric(pct(0.99), "p99-ms")
}
