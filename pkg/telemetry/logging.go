package telemetry

import (
	"context"
	"encoding/hex"
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
	return slog.New(NewLogHandler(formatHandler(w, level, json)))
}

// formatHandler is slog's text or JSON handler on w.
func formatHandler(w io.Writer, level slog.Leveler, json bool) slog.Handler {
	opts := &slog.HandlerOptions{Level: level}
	if json {
		return slog.NewJSONHandler(w, opts)
	}
	return slog.NewTextHandler(w, opts)
}

// NewLogHandler wraps inner so that records logged with a context holding a
// valid span context gain trace_id and span_id attributes (inside any group
// opened by WithGroup, as every record attribute is). A record that already
// has both, last (see TraceLogAttrs), is passed on as it is.
func NewLogHandler(inner slog.Handler) slog.Handler { return traceHandler{inner: inner} }

// TraceLogAttrs returns the trace_id and span_id attributes of traceparent,
// a header value as TraceparentHeader makes it, sharing its storage: a
// caller that has the header at hand adds them as the last two attributes
// of its record, and the handler of NewLogHandler has nothing to add (nor
// to allocate). ok is false, and the attributes empty, when traceparent is
// not a version-00 header value.
func TraceLogAttrs(traceparent string) (traceID, spanID slog.Attr, ok bool) {
	if len(traceparent) != traceparentLen || traceparent[:3] != "00-" || traceparent[35] != '-' || traceparent[52] != '-' {
		return slog.Attr{}, slog.Attr{}, false
	}
	return slog.String(LogKeyTraceID, traceparent[3:35]), slog.String(LogKeySpanID, traceparent[36:52]), true
}

type traceHandler struct {
	inner slog.Handler
	flush func() // nil, or the buffered logger's: called after records at Warn and above
}

func (h traceHandler) Enabled(ctx context.Context, level slog.Level) bool {
	return h.inner.Enabled(ctx, level)
}

func (h traceHandler) Handle(ctx context.Context, r slog.Record) error {
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() && !endsWithTraceIDs(r) {
		// One string holds both ids.
		var b [48]byte
		tid, sid := sc.TraceID(), sc.SpanID()
		hex.Encode(b[:32], tid[:])
		hex.Encode(b[32:], sid[:])
		ids := string(b[:])
		// Clone: a Record copy shares its attribute storage with the original.
		r = r.Clone()
		r.AddAttrs(
			slog.String(LogKeyTraceID, ids[:32]),
			slog.String(LogKeySpanID, ids[32:]),
		)
	}
	err := h.inner.Handle(ctx, r)
	if h.flush != nil && r.Level >= slog.LevelWarn {
		h.flush()
	}
	return err
}

// endsWithTraceIDs reports whether r's last two attributes are trace_id
// and span_id, as TraceLogAttrs makes them.
func endsWithTraceIDs(r slog.Record) bool {
	n := r.NumAttrs()
	if n < 2 {
		return false
	}
	i, ok := 0, false
	r.Attrs(func(a slog.Attr) bool {
		switch i {
		case n - 2:
			ok = a.Key == LogKeyTraceID
		case n - 1:
			ok = ok && a.Key == LogKeySpanID
		}
		i++
		return true
	})
	return ok
}

func (h traceHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return traceHandler{inner: h.inner.WithAttrs(attrs), flush: h.flush}
}

func (h traceHandler) WithGroup(name string) slog.Handler {
	return traceHandler{inner: h.inner.WithGroup(name), flush: h.flush}
}
