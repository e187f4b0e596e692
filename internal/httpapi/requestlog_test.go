package httpapi

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"go.opentelemetry.io/otel/trace"

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
				id := requestIDFrom(r.Context())
				b.ReportAllocs()
				for b.Loop() {
					s.logRequest(r, id, sw, 1234567*time.Nanosecond)
				}
			})
		}
	}
}
