package telemetry

import (
	"context"
	"log/slog"
	"sync"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// ExportLogInterval is how often a collector that keeps failing is logged
// again, with the count of failed exports since the last line.
const ExportLogInterval = 10 * time.Minute

// ExportRetryInterval is how long after a failed export the next batches
// are dropped without trying: a collector that is absent costs one attempt
// (up to the export timeout) per interval, not one per batch, and a
// process that stops meanwhile does not wait for it to flush.
const ExportRetryInterval = 15 * time.Second

// exportRetryInterval is ExportRetryInterval; tests shorten it.
var exportRetryInterval = ExportRetryInterval

// loggedExporter wraps the OTLP exporter so that a collector that is down
// or absent (compose without its tracing profile, a Jaeger restarting) is
// one warning, a reminder at most every ExportLogInterval, and one line
// when exports succeed again, instead of a line per batch. A failed batch
// is dropped, as the batch span processor drops it anyway; the error is
// logged here and not returned, so the SDK's global error handler (which
// prints every error to stderr) never sees it. After a failure, batches
// are dropped without an attempt for ExportRetryInterval.
type loggedExporter struct {
	sdktrace.SpanExporter
	log      *slog.Logger
	endpoint string
	every    time.Duration
	retry    time.Duration
	now      func() time.Time

	mu      sync.Mutex
	failing bool
	outage  [2]int    // failed exports and their spans since the collector last answered
	unsaid  [2]int    // the same since the last line logged
	logged  time.Time // when the last failure line was written
	failed  time.Time // when the last attempt failed
}

func newLoggedExporter(exp sdktrace.SpanExporter, log *slog.Logger, endpoint string) *loggedExporter {
	if log == nil {
		log = slog.Default()
	}
	return &loggedExporter{SpanExporter: exp, log: log, endpoint: endpoint, every: ExportLogInterval, retry: exportRetryInterval, now: time.Now}
}

func (e *loggedExporter) ExportSpans(ctx context.Context, spans []sdktrace.ReadOnlySpan) error {
	e.mu.Lock()
	if e.failing && e.now().Sub(e.failed) < e.retry {
		e.outage[0]++
		e.outage[1] += len(spans)
		e.unsaid[0]++
		e.unsaid[1] += len(spans)
		e.mu.Unlock()
		return nil // dropped without an attempt
	}
	e.mu.Unlock()
	err := e.SpanExporter.ExportSpans(ctx, spans)
	e.mu.Lock()
	defer e.mu.Unlock()
	if err == nil {
		if e.failing {
			e.log.Info("telemetry: exporting spans again", "endpoint", e.endpoint,
				"failed_exports", e.outage[0], "dropped_spans", e.outage[1])
			e.failing, e.outage, e.unsaid = false, [2]int{}, [2]int{}
		}
		return nil
	}
	e.outage[0]++
	e.outage[1] += len(spans)
	e.unsaid[0]++
	e.unsaid[1] += len(spans)
	now := e.now()
	e.failed = now
	if !e.failing || now.Sub(e.logged) >= e.every {
		msg := "telemetry: exporting spans failed; spans are dropped until the collector answers"
		if e.failing {
			msg = "telemetry: exporting spans still fails"
		}
		e.log.Warn(msg, "endpoint", e.endpoint, "failed_exports", e.unsaid[0], "dropped_spans", e.unsaid[1], "err", err)
		e.failing, e.unsaid, e.logged = true, [2]int{}, now
	}
	return nil
}
