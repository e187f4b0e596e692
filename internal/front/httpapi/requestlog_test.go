package httpapi

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"

	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/telemetry"
)

// benchRequest is a served chat completion as logRequest sees it: a
// routed request whose context holds the server span.
func benchRequest() (*http.Request, *statusWriter) {
	sc := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{0x4b, 0xf9, 0x2f, 0x35, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12},
		SpanID:  trace.SpanID{0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7},
	})
	ctx := trace.ContextWithSpanContext(context.Background(), sc)
	ctx = context.WithValue(ctx, requestIDKey{}, "0123456789abcdef0123456789abcdef")
	r := httptest.NewRequestWithContext(ctx, http.MethodPost, "/v1/chat/completions", nil)
	r.Pattern = "POST /v1/chat/completions"
	r.RemoteAddr = "127.0.0.1:54321"
	return r, &statusWriter{status: http.StatusOK, written: 612}
}

// BenchmarkRequestLog is the request log line of a chat completion through
// the head's logger (telemetry.NewLogger), to io.Discard and to a file (the
// write syscall included).
func BenchmarkRequestLog(b *testing.B) {
	f, err := os.Create(filepath.Join(b.TempDir(), "log"))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = f.Close() })
	for _, out := range []struct {
		name string
		w    io.Writer
	}{{"discard", io.Discard}, {"file", f}} {
		for _, format := range []string{"text", "json"} {
			b.Run(format+"/"+out.name, func(b *testing.B) {
				s := &Server{log: telemetry.NewLogger(out.w, slog.LevelInfo, format == "json")}
				r, sw := benchRequest()
				id, tp := requestIDFrom(r.Context()), telemetry.TraceparentHeader(r.Context())
				b.ReportAllocs()
				for b.Loop() {
					s.logRequest(r, id, tp, sw, 1234567*time.Nanosecond)
				}
			})
		}
	}
}

// TestRequestLogLine: the request's log line is what LogAttrs through the
// trace handler writes (the trace ids added by the handler, last), byte for
// byte, in text and JSON, with a span in the context or none, and its
// source is logRequest's.
func TestRequestLogLine(t *testing.T) {
	noTime := func(_ []string, a slog.Attr) slog.Attr {
		if a.Key == slog.TimeKey {
			return slog.Attr{}
		}
		return a
	}
	for _, json := range []bool{false, true} {
		for _, traced := range []bool{false, true} {
			r, sw := benchRequest()
			if !traced {
				r = r.WithContext(context.WithValue(context.Background(), requestIDKey{}, requestIDFrom(r.Context())))
			}
			id, tp := requestIDFrom(r.Context()), telemetry.TraceparentHeader(r.Context())
			require.Equal(t, traced, tp != "")
			var got, want bytes.Buffer
			logger := func(w io.Writer, source bool) *slog.Logger {
				opts := &slog.HandlerOptions{ReplaceAttr: noTime, AddSource: source}
				if json {
					return slog.New(telemetry.NewLogHandler(slog.NewJSONHandler(w, opts)))
				}
				return slog.New(telemetry.NewLogHandler(slog.NewTextHandler(w, opts)))
			}
			elapsed := 1234567 * time.Nanosecond
			(&Server{log: logger(&got, false)}).logRequest(r, id, tp, sw, elapsed)
			logger(&want, false).LogAttrs(r.Context(), slog.LevelInfo, "httpapi: request",
				slog.String("request_id", id),
				slog.String("method", r.Method),
				slog.String("path", r.URL.Path),
				slog.String("route", r.Pattern),
				slog.Int("status", sw.statusOr200()),
				slog.Int64("bytes", sw.written),
				slog.Duration("duration", elapsed),
				slog.String("remote", r.RemoteAddr),
			)
			assert.Equal(t, want.String(), got.String(), "json %v, traced %v", json, traced)
			if traced {
				assert.Equal(t, 1, strings.Count(got.String(), "4bf92f350102030405060708090a0b0c"), got.String())
				assert.Equal(t, 1, strings.Count(got.String(), "00f067aa0ba902b7"), got.String())
			}

			got.Reset()
			(&Server{log: logger(&got, true)}).logRequest(r, id, tp, sw, elapsed)
			assert.Contains(t, got.String(), "server.go", "the source is logRequest's")
		}
	}

	// Probes log at debug, 5xx at warn; below the level, nothing.
	var buf bytes.Buffer
	s := &Server{log: telemetry.NewLogger(&buf, slog.LevelInfo, false)}
	r, sw := benchRequest()
	r.Pattern = "GET /healthz"
	s.logRequest(r, "id", "", sw, time.Millisecond)
	assert.Empty(t, buf.String())
	// An unready head's 503 to a readiness probe is no warning: `troupe
	// up` polls /readyz before its banner while the replicas join.
	r.Pattern, sw.status = "GET /readyz", http.StatusServiceUnavailable
	s.logRequest(r, "id", "", sw, time.Millisecond)
	assert.Empty(t, buf.String())
	r.Pattern, sw.status = "POST /v1/chat/completions", http.StatusBadGateway
	s.logRequest(r, "id", "", sw, time.Millisecond)
	assert.Contains(t, buf.String(), "level=WARN")
}

// TestRequestLogCarriesTraceIDs: served through the head's logger, the
// request's line names the trace and span of the response's traceparent,
// once each.
func TestRequestLogCarriesTraceIDs(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{Pipeline: textPipeline()})
	var log syncBuffer
	a := startAPI(t, c, Config{Logger: telemetry.NewLogger(&log, slog.LevelInfo, false)}, nil, nil)
	resp, _ := a.post(t, "/v1/chat/completions", `{"model":"troupe-omni-sim","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	tp := resp.Header.Get("Traceparent")
	require.Regexp(t, traceparentRE, tp)
	var line string
	require.Eventually(t, func() bool {
		for l := range strings.Lines(log.String()) {
			if strings.Contains(l, `msg="httpapi: request"`) && strings.Contains(l, "route=\"POST /v1/chat/completions\"") {
				line = l
				return true
			}
		}
		return false
	}, wait, 10*time.Millisecond)
	assert.True(t, strings.HasSuffix(line, " trace_id="+tp[3:35]+" span_id="+tp[36:52]+"\n"), line)
	assert.Equal(t, 1, strings.Count(line, "trace_id="), line)
	assert.Contains(t, line, "request_id="+resp.Header.Get("X-Request-Id"))
}
