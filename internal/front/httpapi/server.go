// Package httpapi is the head's HTTP API: the OpenAI-compatible serving
// endpoints (chat and text completions, models), the admin endpoints
// (replicas, sleep, wake_up), /metrics and the health probes.
//
// Every request passes, in order: otelhttp (the server span, W3C context
// extracted from the request), the HTTP metrics (Metrics), then this
// package's middleware (X-Request-Id, traceparent, API key, body limit,
// access log), then the route. docs/api.md describes the endpoints and the
// errors.
package httpapi

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/pprof"
	"net/url"
	"path"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	noopmetric "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/telemetry"
)

// Backend is what the API needs from the head (*orchestrator.Head). Every
// method may be called concurrently.
type Backend interface {
	Pipeline() orchestrator.Pipeline
	Execute(ctx context.Context, req orchestrator.Request, onText func(delta string) error) (*orchestrator.Result, error)
	CheckParts(msgs []*stagepb.ChatMessage) error
	Replicas() []orchestrator.ReplicaStatus
	WatchReplicas(stage int) (*orchestrator.ReplicaWatch, []orchestrator.ReplicaStatus)
	Ready() (bool, string)
	ResolveStage(stage string) (int, error)
	Sleep(ctx context.Context, stage int, replica uint32, level int) (stagepb.SleepState, error)
	WakeUp(ctx context.Context, stage int, replica uint32) (stagepb.SleepState, error)
}

// The head is the Backend; this breaks the build if they drift apart.
var _ Backend = (*orchestrator.Head)(nil)

// Defaults of Config.
const (
	DefaultMaxBodyBytes   = stagepb.DefaultMaxBodyBytes
	DefaultRequestTimeout = 10 * time.Minute
	// DefaultDrainTimeout is how long in-flight requests may finish once
	// the servers shut down (troupe head --drain-timeout).
	DefaultDrainTimeout = 30 * time.Second
	// adminTimeout bounds a sleep or wake_up call to a replica.
	adminTimeout = 30 * time.Second
	// maxRequestIDLen bounds an X-Request-Id taken from the client.
	maxRequestIDLen = 128
)

// Config configures a Server. The zero value works: no auth, bodies up to
// DefaultMaxBodyBytes, no /metrics, trace ids that are never sampled.
type Config struct {
	// MaxBodyBytes caps request bodies (413 above it); <= 0 means
	// DefaultMaxBodyBytes.
	MaxBodyBytes int64
	// APIKey, when not empty, must be sent as "Authorization: Bearer <key>"
	// on every route except /metrics, /healthz and /readyz. It never
	// grants sleep or wake_up; it reads /v1/replicas only while no
	// AdminAPIKey is set.
	APIKey string
	// AdminAPIKey, when not empty, is the one key of the admin routes
	// (/v1/replicas and its sleep and wake_up), and is accepted wherever
	// the APIKey is. Empty with an APIKey: sleep and wake_up answer 403,
	// since the inference key must not put replicas to sleep. Both empty:
	// no auth at all.
	AdminAPIKey string
	// Gatherer is served on /metrics (OpenMetrics when the scraper asks for
	// it, gzipped when it accepts gzip). nil and no Exposer: no /metrics
	// route.
	Gatherer prometheus.Gatherer
	// Exposer's families are written on /metrics after the Gatherer's,
	// without being gathered (the head's per-replica stats: Head). The
	// Gatherer must not also hold them; one it does is left out of
	// /metrics and logged, so no family is ever served twice. nil: none.
	Exposer Exposer
	// ExposerGatherer gathers the Exposer's families, for a scraper that
	// prefers protobuf, the one format with native histograms (the head's
	// stats registry, orchestrator.Config.StatsMetrics). nil: /metrics
	// serves no protobuf.
	ExposerGatherer prometheus.Gatherer
	// Metrics counts and times every request (see Metrics). nil: no HTTP
	// metrics.
	Metrics *Metrics
	// TracerProvider makes the server spans, through otelhttp. nil: nothing
	// is traced; each request still gets a server span, unsampled and bare
	// (no otelhttp, none of its attributes), so responses carry a real
	// traceparent and logs a trace id at a fraction of the cost.
	TracerProvider trace.TracerProvider
	// Propagator extracts the caller's trace context. nil: W3C trace
	// context and baggage.
	Propagator propagation.TextMapPropagator
	// UntrustedParent makes the server span a new root that links to the
	// caller's span instead of being its child (--trace-untrusted-parent).
	UntrustedParent bool
	// Logger receives one line per request (debug for probes and metrics).
	// nil: slog.Default().
	Logger *slog.Logger
	// RequestTimeout bounds one generation; <= 0 means 10 minutes. A
	// request that runs out gets 504 (or an error event on a stream).
	RequestTimeout time.Duration
	// WriteStallTimeout bounds each write of a response: a client that
	// reads nothing for this long loses its connection, and a streamed
	// request of it ends on every stage (the head counts it as the
	// client's cancel, never a replica's fault). It replaces the
	// server-wide WriteTimeout, which would cut long streams. <= 0 means
	// DefaultWriteStallTimeout.
	WriteStallTimeout time.Duration
	// BodyIdleTimeout and BodyMinRate bound how slowly a request body may
	// arrive (see pacedBody): each read waits at most BodyIdleTimeout, and
	// once BodyIdleTimeout has passed since the request began, the body's
	// average rate must be at least BodyMinRate bytes per second, until
	// the whole request's DefaultBodyReadTimeout. A body that misses a
	// deadline is answered 408 and its connection closed. <= 0:
	// DefaultBodyIdleTimeout and DefaultBodyMinRate; BodyMinRate < 0: no
	// rate.
	BodyIdleTimeout time.Duration
	BodyMinRate     int64
	// SessionHeader names the header whose value is a request's session
	// key, for session affinity (troupe head: X-Session-ID). Empty: none.
	SessionHeader string
	// SessionFromUser takes the session key from the body's OpenAI `user`
	// field when the header is absent or empty.
	SessionFromUser bool
	// MaxInFlight bounds the completions the head runs at once; beyond it
	// a request is answered 429 with Retry-After at once, so latency stays
	// bounded instead of growing with the queue. <= 0: no limit.
	MaxInFlight int
	// MaxContentParts bounds the media parts (image, audio, video) of one
	// chat request (400 above it); <= 0 means DefaultMaxContentParts.
	MaxContentParts int
	// MaxPartBytes bounds the decoded bytes of one media part (413 above
	// it); <= 0 means DefaultMaxPartBytes.
	MaxPartBytes int64
	// Realtime bounds the realtime sessions of GET /v1/realtime.
	Realtime RealtimeConfig
}

// Server serves the API of one head. Its handlers are safe for concurrent
// use; it owns no goroutines.
type Server struct {
	b            Backend
	cfg          Config
	log          *slog.Logger
	created      int64             // the models' "created": when the server was built
	keyHash      [sha256.Size]byte // of APIKey
	adminKeyHash [sha256.Size]byte // of AdminAPIKey
	routes       map[string]string // registered pattern → route label; read-only after New
	running      atomic.Int64      // completions admitted and not finished (MaxInFlight)
	// draining: the process is stopping; /readyz says so (see Drain).
	draining atomic.Bool
	// drained is closed by Drain: it ends the watches of /v1/replicas,
	// which would otherwise hold the server's shutdown to its timeout.
	drained   chan struct{}
	drainOnce sync.Once
	watches   atomic.Int64 // watches of /v1/replicas being served (maxReplicaWatches)
	rt        realtimeHub  // the sessions of /v1/realtime

	all, serving, admin http.Handler
}

// New builds the server's handlers over the head b.
func New(b Backend, cfg Config) *Server {
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if cfg.RequestTimeout <= 0 {
		cfg.RequestTimeout = DefaultRequestTimeout
	}
	if cfg.WriteStallTimeout <= 0 {
		cfg.WriteStallTimeout = DefaultWriteStallTimeout
	}
	if cfg.BodyIdleTimeout <= 0 {
		cfg.BodyIdleTimeout = DefaultBodyIdleTimeout
	}
	if cfg.BodyMinRate == 0 {
		cfg.BodyMinRate = DefaultBodyMinRate
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Propagator == nil {
		cfg.Propagator = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	}
	s := &Server{b: b, cfg: cfg, log: cfg.Logger, created: time.Now().Unix(), routes: map[string]string{}, drained: make(chan struct{})}
	s.rt.budget.limit = cfg.Realtime.withDefaults().MemoryBudget
	if cfg.Metrics != nil {
		s.rt.budget.gauge = cfg.Metrics.realtime.buffered
	}
	if cfg.APIKey != "" {
		s.keyHash = sha256.Sum256([]byte(cfg.APIKey))
	}
	if cfg.AdminAPIKey != "" {
		s.adminKeyHash = sha256.Sum256([]byte(cfg.AdminAPIKey))
	}
	serving, admin, all := http.NewServeMux(), http.NewServeMux(), http.NewServeMux()
	handle := func(muxes []*http.ServeMux, pattern string, h http.Handler) {
		s.routes[pattern] = routeLabel(pattern)
		for _, m := range muxes {
			m.Handle(pattern, h)
		}
	}
	servingMuxes, adminMuxes := []*http.ServeMux{serving, all}, []*http.ServeMux{admin, all}
	handle(servingMuxes, "POST /v1/chat/completions", s.admitted(s.chatCompletions))
	handle(servingMuxes, "POST /v1/completions", s.admitted(s.completions))
	handle(servingMuxes, "POST /v1/audio/speech", s.admitted(s.speech))
	handle(servingMuxes, "POST /v1/audio/transcriptions", s.admitted(s.transcriptions))
	handle(servingMuxes, "GET /v1/realtime", http.HandlerFunc(s.realtime))
	handle(servingMuxes, "GET /v1/models", http.HandlerFunc(s.models))
	handle(servingMuxes, "GET /v1/models/{model...}", http.HandlerFunc(s.model))
	handle(adminMuxes, "GET /v1/replicas", http.HandlerFunc(s.replicas))
	handle(adminMuxes, "GET /v1/replicas/sd", http.HandlerFunc(s.replicasSD))
	handle(adminMuxes, "POST /v1/replicas/{stage}/{replica}/sleep", http.HandlerFunc(s.sleep))
	handle(adminMuxes, "POST /v1/replicas/{stage}/{replica}/wake_up", http.HandlerFunc(s.wakeUp))
	// Go's profiles of the head, for operators: admin routes (see
	// authorize). Not cmdline, which would show an API key given as a flag.
	handle(adminMuxes, "GET /debug/pprof/", http.HandlerFunc(pprof.Index))
	handle(adminMuxes, "GET /debug/pprof/profile", http.HandlerFunc(pprof.Profile))
	handle(adminMuxes, "GET /debug/pprof/symbol", http.HandlerFunc(pprof.Symbol))
	handle(adminMuxes, "GET /debug/pprof/trace", http.HandlerFunc(pprof.Trace))
	if cfg.Gatherer != nil || cfg.Exposer != nil {
		handle(adminMuxes, "GET /metrics", metricsHandler(cfg.Gatherer, cfg.Exposer, cfg.ExposerGatherer, s.log))
	}
	everyMux := []*http.ServeMux{serving, admin, all}
	handle(everyMux, "GET /healthz", http.HandlerFunc(s.healthz))
	handle(everyMux, "GET /readyz", http.HandlerFunc(s.readyz))
	s.all, s.serving, s.admin = s.wrap(all), s.wrap(serving), s.wrap(admin)
	return s
}

// admitted runs h within the MaxInFlight limit, or answers 429 (OpenAI's
// rate-limit shape, Retry-After 1). The limit counts requests, not
// uploads: the body is read before a slot is taken, so clients that send
// their bodies slowly hold connections (each bounded by the server's
// ReadTimeout, see NewHTTPServer) but never the slots real requests need.
// While every slot is taken, a request is refused before its body is read.
func (s *Server) admitted(h http.HandlerFunc) http.Handler {
	if s.cfg.MaxInFlight <= 0 {
		return h
	}
	limit := int64(s.cfg.MaxInFlight)
	refuse := func(w http.ResponseWriter, r *http.Request) {
		s.reject(w, r, &apiError{Status: http.StatusTooManyRequests, Type: typeRateLimit, Code: "too_many_requests", RetryAfter: "1",
			Message: fmt.Sprintf("the server is at its limit of %d requests in flight; retry shortly", limit)})
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if s.running.Load() >= limit {
			refuse(w, r)
			return
		}
		body, e := s.readBody(r)
		if e != nil {
			s.reject(w, r, e)
			return
		}
		r.Body = &readBody{Reader: bytes.NewReader(body), body: body}
		if s.running.Add(1) > limit {
			s.running.Add(-1)
			refuse(w, r)
			return
		}
		defer s.running.Add(-1)
		h(w, r)
	})
}

// readBody is a request body admitted already read; Server.readBody takes
// its bytes without copying them.
type readBody struct {
	*bytes.Reader
	body []byte
}

func (*readBody) Close() error { return nil }

// Drain makes /readyz answer 503 "not ready: shutting down" from now on, so
// load balancers stop sending new requests while this head finishes the
// ones it has; every other route is served as before. The process calls it
// first on SIGTERM (see `troupe head --shutdown-delay`). It may be called
// from any goroutine; it cannot be undone.
// Realtime sessions are closed with 1001 as soon as their running response
// ends, and new ones refused with 1013; watches of /v1/replicas end.
func (s *Server) Drain() {
	s.draining.Store(true)
	s.drainOnce.Do(func() { close(s.drained) })
	s.rt.drain()
}

// Handler serves every route: serving, admin, metrics and health.
func (s *Server) Handler() http.Handler { return s.all }

// ServingHandler serves the OpenAI routes and the health probes, without
// admin and metrics: for the public listener when --admin-http splits them.
func (s *Server) ServingHandler() http.Handler { return s.serving }

// AdminHandler serves admin, metrics and the health probes: for the
// --admin-http listener.
func (s *Server) AdminHandler() http.Handler { return s.admin }

// NewHTTPServer returns a server for h with every timeout that is safe for
// streaming set:
//   - ReadHeaderTimeout 10s and MaxHeaderBytes 64 KiB bound slow or huge
//     headers (slowloris).
//   - ReadTimeout 60s (DefaultBodyReadTimeout) bounds reading the whole
//     request, body included: an upload that has not finished by then is
//     cut. Within it, the Server paces each body (Config.BodyIdleTimeout,
//     Config.BodyMinRate): a body trickled slowly is cut long before.
//     Uploads take no admission slot (see admitted), so slow ones cannot
//     starve requests.
//     net/http lifts that deadline once the body has been read (its
//     background read for client disconnects runs without one), so it
//     never cuts a long generation; TestSlowStreams holds it to that.
//   - IdleTimeout 120s closes idle keep-alive connections.
//   - WriteTimeout is left at 0: it is a deadline for the whole response
//     and would cut every stream longer than it. Instead each write gets
//     its own 30s deadline (a client that stops reading is dropped), and
//     Config.RequestTimeout bounds the generation itself.
func NewHTTPServer(addr string, h http.Handler) *http.Server {
	return &http.Server{
		Addr:              addr,
		Handler:           h,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       DefaultBodyReadTimeout,
		IdleTimeout:       120 * time.Second,
		MaxHeaderBytes:    64 << 10,
	}
}

// wrap puts mux behind the server span (otelhttp, or a bare one when
// nothing is traced) and the middleware, which also counts every answer in
// the HTTP metrics: inside the span, so that a sampled span's trace id can
// be their exemplar, and its own refusals (401, 413) included.
func (s *Server) wrap(mux *http.ServeMux) http.Handler {
	var inner http.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { s.serve(w, r, mux) })
	if s.cfg.TracerProvider == nil {
		return s.bareSpans(inner)
	}
	opts := []otelhttp.Option{
		otelhttp.WithTracerProvider(s.cfg.TracerProvider),
		otelhttp.WithPropagators(s.cfg.Propagator),
		otelhttp.WithMeterProvider(noopmetric.NewMeterProvider()), // HTTP metrics are not part of /metrics
		otelhttp.WithSpanNameFormatter(func(_ string, r *http.Request) string { return spanName(r) }),
	}
	if s.cfg.UntrustedParent {
		opts = append(opts, otelhttp.WithPublicEndpointFn(func(*http.Request) bool { return true }))
	}
	return otelhttp.NewHandler(inner, "troupe.http", opts...)
}

// untraced makes the bare server spans of a server that traces nothing:
// never sampled, but with real ids.
var untraced = sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.NeverSample())).Tracer("troupe/httpapi")

// bareSpans starts each request's server span as otelhttp would, parent
// and kind included, without its attributes, metrics and writer wrapping:
// a span nobody records needs none of them.
func (s *Server) bareSpans(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		if !s.cfg.UntrustedParent {
			ctx = s.cfg.Propagator.Extract(ctx, propagation.HeaderCarrier(r.Header))
		}
		ctx, span := untraced.Start(ctx, "troupe.http", trace.WithSpanKind(trace.SpanKindServer))
		defer span.End()
		next.ServeHTTP(w, r.WithContext(ctx))
	})
}

// spanName is "METHOD /route" once the route is known, else "METHOD".
func spanName(r *http.Request) string {
	switch {
	case r.Pattern == "":
		return r.Method
	case strings.Contains(r.Pattern, " "):
		return r.Pattern
	default:
		return r.Method + " " + r.Pattern
	}
}

type requestIDKey struct{}

// requestIDFrom returns the request id the middleware put in ctx.
func requestIDFrom(ctx context.Context) string {
	id, _ := ctx.Value(requestIDKey{}).(string)
	return id
}

// serve is the middleware inside otelhttp: the server span exists, so the
// traceparent header can be set before anything is written.
func (s *Server) serve(w http.ResponseWriter, r *http.Request, mux *http.ServeMux) {
	start := time.Now()
	if m := s.cfg.Metrics; m != nil {
		m.inFlight.Inc()
		defer m.inFlight.Dec()
	}
	id := requestID(r.Header.Get("X-Request-Id"))
	span := trace.SpanFromContext(r.Context())
	span.SetAttributes(telemetry.KeyRequestID.String(id))
	h := w.Header()
	h.Set("X-Request-Id", id)
	tp := telemetry.TraceparentHeader(r.Context())
	if tp != "" {
		h.Set("Traceparent", tp)
	}
	// A previous response on this keep-alive connection may have left a
	// write deadline behind (see extendWriteDeadline).
	_ = http.NewResponseController(w).SetWriteDeadline(time.Time{})

	sw := &statusWriter{ResponseWriter: w, start: start}
	r = r.WithContext(context.WithValue(r.Context(), requestIDKey{}, id))
	cleanURLPath(r)
	acc := s.authorize(r)
	switch {
	case acc == unauthenticated:
		h.Set("WWW-Authenticate", `Bearer realm="troupe"`)
		writeError(sw, &apiError{Status: http.StatusUnauthorized, Type: typeAuthentication, Code: "invalid_api_key",
			Message: "missing or invalid API key: send \"Authorization: Bearer <key>\""})
	case acc == forbidden:
		writeError(sw, &apiError{Status: http.StatusForbidden, Type: typePermission, Code: "admin_key_required",
			Message: "this route needs the admin key (troupe head --admin-api-key-file); the API key does not grant it"})
	case r.ContentLength > s.cfg.MaxBodyBytes:
		// Refused before reading a byte of it.
		h.Set("Connection", "close")
		writeError(sw, tooLarge(s.cfg.MaxBodyBytes))
	default:
		r.Body = http.MaxBytesReader(sw, s.paced(sw, r, start), s.cfg.MaxBodyBytes)
		dispatch(sw, r, mux)
	}
	// otelhttp names the span from its own copy of the request, which the
	// mux never saw; name it here, where the route is known.
	span.SetName(spanName(r))
	elapsed := time.Since(start)
	if m := s.cfg.Metrics; m != nil {
		m.observe(r.Context(), s.routeLabelOf(mux, r), r.Method, sw.statusOr200(), elapsed)
	}

	s.logRequest(r, id, tp, sw, elapsed)
}

// logRequest writes the request's log line: info, warn for a 5xx, debug
// for the probes and /metrics whatever their status (a 503 of /readyz is
// the probe's answer, polled by balancers and by `troupe up` while the
// cluster forms, not a fault anyone acts on). tp is the response's traceparent header
// ("" when none): its trace and span ids are the line's trace_id and
// span_id, so the log handler need not format them again (see
// telemetry.TraceLogAttrs).
func (s *Server) logRequest(r *http.Request, id, tp string, sw *statusWriter, elapsed time.Duration) {
	level := slog.LevelInfo
	switch {
	case r.Pattern == "GET /healthz" || r.Pattern == "GET /readyz" || r.Pattern == "GET /metrics":
		level = slog.LevelDebug
	case sw.status >= 500:
		level = slog.LevelWarn
	}
	ctx, h := r.Context(), s.log.Handler()
	if !h.Enabled(ctx, level) {
		return
	}
	// The record is built here rather than by Logger.LogAttrs, which
	// walks the stack for the caller's pc every time: the caller is always
	// this line of this function.
	pc := requestLogPC.Load()
	if pc == 0 {
		var pcs [1]uintptr
		runtime.Callers(1, pcs[:]) // 1: this function, not runtime.Callers
		pc = pcs[0]
		requestLogPC.Store(pc)
	}
	rec := slog.NewRecord(time.Now(), level, "httpapi: request", pc)
	// One AddAttrs: each call past the record's inline room allocates.
	attrs := [...]slog.Attr{
		slog.String("request_id", id),
		slog.String("method", r.Method),
		slog.String("path", r.URL.Path),
		slog.String("route", r.Pattern),
		slog.Int("status", sw.statusOr200()),
		slog.Int64("bytes", sw.written),
		slog.Duration("duration", elapsed),
		slog.String("remote", r.RemoteAddr),
		{}, {}, // trace_id, span_id
	}
	n := len(attrs) - 2
	if traceID, spanID, ok := telemetry.TraceLogAttrs(tp); ok {
		attrs[n], attrs[n+1] = traceID, spanID
		n += 2
	}
	rec.AddAttrs(attrs[:n]...)
	_ = h.Handle(ctx, rec)
}

// requestLogPC is the pc of logRequest's records (their source, for a
// handler with AddSource), found by its first call.
var requestLogPC atomic.Uintptr

// dispatch runs the route, answering unknown routes (404) and wrong methods
// (405, with Allow) in the OpenAI error shape instead of the mux's text.
func dispatch(w http.ResponseWriter, r *http.Request, mux *http.ServeMux) {
	if h, pattern := mux.Handler(r); pattern != "" {
		if strings.Contains(pattern, "{") {
			mux.ServeHTTP(w, r) // the mux sets the path's wildcards
			return
		}
		// All the mux would add is the pattern: skip its second lookup.
		r.Pattern = pattern
		h.ServeHTTP(w, r)
		return
	}
	rec := &captureWriter{header: http.Header{}}
	mux.ServeHTTP(rec, r)
	switch rec.status {
	case http.StatusNotFound:
		writeError(w, notFound("", "not_found", "no route %s %s", r.Method, r.URL.Path))
	case http.StatusMethodNotAllowed:
		if allow := rec.header.Get("Allow"); allow != "" {
			w.Header().Set("Allow", allow)
		}
		writeError(w, &apiError{Status: http.StatusMethodNotAllowed, Type: typeInvalidRequest, Code: "method_not_allowed",
			Message: "method " + r.Method + " is not allowed on " + r.URL.Path + "; allowed: " + rec.header.Get("Allow")})
	default: // a redirect (serve cleans paths first, so none is expected)
		loc := rec.header.Get("Location")
		if loc != "" {
			w.Header().Set("Location", loc)
		}
		writeError(w, &apiError{Status: rec.statusOr200(), Type: typeInvalidRequest, Code: "moved",
			Message: "no route " + r.Method + " " + r.URL.Path + "; see " + loc})
	}
}

// cleanURLPath serves an unclean path (`//v1/chat/completions`, as a base
// URL with a trailing slash makes it) as its clean form. net/http's mux
// would answer a redirect instead, which clients do not follow for POST.
// r must be the middleware's own copy: its URL is replaced, not modified.
func cleanURLPath(r *http.Request) {
	escaped := r.URL.EscapedPath()
	if !strings.HasPrefix(escaped, "/") {
		return // "*" of OPTIONS, or a CONNECT authority
	}
	clean := path.Clean(escaped)
	if strings.HasSuffix(escaped, "/") && clean != "/" {
		clean += "/"
	}
	if clean == escaped {
		return
	}
	unescaped, err := url.PathUnescape(clean)
	if err != nil {
		return // the mux answers 404
	}
	u := *r.URL
	u.Path, u.RawPath = unescaped, clean
	r.URL = &u
}

// access is what authorize decides for a request.
type access int

const (
	allowed         access = iota
	unauthenticated        // 401: no key, or a wrong one
	forbidden              // 403: the API key, on a route it does not grant
)

// authorize decides whether r may pass (see Config.APIKey and
// AdminAPIKey): the probes and /metrics always; the admin routes
// (replicas, sleep, wake_up, profiles) with the admin key, or, while none
// is set, reading them (GET) with the API
// key; every other route with either key. A route with no key configured
// for it is open.
func (s *Server) authorize(r *http.Request) access {
	switch r.URL.Path {
	case "/metrics", "/healthz", "/readyz":
		return allowed
	}
	isAdmin := r.URL.Path == "/v1/replicas" || strings.HasPrefix(r.URL.Path, "/v1/replicas/") || strings.HasPrefix(r.URL.Path, "/debug/pprof/")
	readOnly := r.Method == http.MethodGet || r.Method == http.MethodHead
	hasAPI, hasAdmin := s.cfg.APIKey != "", s.cfg.AdminAPIKey != ""
	if !hasAPI && !hasAdmin {
		return allowed
	}
	if !isAdmin && !hasAPI {
		return allowed
	}
	// Hashing first makes the comparison constant-time in the key's length
	// too; both keys are always compared.
	var got [sha256.Size]byte
	if scheme, token, ok := strings.Cut(r.Header.Get("Authorization"), " "); ok && strings.EqualFold(scheme, "Bearer") {
		got = sha256.Sum256([]byte(strings.TrimSpace(token)))
	} else if token := realtimeKey(r); token != "" {
		got = sha256.Sum256([]byte(token)) // a browser's WebSocket cannot set the header
	} else {
		return unauthenticated
	}
	api := hasAPI && subtle.ConstantTimeCompare(got[:], s.keyHash[:]) == 1
	admin := hasAdmin && subtle.ConstantTimeCompare(got[:], s.adminKeyHash[:]) == 1
	switch {
	case admin:
		return allowed
	case !api:
		return unauthenticated
	case !isAdmin:
		return allowed
	case readOnly && !hasAdmin:
		return allowed
	default:
		return forbidden
	}
}

// requestID returns the client's id when it is sane (1 to 128 printable
// ASCII characters, no spaces), else a new random one.
func requestID(client string) string {
	if n := len(client); n > 0 && n <= maxRequestIDLen {
		ok := true
		for i := range n {
			if c := client[i]; c <= ' ' || c > '~' {
				ok = false
				break
			}
		}
		if ok {
			return client
		}
	}
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	return hex.EncodeToString(b[:])
}

// statusWriter records the status and size of a response for the access
// log. Unwrap lets http.ResponseController reach the connection (flush,
// deadlines).
type statusWriter struct {
	http.ResponseWriter
	status  int
	written int64
	start   time.Time // when the request came (receivedAt)
}

// receivedAt is when the middleware took the request w answers, before
// its body was read: what a request's deadline targets count from
// (orchestrator Request.Received). Zero when w is not the middleware's.
func receivedAt(w http.ResponseWriter) time.Time {
	if sw, ok := w.(*statusWriter); ok {
		return sw.start
	}
	return time.Time{}
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
		setDate(w.Header())
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
		setDate(w.Header())
	}
	n, err := w.ResponseWriter.Write(p)
	w.written += int64(n)
	return n, err
}

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func (w *statusWriter) statusOr200() int {
	if w.status == 0 {
		return http.StatusOK
	}
	return w.status
}

// captureWriter holds the mux's answer to an unmatched request.
type captureWriter struct {
	header http.Header
	status int
	body   []byte
}

func (c *captureWriter) Header() http.Header { return c.header }

func (c *captureWriter) WriteHeader(code int) {
	if c.status == 0 {
		c.status = code
	}
}

func (c *captureWriter) Write(p []byte) (int, error) {
	if c.status == 0 {
		c.status = http.StatusOK
	}
	c.body = append(c.body, p...)
	return len(p), nil
}

func (c *captureWriter) statusOr200() int {
	if c.status == 0 {
		return http.StatusOK
	}
	return c.status
}

// setDate sets the Date header from a value formatted once a second,
// rather than by net/http for every response (a percent of the head's CPU
// per request). The value's slice is shared between responses: net/http
// only reads it, and an Add would copy it (its capacity is its length).
func setDate(h http.Header) {
	if _, ok := h["Date"]; ok {
		return
	}
	now := time.Now()
	d := httpDate.Load()
	if d == nil || d.unix != now.Unix() {
		d = &cachedDate{unix: now.Unix(), value: []string{now.UTC().Format(http.TimeFormat)}}
		httpDate.Store(d)
	}
	h["Date"] = d.value
}

type cachedDate struct {
	unix  int64
	value []string
}

var httpDate atomic.Pointer[cachedDate]
