package oip_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/pkg/oippb"
	"github.com/troupe-serving/troupe/worker/oip"
)

// tritonMetrics serves Triton-format metrics over loopback HTTP: the
// pending count the test sets for model m (and another model's, which
// must not count), or a failure. Each setting is a generation; the test
// waits for scrapes of the current one.
type tritonMetrics struct {
	mu      sync.Mutex
	pending int  // m's pending count
	fail    bool // answer 503
	gen     int  // bumped at every setting
	hits    int  // scrapes answered in this generation
	notify  chan struct{}
}

func (tm *tritonMetrics) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	tm.mu.Lock()
	pending, fail := tm.pending, tm.fail
	tm.hits++
	tm.mu.Unlock()
	defer func() {
		select {
		case tm.notify <- struct{}{}:
		default:
		}
	}()
	if fail {
		http.Error(w, "metrics down", http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Type", "text/plain; version=0.0.4")
	fmt.Fprintf(w, `# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="m",version="1"} 42
nv_inference_request_success{model="other",version="1"} 7
# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution per-model.
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="m",version="1"} %d
nv_inference_pending_request_count{model="other",version="1"} 100
# HELP nv_gpu_utilization GPU utilization rate [0.0 - 1.0)
# TYPE nv_gpu_utilization gauge
nv_gpu_utilization{gpu_uuid="GPU-0"} 0.5
`, pending)
}

// set changes what the endpoint answers and waits until the engine has
// stored a scrape of it: Run scrapes one at a time, so once a second
// scrape of the new setting arrives, the first one's result is stored.
func (tm *tritonMetrics) set(t *testing.T, pending int, fail bool) {
	t.Helper()
	tm.mu.Lock()
	tm.pending, tm.fail = pending, fail
	tm.gen++
	tm.hits = 0
	tm.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	for {
		tm.mu.Lock()
		n := tm.hits
		tm.mu.Unlock()
		if n >= 2 {
			return
		}
		select {
		case <-tm.notify:
		case <-ctx.Done():
			t.Fatalf("the engine did not scrape pending=%d fail=%v twice", pending, fail)
		}
	}
}

// TestUpstreamMetrics: with MetricsURL the load follows Triton's pending
// count of the model (other models' do not count) as waiting, and the
// requests this worker has in flight beyond it as running; a scrape that
// fails, many times in a row, keeps the engine available and falls back
// to the in-flight count, and the next good one is followed again.
func TestUpstreamMetrics(t *testing.T) {
	tm := &tritonMetrics{notify: make(chan struct{}, 1)}
	srv := httptest.NewServer(tm)
	t.Cleanup(srv.Close)

	release := make(chan struct{})
	started := make(chan struct{}, 2)
	te := &testEngine{meta: textModel(), infer: func(ctx context.Context, req *oippb.ModelInferRequest, send func(*oippb.ModelStreamInferResponse) error) error {
		started <- struct{}{}
		select {
		case <-release:
		case <-ctx.Done():
			return ctx.Err()
		}
		return echoWords("stop")(ctx, req, send)
	}}
	e, _ := runEngine(t, oip.Config{Upstream: serve(t, "tcp", te), MetricsURL: srv.URL + "/metrics",
		HealthInterval: 10 * time.Millisecond, HealthFailures: 2})
	waitAvailable(t, e, true)

	tm.set(t, 3, false)
	g := e.Health().GetGauges()
	assert.EqualValues(t, 0, g.GetNumRequestsRunning())
	assert.EqualValues(t, 3, g.GetNumRequestsWaitingCapacity(), "the model's pending count, not the other model's")
	assert.Less(t, g.GetGaugesAgeMs(), uint32(wait.Milliseconds()), "dated by the scrape")

	tm.set(t, 7, false)
	assert.EqualValues(t, 7, e.Health().GetGauges().GetNumRequestsWaitingCapacity())

	// Two requests in flight, the engine's queue empty: both running.
	ctx := testCtx(t)
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := collect(ctx, e, textReq("a b"))
			errs <- err
		}()
	}
	for range 2 {
		select {
		case <-started:
		case <-ctx.Done():
			t.Fatal("the requests never reached the engine")
		}
	}
	tm.set(t, 0, false)
	g = e.Health().GetGauges()
	assert.EqualValues(t, 2, g.GetNumRequestsRunning())
	assert.EqualValues(t, 0, g.GetNumRequestsWaitingCapacity())
	// One of them queued at the engine: counted once, as waiting.
	tm.set(t, 1, false)
	g = e.Health().GetGauges()
	assert.EqualValues(t, 1, g.GetNumRequestsRunning())
	assert.EqualValues(t, 1, g.GetNumRequestsWaitingCapacity())

	// The metrics fail: still available after more failed scrapes than
	// HealthFailures, the load what this worker has in flight, measured now.
	tm.set(t, 5, true)
	tm.set(t, 5, true)
	ok, _ := e.Available()
	assert.True(t, ok, "a failed scrape does not take the engine out of rotation")
	g = e.Health().GetGauges()
	assert.EqualValues(t, 2, g.GetNumRequestsRunning())
	assert.EqualValues(t, 0, g.GetNumRequestsWaitingCapacity())
	assert.EqualValues(t, 0, g.GetGaugesAgeMs())

	close(release)
	wg.Wait()
	for range 2 {
		require.NoError(t, <-errs)
	}
	tm.set(t, 4, false)
	g = e.Health().GetGauges()
	assert.EqualValues(t, 0, g.GetNumRequestsRunning())
	assert.EqualValues(t, 4, g.GetNumRequestsWaitingCapacity(), "followed again once the scrape answers")
}

// TestUpstreamMetricsNoSeries: metrics without the model's pending count
// (an older Triton, another model) leave the load to the in-flight count.
func TestUpstreamMetricsNoSeries(t *testing.T) {
	var mu sync.Mutex
	hits := 0
	notify := make(chan struct{}, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		mu.Lock()
		hits++
		mu.Unlock()
		defer func() {
			select {
			case notify <- struct{}{}:
			default:
			}
		}()
		fmt.Fprint(w, "# TYPE nv_inference_pending_request_count gauge\nnv_inference_pending_request_count{model=\"other\",version=\"1\"} 9\n")
	}))
	t.Cleanup(srv.Close)
	te := &testEngine{meta: textModel(), infer: echoWords("")}
	e, _ := runEngine(t, oip.Config{Upstream: serve(t, "tcp", te), MetricsURL: srv.URL, HealthInterval: 10 * time.Millisecond})
	waitAvailable(t, e, true)
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	for {
		mu.Lock()
		n := hits
		mu.Unlock()
		if n >= 2 {
			break
		}
		select {
		case <-notify:
		case <-ctx.Done():
			t.Fatal("never scraped")
		}
	}
	g := e.Health().GetGauges()
	assert.EqualValues(t, 0, g.GetNumRequestsWaitingCapacity())
	assert.EqualValues(t, 0, g.GetGaugesAgeMs())
}

func TestParsePending(t *testing.T) {
	text := `# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="m",version="1"} 2
nv_inference_pending_request_count{model="m",version="2"} 3
nv_inference_pending_request_count{model="n",version="1"} 50
`
	p, ok, err := oip.ParsePending(strings.NewReader(text), "m")
	require.NoError(t, err)
	assert.True(t, ok)
	assert.EqualValues(t, 5, p, "summed over the model's versions")
	_, ok, err = oip.ParsePending(strings.NewReader(text), "x")
	require.NoError(t, err)
	assert.False(t, ok)
	_, _, err = oip.ParsePending(strings.NewReader("nv_inference_pending_request_count{model=\"m\" 2\n"), "m")
	assert.Error(t, err)
}

func TestCheckMetricsURL(t *testing.T) {
	for raw, want := range map[string]string{
		"http://127.0.0.1:8002/metrics": "",
		"https://triton:8002/metrics":   "",
		"127.0.0.1:8002":                "want an http or https URL",
		"unix:///run/m.sock":            "want an http or https URL",
		"http:///metrics":               "no host",
	} {
		err := oip.CheckMetricsURL(raw)
		if want == "" {
			assert.NoError(t, err, raw)
			continue
		}
		assert.ErrorContains(t, err, want, raw)
	}
	_, err := oip.New(oip.Config{Upstream: "127.0.0.1:1", Model: "m", MetricsURL: "ftp://h/metrics"})
	assert.ErrorContains(t, err, "want an http or https URL")
}
