package telemetry

import (
	"context"
	"io"
	"log/slog"

	"go.opentelemetry.io/otel/trace"
)

// Log attribute keys added by the handler of NewLogHandler.
const (
	LogKeyTraceID = "trace_id"
	LogKeySpanID  = "span_id"
)

// NewLogger returns a logger writing text (or JSON) records at level and
// above to w, each stamped with trace_id and span_id when the context passed
// to the logging call (InfoContext, ...) holds a valid span context, sampled
// or not, so log lines and traceparent headers can be matched.
func NewLogger(w io.Writer, level slog.Leveler, json bool) *slog.Logger {
	opts := &slog.HandlerOptions{Level: level}
	var h slog.Handler
	if json {
		h = slog.NewJSONHandler(w, opts)
	} else {
		h = slog.NewTextHandler(w, opts)
	}
	return slog.New(NewLogHandler(h))
}

// NewLogHandler wraps inner so that records logged with a context holding a
// valid span context gain trace_id and span_id attributes (inside any group
// opened by WithGroup, as every record attribute is).
func NewLogHandler(inner slog.Handler) slog.Handler { return traceHandler{inner: inner} }

type traceHandler struct{ inner slog.Handler }

func (h traceHandler) Enabled(ctx context.Context, level slog.Level) bool {
	return h.inner.Enabled(ctx, level)
}

func (h traceHandler) Handle(ctx context.Context, r slog.Record) error {
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		// Clone: a Record copy shares its attribute storage with the original.
		r = r.Clone()
		r.AddAttrs(
			slog.String(LogKeyTraceID, sc.TraceID().String()),
			slog.String(LogKeySpanID, sc.SpanID().String()),
		)
	}
	return h.inner.Handle(ctx, r)
}

func (h traceHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return traceHandler{inner: h.inner.WithAttrs(attrs)}
}

func (h traceHandler) WithGroup(name string) slog.Handler {
	return traceHandler{inner: h.inner.WithGroup(name)}
}
