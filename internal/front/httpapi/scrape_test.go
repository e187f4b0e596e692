package httpapi

import (
	"bytes"
	"compress/gzip"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"
	prommodel "github.com/prometheus/common/model"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/internal/core/stats"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// scrapeSetup is a stats logger on its own registry (the Exposer) and a
// registry with one other family (the Gatherer), as troupe head wires them.
func scrapeSetup(t *testing.T) (*prometheus.Registry, *prometheus.Registry, *stats.Logger) {
	t.Helper()
	statsReg, reg := prometheus.NewRegistry(), prometheus.NewRegistry()
	l, err := stats.New(statsReg, "m", stats.Options{StageNames: []string{"thinker"}})
	require.NoError(t, err)
	require.NoError(t, l.Register(0, stats.Replica{Stage: 0, StageName: "thinker", ReplicaID: 7}))
	require.NoError(t, l.RecordFinished(0, stats.Finished{
		Reason: stagepb.FinishReason_FINISH_REASON_STOP, TTFT: 20 * time.Millisecond, E2E: time.Second,
		TraceID: "4bf92f3577b34da6a3ce929d0e0e4736",
	}))
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: "troupe_head_thing_total", Help: "A head-level family."})
	c.Add(3)
	reg.MustRegister(c)
	return reg, statsReg, l
}

// logRecorder collects the handler's log records.
type logRecorder struct{ buf bytes.Buffer }

func (r *logRecorder) logger() *slog.Logger { return slog.New(slog.NewTextHandler(&r.buf, nil)) }

func scrapeOnce(t *testing.T, h http.Handler, header http.Header) (*http.Response, string) {
	t.Helper()
	req := httptest.NewRequestWithContext(t.Context(), http.MethodGet, "/metrics", nil)
	for k, v := range header {
		req.Header[k] = v
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	resp := rec.Result()
	body := rec.Body.Bytes()
	if resp.Header.Get("Content-Encoding") == "gzip" {
		zr, err := gzip.NewReader(bytes.NewReader(body))
		require.NoError(t, err)
		body, err = io.ReadAll(zr)
		require.NoError(t, err)
	}
	return resp, string(body)
}

// TestMetricsHandlerFormats: /metrics serves the gathered families and the
// Exposer's, once each, in the text format by default (also to a scraper
// that asks only for protobuf) and in OpenMetrics with exemplars and one
// final # EOF when asked; gzipped when accepted.
func TestMetricsHandlerFormats(t *testing.T) {
	reg, statsReg, l := scrapeSetup(t)
	var logs logRecorder
	h := metricsHandler(reg, l, nil, logs.logger())

	for _, accept := range []string{"", "text/plain;version=0.0.4", "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited"} {
		resp, body := scrapeOnce(t, h, http.Header{"Accept": {accept}})
		require.Equal(t, http.StatusOK, resp.StatusCode)
		require.True(t, strings.HasPrefix(resp.Header.Get("Content-Type"), "text/plain; version=0.0.4"), resp.Header.Get("Content-Type"))
		p := expfmt.NewTextParser(prommodel.UTF8Validation)
		mfs, err := p.TextToMetricFamilies(strings.NewReader(body))
		require.NoError(t, err, accept)
		require.Contains(t, mfs, "troupe_head_thing_total")
		require.Contains(t, mfs, "troupe_time_to_first_token_seconds")
		want, err := statsReg.Gather()
		require.NoError(t, err)
		require.Len(t, mfs, len(want)+1, "every stats family and the head's")
		require.NotContains(t, body, "# EOF")
	}

	// What Prometheus 3 sends.
	const promAccept = "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
	for _, enc := range []string{"", "gzip"} {
		resp, body := scrapeOnce(t, h, http.Header{"Accept": {promAccept}, "Accept-Encoding": {enc}})
		require.Equal(t, http.StatusOK, resp.StatusCode)
		require.True(t, strings.HasPrefix(resp.Header.Get("Content-Type"), "application/openmetrics-text; version=1.0.0"), resp.Header.Get("Content-Type"))
		assert.Equal(t, enc, resp.Header.Get("Content-Encoding"))
		require.True(t, strings.HasSuffix(body, "\n# EOF\n"))
		require.Equal(t, 1, strings.Count(body, "# EOF"))
		require.Contains(t, body, "# TYPE troupe_head_thing counter\ntroupe_head_thing_total 3.0\n")
		require.Contains(t, body, `# {trace_id="4bf92f3577b34da6a3ce929d0e0e4736"} 0.02 `)
	}
	require.Empty(t, logs.buf.String())
}

// TestMetricsHandlerNoDuplicates: a Gatherer that also holds the Exposer's
// families (a wiring bug) still gives an exposition with every family once;
// the bug is logged.
func TestMetricsHandlerNoDuplicates(t *testing.T) {
	_, statsReg, l := scrapeSetup(t)
	var logs logRecorder
	h := metricsHandler(statsReg, l, nil, logs.logger())
	for _, accept := range []string{"", "application/openmetrics-text;version=1.0.0"} {
		_, body := scrapeOnce(t, h, http.Header{"Accept": {accept}})
		for _, name := range l.MetricFamilyNames() {
			n := strings.Count(body, "# TYPE "+name+" ")
			if short := strings.TrimSuffix(name, "_total"); short != name {
				n += strings.Count(body, "# TYPE "+short+" ") // OpenMetrics counters
			}
			assert.LessOrEqual(t, n, 1, "%s in %q", name, accept) // spec families: none at K=0
		}
		require.Equal(t, 1, strings.Count(body, "# TYPE troupe_time_to_first_token_seconds "))
	}
	require.Contains(t, logs.buf.String(), "family is both gathered and written by the exposer")
}

func TestAcceptsGzip(t *testing.T) {
	for v, want := range map[string]bool{
		"": false, "gzip": true, "deflate, gzip;q=1.0, *;q=0.5": true, "GZIP": true,
		"gzip;q=0": false, "gzip; q=0.000": false, "br": false, "x-gzip": false,
	} {
		assert.Equal(t, want, acceptsGzip(http.Header{"Accept-Encoding": {v}}), v)
	}
}

// BenchmarkMetricsHandler1000 is one /metrics answer for 1,000 replicas
// through the real handler, as Prometheus asks for it (OpenMetrics, gzip)
// and as a plain text scraper does, with a record and a finished request
// into every replica before each scrape. B/op is what one answer allocates.
func BenchmarkMetricsHandler1000(b *testing.B) {
	for _, c := range []struct {
		name   string
		header http.Header
	}{
		{"openmetrics-gzip", http.Header{"Accept": {"application/openmetrics-text;version=1.0.0"}, "Accept-Encoding": {"gzip"}}},
		{"text", http.Header{"Accept": {"text/plain;version=0.0.4"}}},
	} {
		b.Run(c.name, func(b *testing.B) {
			statsReg, reg := prometheus.NewRegistry(), prometheus.NewRegistry()
			l, err := stats.New(statsReg, "troupe-omni-sim", stats.Options{StageNames: []string{"thinker", "talker", "vocoder"}})
			require.NoError(b, err)
			for i := range 1000 {
				require.NoError(b, l.Register(i, stats.Replica{
					Stage: i % 3, StageName: []string{"thinker", "talker", "vocoder"}[i%3], ReplicaID: uint32(i), NumSpeculativeTokens: 2,
					Cache: &stagepb.CacheConfig{BlockSize: 16, NumKvBlocks: 4096, EnablePrefixCaching: true, MaxNumSeqs: 256},
				}))
			}
			h := metricsHandler(reg, l, nil, slog.New(slog.DiscardHandler))
			req := httptest.NewRequest(http.MethodGet, "/metrics", nil)
			req.Header = c.header
			st := &stagepb.EngineStats{PromptTokens: 12, GenerationTokens: 1, IterationTokens: []uint32{13}, NumRequestsRunning: 3}
			f := stats.Finished{Reason: stagepb.FinishReason_FINISH_REASON_STOP, TTFT: 40 * time.Millisecond, E2E: time.Second,
				PromptTokens: 100, GenerationTokens: 20, TraceID: "4bf92f3577b34da6a3ce929d0e0e4736"}
			w := &discardResponse{header: http.Header{}}
			b.ReportAllocs()
			for b.Loop() {
				for i := range 1000 {
					_ = l.Record(i, st)
					_ = l.RecordFinished(i, f)
				}
				w.n = 0
				clear(w.header)
				h.ServeHTTP(w, req)
			}
			b.ReportMetric(float64(b.Elapsed().Milliseconds())/float64(b.N), "ms/scrape")
			b.ReportMetric(float64(w.n)/1e6, "sent-MB")
		})
	}
}

// discardResponse is an http.ResponseWriter that counts and drops the body.
type discardResponse struct {
	header http.Header
	n      int
}

func (w *discardResponse) Header() http.Header         { return w.header }
func (w *discardResponse) WriteHeader(int)             {}
func (w *discardResponse) Write(p []byte) (int, error) { w.n += len(p); return len(p), nil }
