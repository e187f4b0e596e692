package jaeger_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"

	"github.com/troupe-serving/troupe/internal/front/jaeger"
	"github.com/troupe-serving/troupe/pkg/telemetry"
)

// TestParseOTLPJSONReadsWhatTheExporterWrites sends a troupe-shaped trace
// through telemetry's OTLP http/json exporter and parses the body the
// collector received with the waterfall's parser.
func TestParseOTLPJSONReadsWhatTheExporterWrites(t *testing.T) {
	cleanEnv(t)
	var (
		mu     sync.Mutex
		bodies [][]byte
	)
	col := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		mu.Lock()
		bodies = append(bodies, body)
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte("{}"))
	}))
	defer col.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p, err := telemetry.Setup(ctx, telemetry.Config{ServiceName: "troupe-head", Endpoint: col.URL, Protocol: telemetry.ProtocolHTTPJSON})
	require.NoError(t, err)
	tr := p.Tracer("github.com/troupe-serving/troupe/test")
	rctx, req := tr.Start(ctx, telemetry.SpanRequest)
	_, stage := tr.Start(rctx, telemetry.StageSpanName("thinker"), trace.WithAttributes(telemetry.StageAttributes(0, "thinker", 1, 3, 1)...))
	stage.End()
	req.End()
	require.NoError(t, p.Shutdown(ctx))

	mu.Lock()
	defer mu.Unlock()
	require.Len(t, bodies, 1)
	got, err := jaeger.ParseOTLPJSON(bodies[0])
	require.NoError(t, err)
	assert.Equal(t, req.SpanContext().TraceID().String(), got.TraceID)
	names := map[string]jaeger.Span{}
	for _, s := range got.Spans {
		names[s.Name] = s
	}
	require.Contains(t, names, telemetry.SpanRequest)
	require.Contains(t, names, "troupe.stage thinker")
	assert.Equal(t, "troupe-head", names[telemetry.SpanRequest].Service)
	assert.Equal(t, names[telemetry.SpanRequest].SpanID, names["troupe.stage thinker"].ParentSpanID)
	assert.Equal(t, "1", names["troupe.stage thinker"].Attributes["troupe.replica.id"])
}

// cleanEnv clears the OTel variables that would redirect or disable export.
func cleanEnv(t *testing.T) {
	t.Helper()
	for _, k := range []string{
		"OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES",
		"OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG",
		"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
		"OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
	} {
		t.Setenv(k, "")
	}
}
