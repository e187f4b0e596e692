package httpapi

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"regexp"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// wait bounds every wait on a condition; generous for a loaded machine.
const wait = 30 * time.Second

var traceparentRE = regexp.MustCompile(`^00-[0-9a-f]{32}-[0-9a-f]{16}-0[01]$`)

func testCtx(t testing.TB) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// startCluster runs a real head and sim workers (orchestratortest), with
// the engines' logs discarded.
func startCluster(t testing.TB, opts orchestratortest.Options) *orchestratortest.Cluster {
	t.Helper()
	if opts.Sim.Logger == nil {
		opts.Sim.Logger = slog.New(slog.DiscardHandler)
	}
	return orchestratortest.Start(t, opts)
}

// api is a Server of a real head, listening on loopback through
// NewHTTPServer.
type api struct {
	*Server
	cluster *orchestratortest.Cluster
	http    *http.Server
	base    string // http://127.0.0.1:port
	client  *http.Client
}

// startAPI serves handler(s) (Handler when nil) of a Server over the
// cluster's head. tweak, when not nil, may adjust the http.Server.
func startAPI(t testing.TB, c *orchestratortest.Cluster, cfg Config, handler func(*Server) http.Handler, tweak func(*http.Server)) *api {
	t.Helper()
	return startAPIOn(t, c, c.Head, cfg, handler, tweak)
}

// startAPIOn is startAPI for head, one of c's heads (Cluster.AddHead).
func startAPIOn(t testing.TB, c *orchestratortest.Cluster, head *orchestrator.Head, cfg Config, handler func(*Server) http.Handler, tweak func(*http.Server)) *api {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Metrics == nil {
		// As in `troupe head`: every test runs behind the HTTP metrics'
		// middleware (flush, deadlines and hijack must pass through it).
		m, err := NewMetrics(prometheus.NewRegistry())
		require.NoError(t, err)
		cfg.Metrics = m
	}
	s := New(head, cfg)
	h := s.Handler()
	if handler != nil {
		h = handler(s)
	}
	srv := NewHTTPServer("127.0.0.1:0", h)
	if tweak != nil {
		tweak(srv)
	}
	lis, err := net.Listen("tcp", srv.Addr)
	require.NoError(t, err)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(NewListener(lis)) }()
	tr := &http.Transport{}
	a := &api{Server: s, cluster: c, http: srv, base: "http://" + lis.Addr().String(), client: &http.Client{Transport: tr}}
	t.Cleanup(func() {
		tr.CloseIdleConnections()
		ctx, cancel := context.WithTimeout(context.Background(), wait)
		defer cancel()
		if err := srv.Shutdown(ctx); err != nil {
			_ = srv.Close()
		}
		require.ErrorIs(t, <-served, http.ErrServerClosed)
	})
	return a
}

// openai is the official client pointed at the API.
func (a *api) openai(opts ...option.RequestOption) openai.Client {
	base := []option.RequestOption{
		option.WithBaseURL(a.base + "/v1/"),
		option.WithAPIKey("unused"),
		option.WithHTTPClient(a.client),
		option.WithMaxRetries(0),
	}
	return openai.NewClient(append(base, opts...)...)
}

// do sends a raw request and returns the response with its body read.
func (a *api) do(t *testing.T, method, path string, body io.Reader, header http.Header) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequestWithContext(testCtx(t), method, a.base+path, body)
	require.NoError(t, err)
	for k, v := range header {
		req.Header[k] = v
	}
	if body != nil && req.Header.Get("Content-Type") == "" {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := a.client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp, data
}

func (a *api) post(t *testing.T, path, body string) (*http.Response, []byte) {
	t.Helper()
	return a.do(t, http.MethodPost, path, bytes.NewReader([]byte(body)), nil)
}

// wantError checks an OpenAI error response and returns its detail.
func wantError(t *testing.T, resp *http.Response, body []byte, status int, typ, code string) errorDetail {
	t.Helper()
	require.Equal(t, status, resp.StatusCode, "body: %s", body)
	assert.Equal(t, "application/json", resp.Header.Get("Content-Type"))
	var raw map[string]map[string]any
	require.NoError(t, json.Unmarshal(body, &raw), "body: %s", body)
	require.Contains(t, raw, "error")
	for _, k := range []string{"message", "type", "param", "code"} {
		assert.Contains(t, raw["error"], k, "error JSON must hold %q", k)
	}
	var eb errorBody
	require.NoError(t, json.Unmarshal(body, &eb))
	assert.NotEmpty(t, eb.Error.Message)
	assert.Equal(t, typ, eb.Error.Type)
	require.NotNil(t, eb.Error.Code)
	assert.Equal(t, code, *eb.Error.Code)
	wantIDs(t, resp)
	return eb.Error
}

// wantIDs checks the headers every response carries.
func wantIDs(t *testing.T, resp *http.Response) {
	t.Helper()
	assert.NotEmpty(t, resp.Header.Get("X-Request-Id"))
	assert.Regexp(t, traceparentRE, resp.Header.Get("Traceparent"))
}

// apiErrorOf unwraps the openai client's error.
func apiErrorOf(t *testing.T, err error) *openai.Error {
	t.Helper()
	var oe *openai.Error
	require.True(t, errors.As(err, &oe), "want an API error, got %v", err)
	return oe
}

// counter sums a counter family's series of one stage, optionally narrowed
// to one label value.
func counter(t *testing.T, c *orchestratortest.Cluster, name, stage string, label, value string) float64 {
	t.Helper()
	fams, err := c.Metrics.Gather()
	require.NoError(t, err)
	var sum float64
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			if labelOf(m, "stage") != stage || (label != "" && labelOf(m, label) != value) {
				continue
			}
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}

func labelOf(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

// inFlight is the head's in-flight count of a stage's replicas.
func inFlight(c *orchestratortest.Cluster, stage int) int64 {
	var n int64
	for _, r := range c.Head.Replicas() {
		if r.Stage == stage {
			n += r.InFlight
		}
	}
	return n
}
