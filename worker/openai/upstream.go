// Package openai serves a stage from an OpenAI-compatible server (vLLM,
// vLLM-Omni, SGLang, llama.cpp, Ollama, or another troupe head): Engine
// for text stages (streaming chat and text completions) and SpeechEngine
// for speech stages (/v1/audio/speech).
//
// Both watch their upstream (Run): the worker registers only once the
// upstream answers its health endpoint and lists the model, leaves
// rotation after HealthFailures failed checks in a row and comes back when
// the upstream does (worker.Availability). Run also scrapes the upstream's
// Prometheus metrics (vLLM, SGLang, llama.cpp names: see ParseMetrics) into
// the replica's engine gauges. Sleep and WakeUp call vLLM's sleep-mode
// endpoints.
//
// The client is plain net/http with a small SSE reader rather than an SDK:
// every upstream status code and error body reaches the error mapping
// unchanged, nothing retries behind the head's back (the head owns the
// retry rule), and cancelling the request's context aborts the upstream
// HTTP request at once.
package openai

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// Engine names, as Health reports them and --engine takes them.
const (
	EngineName              = "openai"
	SpeechEngineName        = "openai-speech"
	TranscriptionEngineName = "openai-transcription"
)

// Defaults for zero Config fields.
const (
	DefaultReadyTimeout   = 10 * time.Minute
	DefaultHealthInterval = 5 * time.Second
	DefaultHealthFailures = 3
	DefaultSpeechFormat   = "wav"
	DefaultPCMSampleRate  = 24000 // the OpenAI speech API's pcm format
)

// readyPoll is how often the upstream is polled until it is first ready;
// readyLogEvery is how often the wait is logged.
const (
	readyPoll     = time.Second
	readyLogEvery = 10 * time.Second
	// errorBodyLimit bounds how much of an error response is read.
	errorBodyLimit = 64 << 10
)

// Config configures an Engine or a SpeechEngine.
type Config struct {
	// URL is the upstream's base URL as OpenAI clients take it
	// (http://host:8000/v1); without the /v1 suffix it is added. Health,
	// metrics and sleep endpoints are at the server root (the URL without
	// /v1).
	URL string
	// Model is the upstream's model; empty: the first of its /v1/models.
	Model string
	// APIKey, when set, is sent as "Authorization: Bearer <key>".
	APIKey string
	// CAFile is a PEM bundle trusted for the upstream's TLS certificate in
	// addition to the system roots.
	CAFile string
	// ReadyTimeout bounds the wait for the upstream to be first ready
	// (default DefaultReadyTimeout); Run fails after it.
	ReadyTimeout time.Duration
	// HealthInterval is the period of health checks and metric scrapes
	// once ready (default DefaultHealthInterval).
	HealthInterval time.Duration
	// HealthFailures is how many failed checks in a row make the engine
	// unavailable (default DefaultHealthFailures); one success makes it
	// available again.
	HealthFailures int
	// Voice is the speech engine's voice when a request names none; empty
	// leaves it to the upstream (vLLM-Omni has a default speaker; OpenAI
	// requires one, e.g. alloy).
	Voice string
	// SpeechFormat is the response_format asked of /v1/audio/speech: wav
	// (default) or pcm (headerless PCM16 at PCMSampleRate).
	SpeechFormat string
	// PCMSampleRate is the sample rate of pcm speech (default 24000).
	PCMSampleRate int
	Logger        *slog.Logger // default slog.Default()
}

func (c Config) withDefaults() (Config, error) {
	if c.ReadyTimeout <= 0 {
		c.ReadyTimeout = DefaultReadyTimeout
	}
	if c.HealthInterval <= 0 {
		c.HealthInterval = DefaultHealthInterval
	}
	if c.HealthFailures <= 0 {
		c.HealthFailures = DefaultHealthFailures
	}
	if c.SpeechFormat == "" {
		c.SpeechFormat = DefaultSpeechFormat
	}
	if c.SpeechFormat != "wav" && c.SpeechFormat != "pcm" {
		return c, fmt.Errorf("openai: speech format %q: want wav or pcm", c.SpeechFormat)
	}
	if c.PCMSampleRate <= 0 {
		c.PCMSampleRate = DefaultPCMSampleRate
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c, nil
}

// Endpoints splits an upstream URL into the OpenAI base URL (ending in
// /v1) and the server root (without it).
func Endpoints(raw string) (base, root string, err error) {
	u, err := url.Parse(strings.TrimSpace(raw))
	if err != nil {
		return "", "", fmt.Errorf("openai: upstream URL %q: %w", raw, err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return "", "", fmt.Errorf("openai: upstream URL %q: scheme must be http or https", raw)
	}
	if u.Host == "" {
		return "", "", fmt.Errorf("openai: upstream URL %q has no host", raw)
	}
	if u.User != nil || u.RawQuery != "" || u.Fragment != "" {
		return "", "", fmt.Errorf("openai: upstream URL %q: no credentials, query or fragment (the API key comes from TROUPE_UPSTREAM_API_KEY or a file)", raw)
	}
	p := strings.TrimRight(u.Path, "/")
	p = strings.TrimSuffix(p, "/v1")
	u.Path = p
	root = u.String()
	return root + "/v1", root, nil
}

// newHTTPClient is the client for one upstream: system roots plus the
// extra CA, keep-alive connections enough for many concurrent streams, and
// no overall timeout (streams are long; each request's context bounds it).
func newHTTPClient(caFile string) (*http.Client, error) {
	tlsCfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if caFile != "" {
		pool, err := x509.SystemCertPool()
		if err != nil {
			pool = x509.NewCertPool()
		}
		pem, err := os.ReadFile(caFile)
		if err != nil {
			return nil, fmt.Errorf("openai: read --upstream-ca: %w", err)
		}
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("openai: --upstream-ca %s holds no PEM certificate", caFile)
		}
		tlsCfg.RootCAs = pool
	}
	dialer := &net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}
	return &http.Client{Transport: &http.Transport{
		Proxy:                 http.ProxyFromEnvironment,
		DialContext:           dialer.DialContext,
		TLSClientConfig:       tlsCfg,
		TLSHandshakeTimeout:   10 * time.Second,
		ForceAttemptHTTP2:     true,
		MaxIdleConns:          1024,
		MaxIdleConnsPerHost:   1024,
		IdleConnTimeout:       90 * time.Second,
		ExpectContinueTimeout: time.Second,
	}}, nil
}

// upstream is what both engines share: the client, the monitor and its
// state, the sleep state.
type upstream struct {
	cfg    Config
	base   string // .../v1
	root   string
	client *http.Client
	log    *slog.Logger
	model  atomic.Pointer[string] // the served model, once resolved

	mu        sync.Mutex
	available bool
	message   string        // why not available
	changed   chan struct{} // closed and replaced at every availability change

	load      atomic.Pointer[scraped] // latest good scrape; nil before the first
	sleep     atomic.Int32            // stagepb.SleepState
	noHealth  atomic.Bool             // the upstream has no /health: models only
	noMetrics atomic.Bool             // the latest scrape found no /metrics
	// scrapeFailing: the latest scrape got no answer (logged once).
	scrapeFailing atomic.Bool

	// Prefix-cache counter increases the upstream reported since the last
	// chunk that carried them (see takeCounters).
	pendingQueries, pendingHits atomic.Uint64
	// Multimodal-cache counter increases (media items), likewise.
	pendingMMQueries, pendingMMHits atomic.Uint64

	ownedBy  atomic.Pointer[string] // the model's owned_by in /v1/models: which server it is
	inFlight atomic.Int32           // requests this worker has at the upstream
}

// capabilities are what the upstream's server does beyond the OpenAI API,
// known from the owned_by of its model (vLLM: "vllm", SGLang: "sglang").
type capabilities struct {
	continuousUsage bool // stream_options.continuous_usage_stats: usage on every chunk (vLLM, SGLang)
	continueChat    bool // continue_final_message: continue the assistant's last turn (vLLM)
}

func (u *upstream) caps() capabilities {
	owner := ""
	if p := u.ownedBy.Load(); p != nil {
		owner = *p
	}
	return capabilities{
		continuousUsage: owner == "vllm" || owner == "sglang",
		continueChat:    owner == "vllm",
	}
}

// track counts a request in flight until the returned func is first
// called (it may be called again).
func (u *upstream) track() func() {
	u.inFlight.Add(1)
	var once sync.Once
	return func() { once.Do(func() { u.inFlight.Add(-1) }) }
}

func newUpstream(cfg Config) (*upstream, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	base, root, err := Endpoints(cfg.URL)
	if err != nil {
		return nil, err
	}
	client, err := newHTTPClient(cfg.CAFile)
	if err != nil {
		return nil, err
	}
	u := &upstream{cfg: cfg, base: base, root: root, client: client, log: cfg.Logger, changed: make(chan struct{}), message: "upstream not checked yet"}
	m := cfg.Model
	u.model.Store(&m)
	return u, nil
}

// Model is the upstream model requests go to: Config.Model, or once the
// upstream is ready, the first model it lists.
func (u *upstream) Model() string { return *u.model.Load() }

// Available implements worker.Availability.
func (u *upstream) Available() (bool, <-chan struct{}) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.available, u.changed
}

func (u *upstream) setAvailable(ok bool, why string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.message = why
	if u.available == ok {
		return
	}
	u.available = ok
	close(u.changed)
	u.changed = make(chan struct{})
}

// state is the serving status and its reason, for Health.
func (u *upstream) state() (stagepb.ServingStatus, string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.available {
		return stagepb.ServingStatus_SERVING_STATUS_SERVING, ""
	}
	return stagepb.ServingStatus_SERVING_STATUS_NOT_SERVING, u.message
}

// health fills the fields both engines report.
func (u *upstream) health(engine, role string) *stagepb.HealthResponse {
	st, msg := u.state()
	return &stagepb.HealthResponse{
		Status:        st,
		StatusMessage: msg,
		SleepState:    stagepb.SleepState(u.sleep.Load()),
		Engine:        engine,
		Role:          role,
		InputRole:     stagepb.RoleText,
		Gauges:        u.gauges(),
	}
}

// scraped is one good scrape of the upstream's metrics and when it was read.
type scraped struct {
	Load
	at time.Time
}

// gauges is the latest scraped load as EngineStats snapshot fields, with
// its age: a scrape that fails keeps the previous load, which grows older
// until the head counts it unknown. When the upstream exposes no metrics,
// it is the load this worker put on it, measured now: its requests in
// flight as running (the worker queues none).
func (u *upstream) gauges() *stagepb.EngineStats {
	l := u.load.Load()
	if l == nil || u.noMetrics.Load() {
		return &stagepb.EngineStats{NumRequestsRunning: uint32(max(u.inFlight.Load(), 0))}
	}
	return &stagepb.EngineStats{
		NumRequestsRunning:         uint32(max(l.Running, 0)),
		NumRequestsWaitingCapacity: uint32(max(l.Waiting, 0)),
		KvCacheUsagePerc:           l.KVCacheUsage,
		GaugesAgeMs:                uint32(min(max(time.Since(l.at).Milliseconds(), 0), math.MaxUint32)),
	}
}

// takeCounters adds the prefix-cache and multimodal-cache counter
// increases scraped since the last call to s: each increase reaches the
// head exactly once, on whichever request's chunk comes next.
func (u *upstream) takeCounters(s *stagepb.EngineStats) {
	s.PrefixCacheQueries += u.pendingQueries.Swap(0)
	s.PrefixCacheHits += u.pendingHits.Swap(0)
	s.MmCacheQueries += u.pendingMMQueries.Swap(0)
	s.MmCacheHits += u.pendingMMHits.Swap(0)
}

// admit refuses a request the engine cannot run now.
func (u *upstream) admit() error {
	if st, msg := u.state(); st != stagepb.ServingStatus_SERVING_STATUS_SERVING {
		return status.Errorf(codes.Unavailable, "openai: upstream %s is unavailable: %s", u.root, msg)
	}
	if s := stagepb.SleepState(u.sleep.Load()); s != stagepb.SleepState_SLEEP_STATE_AWAKE {
		return status.Errorf(codes.FailedPrecondition, "openai: upstream is asleep (%s); wake it up first", sleepName(s))
	}
	return nil
}

// newRequest builds a request to the upstream with the API key.
func (u *upstream) newRequest(ctx context.Context, method, url string, body io.Reader) (*http.Request, error) {
	req, err := http.NewRequestWithContext(ctx, method, url, body)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "openai: build request: %v", err)
	}
	if u.cfg.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+u.cfg.APIKey)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	return req, nil
}

// do sends req. Transport failures are Unavailable (connection refused,
// timeouts, resets); the context's own error is returned as it is.
func (u *upstream) do(req *http.Request) (*http.Response, error) {
	resp, err := u.client.Do(req)
	if err != nil {
		if ctxErr := req.Context().Err(); ctxErr != nil {
			return nil, ctxErr
		}
		return nil, status.Errorf(codes.Unavailable, "openai: upstream %s %s: %v", req.Method, req.URL.Path, unwrapURLError(err))
	}
	return resp, nil
}

// postJSON posts v as JSON to the base URL's path.
func (u *upstream) postJSON(ctx context.Context, path string, v any) (*http.Response, error) {
	body, err := json.Marshal(v)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "openai: encode request: %v", err)
	}
	req, err := u.newRequest(ctx, http.MethodPost, u.base+path, strings.NewReader(string(body)))
	if err != nil {
		return nil, err
	}
	return u.do(req)
}

// drainLimit bounds what closeBody reads to let the connection be reused.
const drainLimit = 64 << 10

// closeBody reads what is left of a response (the end of a chunked body
// after [DONE], typically) so its connection goes back to the pool, then
// closes it. A response cut off by its context is just closed.
func closeBody(resp *http.Response) {
	if resp.Request.Context().Err() == nil {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, drainLimit))
	}
	_ = resp.Body.Close()
}

func unwrapURLError(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err
	}
	return err
}

// statusError turns a non-2xx upstream response into a gRPC status error
// that keeps its meaning: 400/413/422 are InvalidArgument with the
// upstream's message (the client gets a 400 carrying it); 408, 429, 502,
// 503 and 504 are Unavailable (the head may retry elsewhere); 401 and 403
// are Unauthenticated and PermissionDenied; other statuses (404
// included: the model went away at runtime) are Internal. It reads (a
// bounded part of) the body.
func statusError(resp *http.Response) error {
	body, _ := io.ReadAll(io.LimitReader(resp.Body, errorBodyLimit))
	msg := errorMessage(body)
	if msg == "" {
		msg = http.StatusText(resp.StatusCode)
	}
	var code codes.Code
	switch resp.StatusCode {
	case http.StatusBadRequest, http.StatusRequestEntityTooLarge, http.StatusUnprocessableEntity:
		return status.Error(codes.InvalidArgument, msg) // the upstream's words, as the client should see them
	case http.StatusRequestTimeout, http.StatusTooManyRequests, http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		code = codes.Unavailable
	case http.StatusUnauthorized:
		code = codes.Unauthenticated
	case http.StatusForbidden:
		code = codes.PermissionDenied
	default:
		code = codes.Internal
	}
	return status.Errorf(code, "openai: upstream %s %s: %d %s: %s", resp.Request.Method, resp.Request.URL.Path, resp.StatusCode, http.StatusText(resp.StatusCode), msg)
}

// errorMessage finds the human message in an error body: OpenAI's
// {"error":{"message"}}, vLLM's older {"object":"error","message"},
// FastAPI's {"detail": "..." | [{"msg", "loc"}]}, or the text itself.
func errorMessage(body []byte) string {
	var e struct {
		Error   json.RawMessage `json:"error"`
		Message string          `json:"message"`
		Detail  json.RawMessage `json:"detail"`
	}
	if json.Unmarshal(body, &e) == nil {
		var inner struct {
			Message string `json:"message"`
		}
		var s string
		switch {
		case len(e.Error) > 0 && json.Unmarshal(e.Error, &inner) == nil && inner.Message != "":
			return inner.Message
		case len(e.Error) > 0 && json.Unmarshal(e.Error, &s) == nil && s != "":
			return s
		case e.Message != "":
			return e.Message
		case len(e.Detail) > 0 && json.Unmarshal(e.Detail, &s) == nil:
			return s
		case len(e.Detail) > 0:
			var details []struct {
				Msg string `json:"msg"`
				Loc []any  `json:"loc"`
			}
			if json.Unmarshal(e.Detail, &details) == nil && len(details) > 0 {
				parts := make([]string, 0, len(details))
				for _, d := range details {
					loc := make([]string, 0, len(d.Loc))
					for _, l := range d.Loc {
						loc = append(loc, fmt.Sprint(l))
					}
					parts = append(parts, strings.Join(loc, ".")+": "+d.Msg)
				}
				return strings.Join(parts, "; ")
			}
		}
	}
	return strings.TrimSpace(string(body))
}

func sleepName(s stagepb.SleepState) string {
	switch s {
	case stagepb.SleepState_SLEEP_STATE_WEIGHTS_OFFLOADED:
		return "weights_offloaded"
	case stagepb.SleepState_SLEEP_STATE_DISCARD_ALL:
		return "discard_all"
	}
	return "awake"
}
