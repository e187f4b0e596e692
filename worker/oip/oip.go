// Package oip serves a stage from an engine process that speaks the Open
// Inference Protocol's gRPC service (KServe v2, with Triton's
// ModelStreamInfer for decoupled models): Triton Inference Server, or a
// model behind troupe_engine. docs/contracts.md, "Engine protocol
// (--engine oip)", is the mapping; this package implements it.
//
// The Engine watches its engine process (Run): the worker registers only
// once ServerReady and ModelReady say yes and ModelMetadata has been read,
// leaves rotation after HealthFailures failed checks in a row and comes
// back when the engine does (worker.Availability). The model's metadata
// decides the stage's roles, so the worker must not be built before Ready
// is closed.
//
// Each request (each segment of a fed stage's input) is one
// ModelInferRequest on a ModelStreamInfer stream of its own, opened with
// the request's context: cancelling the request cancels the stream, which
// the engine process sees as the request's cancellation. Nothing is
// retried here; the head owns the retry rule.
package oip

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/pkg/oippb"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// EngineName is the engine's name, as Health reports it and --engine
// takes it.
const EngineName = "oip"

// Defaults for zero Config fields.
const (
	DefaultReadyTimeout    = 10 * time.Minute
	DefaultHealthInterval  = 5 * time.Second
	DefaultHealthFailures  = 3
	DefaultMaxMessageBytes = 64 << 20
)

// readyPoll is how often the engine is polled until it is first ready;
// readyLogEvery is how often the wait is logged.
const (
	readyPoll     = time.Second
	readyLogEvery = 10 * time.Second
)

// Config configures an Engine.
type Config struct {
	// Upstream is the engine process's address: unix:///path/engine.sock
	// or host:port (see CheckAddr). Required.
	Upstream string
	// Model is the OIP model name. Required.
	Model string
	// ReadyTimeout bounds the wait for the engine to be first ready
	// (default DefaultReadyTimeout); Run fails after it.
	ReadyTimeout time.Duration
	// HealthInterval is the period of the health checks once ready
	// (default DefaultHealthInterval).
	HealthInterval time.Duration
	// HealthFailures is how many failed checks in a row make the engine
	// unavailable (default DefaultHealthFailures); one success makes it
	// available again.
	HealthFailures int
	// MetricsURL, when set, is the engine's Prometheus metrics (Triton's:
	// http://127.0.0.1:8002/metrics), scraped at every health check for
	// the model's PendingMetric, which then reports the engine's queue as
	// the load (see Health). A scrape that fails never makes the engine
	// unavailable. Empty: the load is what this worker has in flight.
	MetricsURL string
	// MaxMessageBytes caps a message to or from the engine (default
	// DefaultMaxMessageBytes): audio and tensors are large.
	MaxMessageBytes int
	// DialOptions are added after the engine's own (insecure credentials,
	// the message caps), so they win: the hook for a stats handler such
	// as otelgrpc's.
	DialOptions []grpc.DialOption
	Logger      *slog.Logger // default slog.Default()
}

// CheckAddr checks an engine address: unix:///path (an absolute path) or
// host:port (port 1 to 65535).
func CheckAddr(addr string) error {
	if path, ok := strings.CutPrefix(addr, "unix://"); ok {
		if !strings.HasPrefix(path, "/") || len(path) < 2 {
			return fmt.Errorf("oip: upstream %q: want unix:///absolute/path/engine.sock", addr)
		}
		return nil
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("oip: upstream %q: want unix:///path/engine.sock or host:port: %w", addr, err)
	}
	if host == "" || strings.ContainsAny(host, "/ ") {
		return fmt.Errorf("oip: upstream %q: no host", addr)
	}
	if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 {
		return fmt.Errorf("oip: upstream %q: port must be 1 to 65535", addr)
	}
	return nil
}

// Engine is a stage served by an OIP engine process. Run must be running
// for it to become available. Its methods may be called concurrently.
type Engine struct {
	cfg    Config
	log    *slog.Logger
	conn   *grpc.ClientConn
	client oippb.GRPCInferenceServiceClient

	model     atomic.Pointer[model] // nil until first ready
	ready     chan struct{}         // closed once model is set
	readyOnce sync.Once

	mu        sync.Mutex
	available bool
	message   string        // why not available
	changed   chan struct{} // closed and replaced at every availability change

	inFlight atomic.Int32 // requests this worker has at the engine

	http        *http.Client            // scrapes MetricsURL
	scraped     atomic.Pointer[scraped] // latest good scrape; nil when none or the latest failed
	scrapeState scrapeState             // Run's goroutine only
}

// New checks cfg and makes the client; it dials lazily, so nothing is
// sent until Run or Generate. Close releases the connection.
func New(cfg Config) (*Engine, error) {
	if cfg.Model == "" {
		return nil, errors.New("oip: no model name")
	}
	if err := CheckAddr(cfg.Upstream); err != nil {
		return nil, err
	}
	if cfg.MetricsURL != "" {
		if err := CheckMetricsURL(cfg.MetricsURL); err != nil {
			return nil, err
		}
	}
	if cfg.ReadyTimeout <= 0 {
		cfg.ReadyTimeout = DefaultReadyTimeout
	}
	if cfg.HealthInterval <= 0 {
		cfg.HealthInterval = DefaultHealthInterval
	}
	if cfg.HealthFailures <= 0 {
		cfg.HealthFailures = DefaultHealthFailures
	}
	if cfg.MaxMessageBytes <= 0 {
		cfg.MaxMessageBytes = DefaultMaxMessageBytes
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	opts := append([]grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()), // a local engine process
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(cfg.MaxMessageBytes), grpc.MaxCallSendMsgSize(cfg.MaxMessageBytes)),
		// A failed stream is the head's to retry, elsewhere.
		grpc.WithDisableRetry(),
	}, cfg.DialOptions...)
	conn, err := grpc.NewClient(cfg.Upstream, opts...)
	if err != nil {
		return nil, fmt.Errorf("oip: upstream %s: %w", cfg.Upstream, err)
	}
	return &Engine{
		cfg:     cfg,
		log:     cfg.Logger,
		conn:    conn,
		client:  oippb.NewGRPCInferenceServiceClient(conn),
		ready:   make(chan struct{}),
		changed: make(chan struct{}),
		message: "engine not checked yet",
		http:    &http.Client{Transport: http.DefaultTransport.(*http.Transport).Clone()},
	}, nil
}

// Close releases the connection to the engine process. Call it once Run
// has returned and no Generate runs.
func (e *Engine) Close() error {
	e.http.CloseIdleConnections()
	return e.conn.Close()
}

// Model is the OIP model name (the worker records it in its member
// record when none is given).
func (e *Engine) Model() string { return e.cfg.Model }

// Ready is closed once the engine process was first ready and its
// model's metadata read: from then on Health reports the stage's roles.
// Build the worker.Server after it, since the server takes the roles it
// checks input against from the first Health.
func (e *Engine) Ready() <-chan struct{} { return e.ready }

// ContinuesInput implements worker.Continuer: a model that takes codes or
// tensors, or declares a context input, runs a fed input in segments.
func (e *Engine) ContinuesInput() bool {
	m := e.model.Load()
	return m != nil && m.continues()
}

// Available implements worker.Availability.
func (e *Engine) Available() (bool, <-chan struct{}) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.available, e.changed
}

func (e *Engine) setAvailable(ok bool, why string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.message = why
	if e.available == ok {
		return
	}
	e.available = ok
	close(e.changed)
	e.changed = make(chan struct{})
}

// state is the serving status and its reason, for Health.
func (e *Engine) state() (stagepb.ServingStatus, string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.available {
		return stagepb.ServingStatus_SERVING_STATUS_SERVING, ""
	}
	return stagepb.ServingStatus_SERVING_STATUS_NOT_SERVING, e.message
}

// Health reports the engine's availability (NOT_SERVING with the reason
// while ServerReady or ModelReady fail), the roles and named tensors its
// model's metadata gives, and the load: the requests this worker has at
// the engine (the protocol reports no load), or with MetricsURL the
// engine's own queue (see gauges).
func (e *Engine) Health() *stagepb.HealthResponse {
	st, msg := e.state()
	h := &stagepb.HealthResponse{
		Status:        st,
		StatusMessage: msg,
		SleepState:    stagepb.SleepState_SLEEP_STATE_AWAKE,
		Engine:        EngineName,
		Gauges:        e.gauges(),
	}
	if m := e.model.Load(); m != nil {
		h.Role, h.InputRole = m.role, m.inputRole
		h.OutputTensors, h.InputTensors = m.outputTensors, m.inputTensors
		if m.inputRole == stagepb.RoleAudio {
			h.InputParts = []string{stagepb.PartAudio}
		}
	}
	return h
}

// Sleep is not supported: the protocol has no sleep mode.
func (e *Engine) Sleep(context.Context, int) (stagepb.SleepState, error) {
	return stagepb.SleepState_SLEEP_STATE_AWAKE, status.Error(codes.Unimplemented, "the oip engine has no sleep mode (the Open Inference Protocol has none)")
}

// WakeUp is a no-op: the engine never sleeps.
func (e *Engine) WakeUp(context.Context) (stagepb.SleepState, error) {
	return stagepb.SleepState_SLEEP_STATE_AWAKE, nil
}

// errFatal marks errors that waiting will not fix.
type errFatal struct{ err error }

func (e errFatal) Error() string { return e.err.Error() }
func (e errFatal) Unwrap() error { return e.err }

// Run watches the engine process until ctx ends. First it waits, at most
// ReadyTimeout, until ServerReady and ModelReady say yes, then reads the
// model's metadata (a model troupe cannot map fails Run at once) and
// closes Ready. Then, every HealthInterval, it checks ServerReady and
// ModelReady, and scrapes MetricsURL when set (whose failures do not
// count): HealthFailures failed checks in a row make the engine
// unavailable; the next success reads the metadata again and makes it
// available, unless the model's roles changed (the worker checks input
// against the roles it started with: restart it). Run returns nil when
// ctx ends. Call it once.
func (e *Engine) Run(ctx context.Context) error {
	if err := e.waitReady(ctx); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	m := e.model.Load()
	e.log.Info("oip: engine ready", "upstream", e.cfg.Upstream, "model", e.cfg.Model,
		"role", m.role, "input_role", m.inputRole, "output_tensors", m.outputTensors, "input_tensors", m.inputTensors)
	e.setAvailable(true, "")
	e.scrape(ctx)

	tick := time.NewTicker(e.cfg.HealthInterval)
	defer tick.Stop()
	failures := 0
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		err := e.check(ctx)
		e.scrape(ctx)
		if err == nil && failures >= e.cfg.HealthFailures {
			err = e.readModel(ctx) // back after an outage: the model may have been reloaded
		}
		if ctx.Err() != nil {
			return nil
		}
		if err == nil {
			if failures >= e.cfg.HealthFailures {
				e.log.Info("oip: engine healthy again", "upstream", e.cfg.Upstream, "after_failures", failures)
			}
			failures = 0
			e.setAvailable(true, "")
			continue
		}
		failures++
		e.log.Debug("oip: engine health check failed", "upstream", e.cfg.Upstream, "failures", failures, "err", err)
		if failures == e.cfg.HealthFailures {
			e.log.Warn("oip: engine unhealthy; leaving rotation", "upstream", e.cfg.Upstream, "failures", failures, "err", err)
		}
		if failures >= e.cfg.HealthFailures {
			e.setAvailable(false, fmt.Sprintf("%d health checks failed in a row: %v", failures, err))
		}
	}
}

// waitReady polls until the engine is ready and its model read.
func (e *Engine) waitReady(ctx context.Context) error {
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, e.cfg.ReadyTimeout)
	defer cancel()
	tick := time.NewTicker(readyPoll)
	defer tick.Stop()
	var lastLog time.Time
	var lastErr error // the last check that failed on its own, not cut by the deadline
	for {
		err := e.check(ctx)
		if err == nil {
			err = e.readModel(ctx)
		}
		if err == nil {
			return nil
		}
		if fe := (errFatal{}); errors.As(err, &fe) {
			return fe.err
		}
		if ctx.Err() == nil || lastErr == nil {
			lastErr = err
		}
		e.setAvailable(false, "not ready: "+lastErr.Error())
		if time.Since(lastLog) >= readyLogEvery {
			lastLog = time.Now()
			e.log.Info("oip: waiting for the engine to be ready", "upstream", e.cfg.Upstream, "model", e.cfg.Model,
				"waited", time.Since(start).Round(time.Second), "timeout", e.cfg.ReadyTimeout, "last_err", err)
		}
		select {
		case <-ctx.Done():
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return fmt.Errorf("oip: engine %s not ready after %s (--upstream-ready-timeout): %w", e.cfg.Upstream, e.cfg.ReadyTimeout, lastErr)
			}
			return ctx.Err()
		case <-tick.C:
		}
	}
}

// checkTimeout bounds one health check.
func (e *Engine) checkTimeout() time.Duration { return max(e.cfg.HealthInterval, 2*time.Second) }

// check asks ServerReady and ModelReady.
func (e *Engine) check(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, e.checkTimeout())
	defer cancel()
	sr, err := e.client.ServerReady(ctx, &oippb.ServerReadyRequest{})
	if err != nil {
		return fmt.Errorf("ServerReady: %s", status.Convert(err).Message())
	}
	if !sr.GetReady() {
		return errors.New("server not ready")
	}
	mr, err := e.client.ModelReady(ctx, &oippb.ModelReadyRequest{Name: e.cfg.Model})
	if err != nil {
		return fmt.Errorf("ModelReady %q: %s", e.cfg.Model, status.Convert(err).Message())
	}
	if !mr.GetReady() {
		return fmt.Errorf("model %q not ready", e.cfg.Model)
	}
	return nil
}

// readModel reads the model's metadata. The first read sets the roles and
// closes Ready; a later one must give the same roles.
func (e *Engine) readModel(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, e.checkTimeout())
	defer cancel()
	md, err := e.client.ModelMetadata(ctx, &oippb.ModelMetadataRequest{Name: e.cfg.Model})
	if err != nil {
		return fmt.Errorf("ModelMetadata %q: %s", e.cfg.Model, status.Convert(err).Message())
	}
	m, err := modelOf(md)
	if err != nil {
		return errFatal{fmt.Errorf("oip: model %q: %w", e.cfg.Model, err)}
	}
	if m.name == "" {
		m.name = e.cfg.Model
	}
	if prev := e.model.Load(); prev != nil && !prev.sameRoles(m) {
		// Not fatal: the worker keeps serving its in-flight requests and
		// stays out of rotation until it is restarted.
		return fmt.Errorf("the model's roles changed (%s → %s to %s → %s, or its named tensors): restart the worker", prev.inputRole, prev.role, m.inputRole, m.role)
	}
	if len(m.skippedInputs) > 0 || len(m.skippedOutputs) > 0 {
		e.log.Warn("oip: the model declares tensors of a datatype troupe does not carry: it never sends such an input and drops such an output",
			"model", e.cfg.Model, "inputs", m.skippedInputs, "outputs", m.skippedOutputs)
	}
	e.model.Store(m)
	e.readyOnce.Do(func() { close(e.ready) })
	return nil
}
