package httpapi

import (
	"bufio"
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/worker/sim"
)

// TestHTTPMetrics: every answer is counted and timed under its route
// pattern, those that never reach a replica included, and a path that
// matches no route never becomes a label value.
func TestHTTPMetrics(t *testing.T) {
	// Only a thinker: text works, audio needs the talker and is 503.
	c := startCluster(t, orchestratortest.Options{ReplicasPerStage: -1, Sim: sim.Config{DecodeTokenLatency: 5 * time.Millisecond}})
	w := c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{})
	c.WaitState(t, "thinker", w.ReplicaID(), "attached")
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg)
	require.NoError(t, err)
	_, err = NewMetrics(reg)
	require.ErrorContains(t, err, "httpapi: register metrics", "registering twice on one registry fails cleanly")

	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()))
	t.Cleanup(func() { require.NoError(t, tp.Shutdown(testCtx(t))) })
	const key = "sekrit"
	a := startAPI(t, c, Config{Metrics: m, Gatherer: reg, APIKey: key, AdminAPIKey: "admin-" + key, MaxBodyBytes: 4096, TracerProvider: tp}, nil, nil)
	auth := http.Header{"Authorization": {"Bearer " + key}}
	adminAuth := http.Header{"Authorization": {"Bearer admin-" + key}} // the API key never wakes a replica
	send := func(method, path, body string, h http.Header) *http.Response {
		t.Helper()
		var r *strings.Reader
		if body != "" {
			r = strings.NewReader(body)
		}
		if r == nil {
			resp, _ := a.do(t, method, path, nil, h)
			return resp
		}
		resp, _ := a.do(t, method, path, r, h)
		return resp
	}
	chat := `{"model":"troupe-omni-sim","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`

	for _, c := range []struct {
		method, path, body string
		header             http.Header
		code               int
	}{
		{"POST", "/v1/chat/completions", chat, auth, 200},
		{"POST", "/v1/chat/completions", chat, auth, 200},
		{"POST", "/v1/chat/completions", `{"model":`, auth, 400},
		{"POST", "/v1/chat/completions", chat, nil, 401},
		{"POST", "/v1/chat/completions", withField(chat, `"modalities":["text","audio"]`), auth, 503},
		{"POST", "/v1/completions", `{"prompt":"` + strings.Repeat("x", 5000) + `"}`, auth, 413},
		{"GET", "/v1/no/such/path/12345", "", auth, 404},
		{"DELETE", "/v1/models", "", auth, 405},
		{"POST", "/v1/replicas/nosuchstage/0/wake_up", "", adminAuth, 404},
		{"GET", "/healthz", "", nil, 200},
	} {
		resp := send(c.method, c.path, c.body, c.header)
		require.Equal(t, c.code, resp.StatusCode, "%s %s", c.method, c.path)
	}

	count := func(route, method, code string) float64 {
		return testutil.ToFloat64(m.requests.WithLabelValues(route, method, code))
	}
	assert.Equal(t, 2.0, count("/v1/chat/completions", "post", "200"))
	assert.Equal(t, 1.0, count("/v1/chat/completions", "post", "400"))
	assert.Equal(t, 1.0, count("/v1/chat/completions", "post", "401"), "refused by the API key check, before routing")
	assert.Equal(t, 1.0, count("/v1/chat/completions", "post", "503"), "no replica for the talker")
	assert.Equal(t, 1.0, count("/v1/completions", "post", "413"))
	assert.Equal(t, 1.0, count(OtherRoute, "get", "404"), "an unknown path counts as other")
	assert.Equal(t, 1.0, count(OtherRoute, "delete", "405"))
	assert.Equal(t, 1.0, count("/v1/replicas/{stage}/{replica}/wake_up", "post", "404"), "the pattern, not the path")
	assert.Equal(t, 1.0, count("/healthz", "get", "200"))

	// No label value comes from a raw path, and every request was timed.
	mfs, err := reg.Gather()
	require.NoError(t, err)
	valid := map[string]bool{OtherRoute: true}
	for _, route := range a.routes {
		valid[route] = true
	}
	var counted, timed uint64
	for _, mf := range mfs {
		for _, mm := range mf.GetMetric() {
			route := labelOf(mm, "route")
			switch mf.GetName() {
			case "troupe_http_requests_total":
				counted += uint64(mm.GetCounter().GetValue())
			case "troupe_http_request_duration_seconds":
				timed += mm.GetHistogram().GetSampleCount()
			default:
				continue
			}
			assert.True(t, valid[route], "route label %q is not a registered pattern", route)
			assert.NotContains(t, route, "nosuch")
			assert.NotContains(t, route, "12345")
		}
	}
	assert.Equal(t, uint64(10), counted)
	assert.Equal(t, uint64(10), timed)

	// A sampled request's trace id is the exemplar of its duration sample.
	resp := send("GET", "/v1/models", "", auth)
	traceID := strings.Split(resp.Header.Get("Traceparent"), "-")[1]
	mf := familyNamed(t, reg, "troupe_http_request_duration_seconds")
	var exemplars []string
	for _, mm := range mf.GetMetric() {
		if labelOf(mm, "route") != "/v1/models" {
			continue
		}
		for _, b := range mm.GetHistogram().GetBucket() {
			if e := b.GetExemplar(); e != nil {
				for _, l := range e.GetLabel() {
					exemplars = append(exemplars, l.GetName()+"="+l.GetValue())
				}
			}
		}
	}
	assert.Equal(t, []string{"trace_id=" + traceID}, exemplars)
}

// TestHTTPInFlight: a stream is in flight until its end.
func TestHTTPInFlight(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{ReplicasPerStage: -1, Sim: sim.Config{DecodeTokenLatency: 20 * time.Millisecond}})
	w := c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{})
	c.WaitState(t, "thinker", w.ReplicaID(), "attached")
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg)
	require.NoError(t, err)
	a := startAPI(t, c, Config{Metrics: m}, nil, nil)
	require.Zero(t, testutil.ToFloat64(m.inFlight))

	req, err := http.NewRequestWithContext(testCtx(t), "POST", a.base+"/v1/chat/completions", strings.NewReader(
		`{"model":"troupe-omni-sim","messages":[{"role":"user","content":"hi"}],"max_tokens":20,"ignore_eos":true,"stream":true}`))
	require.NoError(t, err)
	resp, err := a.client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	require.True(t, sc.Scan(), "the first event")
	assert.Equal(t, 1.0, testutil.ToFloat64(m.inFlight), "the stream is in flight")
	for sc.Scan() {
	}
	require.NoError(t, sc.Err())
	require.Eventually(t, func() bool { return testutil.ToFloat64(m.inFlight) == 0 }, wait, 5*time.Millisecond,
		"in flight back to 0 after the stream")
	assert.Equal(t, 1.0, testutil.ToFloat64(m.requests.WithLabelValues("/v1/chat/completions", "post", "200")))
}

func TestRouteLabel(t *testing.T) {
	for pattern, want := range map[string]string{
		"POST /v1/chat/completions":                 "/v1/chat/completions",
		"GET /v1/models/{model...}":                 "/v1/models/{model...}",
		"/healthz":                                  "/healthz",
		"GET example.com/metrics":                   "/metrics",
		"POST /v1/replicas/{stage}/{replica}/sleep": "/v1/replicas/{stage}/{replica}/sleep",
	} {
		assert.Equal(t, want, routeLabel(pattern), pattern)
	}
}

// familyNamed gathers reg and returns the family called name.
func familyNamed(t *testing.T, reg prometheus.Gatherer, name string) *dto.MetricFamily {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf
		}
	}
	t.Fatalf("no family %s", name)
	return nil
}

// TestClientGoneIs499: a whole-answer request whose client goes away
// before the answer is written is counted as 499, not 200.
func TestClientGoneIs499(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{ReplicasPerStage: -1, Sim: sim.Config{DecodeTokenLatency: 20 * time.Millisecond}})
	w := c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{})
	c.WaitState(t, "thinker", w.ReplicaID(), "attached")
	m, err := NewMetrics(prometheus.NewRegistry())
	require.NoError(t, err)
	a := startAPI(t, c, Config{Metrics: m}, nil, nil)

	ctx, cancel := context.WithCancel(testCtx(t))
	req, err := http.NewRequestWithContext(ctx, "POST", a.base+"/v1/chat/completions", strings.NewReader(
		`{"model":"troupe-omni-sim","messages":[{"role":"user","content":"hi"}],"max_tokens":200,"ignore_eos":true}`))
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() {
		resp, err := a.client.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	require.Eventually(t, func() bool { return testutil.ToFloat64(m.inFlight) == 1 }, wait, time.Millisecond, "the request is in flight")
	cancel()
	require.Error(t, <-done)
	require.Eventually(t, func() bool {
		return testutil.ToFloat64(m.requests.WithLabelValues("/v1/chat/completions", "post", "499")) == 1
	}, wait, 5*time.Millisecond, "counted as 499")
	assert.Zero(t, testutil.ToFloat64(m.requests.WithLabelValues("/v1/chat/completions", "post", "200")))
}
