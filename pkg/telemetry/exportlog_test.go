package telemetry

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/grpc"
)

// syncBuffer is a log destination the exporter goroutine and the test
// share.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) lines() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return strings.Split(strings.TrimSpace(b.buf.String()), "\n")
}

// TestAbsentCollectorIsOneWarning: compose without its tracing profile
// points the exporter at a name nothing answers to. Each flush fails,
// quickly (the export timeout), returns no error to the caller, and only
// the first failure is logged.
func TestAbsentCollectorIsOneWarning(t *testing.T) {
	cleanEnv(t)
	t.Setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "300") // ms, as compose sets 5000
	var logs syncBuffer
	ctx := testCtx(t)
	p, err := Setup(ctx, Config{
		ServiceName: "troupe-head", Endpoint: "http://troupe-no-such-collector.invalid:4317", Protocol: ProtocolGRPC,
		Logger: slog.New(slog.NewTextHandler(&logs, nil)),
	})
	require.NoError(t, err)
	for range 3 {
		emitTree(ctx, p)
		start := time.Now()
		assert.NoError(t, p.ForceFlush(ctx), "a failed export is logged, not returned")
		assert.Less(t, time.Since(start), 10*time.Second)
	}
	emitTree(ctx, p)
	require.NoError(t, p.Shutdown(ctx))
	lines := logs.lines()
	require.Len(t, lines, 1, "one line for four failed exports: %q", lines)
	assert.Contains(t, lines[0], "level=WARN")
	assert.Contains(t, lines[0], "exporting spans failed")
	assert.Contains(t, lines[0], "troupe-no-such-collector.invalid:4317")
	assert.Contains(t, lines[0], "dropped_spans=2")
}

// TestCollectorComingBackIsLogged: a collector that refuses exports, then
// takes them: one warning, then one line saying exports work again with
// what was lost meanwhile, and the later spans arrive.
func TestCollectorComingBackIsLogged(t *testing.T) {
	cleanEnv(t)
	exportRetryInterval = 0 // every flush tries
	t.Cleanup(func() { exportRetryInterval = ExportRetryInterval })
	var down atomic.Bool
	down.Store(true)
	var got atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if down.Load() {
			http.Error(w, "not yet", http.StatusBadRequest) // not retried by the exporter
			return
		}
		got.Add(1)
		w.Header().Set("Content-Type", "application/x-protobuf")
	}))
	defer srv.Close()
	var logs syncBuffer
	ctx := testCtx(t)
	p, err := Setup(ctx, Config{ServiceName: "troupe-worker", Endpoint: srv.URL, Protocol: ProtocolHTTPProtobuf,
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	require.NoError(t, err)
	for range 2 {
		emitTree(ctx, p)
		require.NoError(t, p.ForceFlush(ctx))
	}
	down.Store(false)
	emitTree(ctx, p)
	require.NoError(t, p.Shutdown(ctx))
	assert.Equal(t, int64(1), got.Load(), "the export after the collector came back arrived")
	lines := logs.lines()
	require.Len(t, lines, 2, "%q", lines)
	assert.Contains(t, lines[0], "level=WARN")
	assert.Contains(t, lines[1], "level=INFO")
	assert.Contains(t, lines[1], "exporting spans again")
	assert.Contains(t, lines[1], "failed_exports=2 dropped_spans=4")
}

// failingExporter fails while fail is set.
type failingExporter struct{ fail atomic.Bool }

func (f *failingExporter) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error {
	if f.fail.Load() {
		return errors.New("connection refused")
	}
	return nil
}

func (f *failingExporter) Shutdown(context.Context) error { return nil }

// TestExportFailureReminder: a collector that stays away is logged again
// once every ExportLogInterval, with the failures since the last line.
func TestExportFailureReminder(t *testing.T) {
	inner := &failingExporter{}
	inner.fail.Store(true)
	var logs syncBuffer
	e := newLoggedExporter(inner, slog.New(slog.NewTextHandler(&logs, nil)), "jaeger:4317")
	clock := time.Unix(1700000000, 0)
	e.now = func() time.Time { return clock }
	ctx := context.Background()
	spans := make([]sdktrace.ReadOnlySpan, 3)
	for range 10 { // ten batches within the interval: one line
		require.NoError(t, e.ExportSpans(ctx, spans))
		clock = clock.Add(ExportLogInterval / 20)
	}
	require.Len(t, logs.lines(), 1)
	clock = clock.Add(ExportLogInterval)
	require.NoError(t, e.ExportSpans(ctx, spans))
	lines := logs.lines()
	require.Len(t, lines, 2)
	assert.Contains(t, lines[1], "exporting spans still fails")
	assert.Contains(t, lines[1], "failed_exports=10 dropped_spans=30", "the nine unsaid failures and this one")
	inner.fail.Store(false)
	clock = clock.Add(ExportRetryInterval)
	require.NoError(t, e.ExportSpans(ctx, spans))
	require.NoError(t, e.ExportSpans(ctx, spans))
	lines = logs.lines()
	require.Len(t, lines, 3, "one recovery line, none for later successes")
	assert.Contains(t, lines[2], "failed_exports=11 dropped_spans=33")
}

// TestExportRetryInterval: after a failed export, the batches of the next
// ExportRetryInterval are dropped without an attempt (an absent collector
// costs an attempt per interval, and a stopping process no wait); then one
// is tried again, and its success is logged with everything lost.
func TestExportRetryInterval(t *testing.T) {
	inner := &countingExporter{}
	inner.fail.Store(true)
	var logs syncBuffer
	e := newLoggedExporter(inner, slog.New(slog.NewTextHandler(&logs, nil)), "jaeger:4317")
	clock := time.Unix(1700000000, 0)
	e.now = func() time.Time { return clock }
	ctx := context.Background()
	spans := make([]sdktrace.ReadOnlySpan, 2)
	require.NoError(t, e.ExportSpans(ctx, spans))
	for range 5 {
		clock = clock.Add(ExportRetryInterval / 6)
		require.NoError(t, e.ExportSpans(ctx, spans))
	}
	assert.Equal(t, int64(1), inner.calls.Load(), "within the interval nothing is tried")
	inner.fail.Store(false)
	clock = clock.Add(ExportRetryInterval)
	require.NoError(t, e.ExportSpans(ctx, spans))
	assert.Equal(t, int64(2), inner.calls.Load())
	lines := logs.lines()
	require.Len(t, lines, 2, "%q", lines)
	assert.Contains(t, lines[1], "exporting spans again")
	assert.Contains(t, lines[1], "failed_exports=6 dropped_spans=12", "the dropped batches count")
	require.NoError(t, e.ExportSpans(ctx, spans))
	assert.Equal(t, int64(3), inner.calls.Load(), "working again: every batch is tried")
}

// countingExporter counts its calls and fails while fail is set.
type countingExporter struct {
	failingExporter
	calls atomic.Int64
}

func (c *countingExporter) ExportSpans(ctx context.Context, spans []sdktrace.ReadOnlySpan) error {
	c.calls.Add(1)
	return c.failingExporter.ExportSpans(ctx, spans)
}

// TestCollectorAppearingLaterIsFound: compose's tracing profile turned on
// in a running stack. The exporter has failed for a while against a name
// and port where nothing answers (its connection attempts backing off);
// once a collector listens there, a flush reaches it within seconds and
// the recovery is logged. (The name resolved at each attempt, which a
// collector whose name appears later needs, is measured by
// scripts/e2e-compose.sh's tracing scenario: no name here fails to
// resolve and then resolves.)
func TestCollectorAppearingLaterIsFound(t *testing.T) {
	cleanEnv(t)
	t.Setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "300")
	exportRetryInterval = 0
	t.Cleanup(func() { exportRetryInterval = ExportRetryInterval })
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	_, port, _ := net.SplitHostPort(lis.Addr().String())
	require.NoError(t, lis.Close()) // nothing listens there for now
	var logs syncBuffer
	ctx := testCtx(t)
	p, err := Setup(ctx, Config{ServiceName: "troupe-head", Endpoint: "http://localhost:" + port, Protocol: ProtocolGRPC,
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	require.NoError(t, err)
	defer func() { require.NoError(t, p.Shutdown(ctx)) }()
	failUntil := time.Now().Add(4 * time.Second)
	for time.Now().Before(failUntil) { // the failures that make gRPC back off
		emitTree(ctx, p)
		require.NoError(t, p.ForceFlush(ctx))
	}
	require.Contains(t, logs.lines()[0], "exporting spans failed")

	lis, err = net.Listen("tcp", "127.0.0.1:"+port)
	require.NoError(t, err, "the port was taken meanwhile")
	c := &grpcCollector{addr: lis.Addr().String()}
	srv := grpc.NewServer()
	collectortrace.RegisterTraceServiceServer(srv, c)
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	defer func() { srv.Stop(); <-done }()
	start := time.Now()
	found := func() bool {
		emitTree(ctx, p)
		_ = p.ForceFlush(ctx)
		return len(c.spans()) > 0
	}
	require.Eventually(t, found, 8*time.Second, 100*time.Millisecond, "no span reached the collector that appeared")
	t.Logf("found %v after the collector appeared", time.Since(start).Round(time.Millisecond))
	assert.Contains(t, strings.Join(logs.lines(), "\n"), "exporting spans again")
}
