package httpapi

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"
)

// OtherRoute is the route label of a request that matched no route (404,
// 405, a redirect to a cleaned path): the raw path never becomes a label
// value, so a scan of random paths cannot blow up the series count.
const OtherRoute = "other"

// httpDurationBuckets span a health probe (a millisecond) to a long
// generation (ten minutes, DefaultRequestTimeout).
var httpDurationBuckets = []float64{
	0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
	1, 2.5, 5, 10, 30, 60, 120, 300, 600,
}

// Metrics are the HTTP metrics of a head's API, with promhttp's conventions
// (method lowercase, "unknown" for methods outside the standard set; code
// the status code, 200 when the handler wrote none, 499 when the client
// went away before any status was written):
//
//   - troupe_http_requests_total{route,method,code}
//   - troupe_http_request_duration_seconds{route,method}
//   - troupe_http_requests_in_flight
//
// route is the pattern the request matched (/v1/chat/completions,
// /v1/replicas/{stage}/{replica}/sleep), never the raw path; OtherRoute when
// none matched. Every answer counts, those that never reach a replica (400,
// 401, 404, 413, 429, 503) included. The duration of a stream is the whole
// stream. A sampled request's trace id is the exemplar of its samples.
//
// Build one with NewMetrics per registry and pass it to every Server of
// that head (Config.Metrics); it is safe for concurrent use.
type Metrics struct {
	requests *prometheus.CounterVec
	duration *prometheus.HistogramVec
	inFlight prometheus.Gauge
	realtime *realtimeMetrics // realtime.go

	mu    sync.RWMutex
	bound map[routeKey]*bound
}

// NewMetrics registers the HTTP metrics on reg (never the global registry).
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	if reg == nil {
		return nil, fmt.Errorf("httpapi: nil prometheus registerer")
	}
	m := &Metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "troupe_http_requests_total",
			Help: "HTTP requests answered by the head, by route pattern, method and status code.",
		}, []string{"route", "method", "code"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "troupe_http_request_duration_seconds",
			Help:    "Time to answer an HTTP request (a stream: until its end), by route pattern and method.",
			Buckets: httpDurationBuckets,
		}, []string{"route", "method"}),
		inFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "troupe_http_requests_in_flight",
			Help: "HTTP requests the head is answering now.",
		}),
		bound:    map[routeKey]*bound{},
		realtime: newRealtimeMetrics(),
	}
	cs := append([]prometheus.Collector{m.requests, m.duration, m.inFlight}, m.realtime.collectors()...)
	for i, c := range cs {
		if err := reg.Register(c); err != nil {
			for _, done := range cs[:i] {
				reg.Unregister(done)
			}
			return nil, fmt.Errorf("httpapi: register metrics: %w", err)
		}
	}
	return m, nil
}

// bound are the children of one (route, method, code): resolved once, so
// a request pays a map lookup instead of promhttp's label map and hashing.
type bound struct {
	requests prometheus.Counter
	duration prometheus.Observer
}

type routeKey struct {
	route, method string
	code          int
}

// observe counts one answered request. ctx carries its server span, whose
// trace id is the exemplar when sampled.
func (m *Metrics) observe(ctx context.Context, route, method string, code int, elapsed time.Duration) {
	k := routeKey{route, sanitizeMethod(method), code}
	m.mu.RLock()
	b := m.bound[k]
	m.mu.RUnlock()
	if b == nil {
		b = &bound{
			requests: m.requests.WithLabelValues(k.route, k.method, strconv.Itoa(k.code)),
			duration: m.duration.WithLabelValues(k.route, k.method),
		}
		m.mu.Lock()
		if len(m.bound) < maxBound { // codes are few, but a method is the client's
			m.bound[k] = b
		}
		m.mu.Unlock()
	}
	if ex := traceExemplar(ctx); ex != nil {
		b.requests.(prometheus.ExemplarAdder).AddWithExemplar(1, ex)
		b.duration.(prometheus.ExemplarObserver).ObserveWithExemplar(elapsed.Seconds(), ex)
		return
	}
	b.requests.Inc()
	b.duration.Observe(elapsed.Seconds())
}

// maxBound bounds the children cache; beyond it a request resolves its
// children each time, as promhttp does.
const maxBound = 1024

// sanitizeMethod is promhttp's method label: lowercase for the standard
// methods, "unknown" for anything else, so a client cannot make series.
func sanitizeMethod(m string) string {
	switch m {
	case http.MethodGet, "get":
		return "get"
	case http.MethodPut, "put":
		return "put"
	case http.MethodHead, "head":
		return "head"
	case http.MethodPost, "post":
		return "post"
	case http.MethodDelete, "delete":
		return "delete"
	case http.MethodConnect, "connect":
		return "connect"
	case http.MethodOptions, "options":
		return "options"
	case "NOTIFY", "notify":
		return "notify"
	case http.MethodTrace, "trace":
		return "trace"
	case http.MethodPatch, "patch":
		return "patch"
	}
	return "unknown"
}

// traceExemplar is {trace_id} of a sampled span, else nil (no exemplar:
// an unsampled trace id points at nothing in the trace store).
func traceExemplar(ctx context.Context) prometheus.Labels {
	sc := trace.SpanContextFromContext(ctx)
	if !sc.IsSampled() {
		return nil
	}
	return prometheus.Labels{"trace_id": sc.TraceID().String()}
}

// routeLabelOf returns the route label of r: the path part of the pattern
// it matches ("POST /v1/completions" → "/v1/completions"), or OtherRoute.
// A request the mux served carries its pattern; one refused before routing
// (401, 413) is looked up. Only patterns registered by New are trusted:
// for a redirect the mux reports the target path as the pattern.
func (s *Server) routeLabelOf(mux *http.ServeMux, r *http.Request) string {
	pattern := r.Pattern
	if pattern == "" {
		_, pattern = mux.Handler(r)
	}
	route, ok := s.routes[pattern]
	if !ok {
		return OtherRoute
	}
	if route == "/v1/replicas" && isWatch(r) {
		// A watch lasts as long as its client: its durations would drown
		// the list's.
		return watchRoute
	}
	return route
}

// watchRoute is the route label of GET /v1/replicas?watch=true.
const watchRoute = "/v1/replicas?watch=true"

// isWatch reports whether r asks to watch (?watch= a true Go boolean).
func isWatch(r *http.Request) bool {
	watch, err := strconv.ParseBool(r.URL.Query().Get("watch"))
	return err == nil && watch
}

// routeLabel is the route label of a registered pattern: without its
// method and host.
func routeLabel(pattern string) string {
	if _, path, ok := strings.Cut(pattern, " "); ok {
		pattern = path
	}
	if i := strings.IndexByte(pattern, '/'); i > 0 {
		pattern = pattern[i:] // a host-qualified pattern
	}
	return pattern
}
