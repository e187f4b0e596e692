// Package worker is a stage replica: a gRPC StageService in front of an
// Engine, and its lifecycle in the cluster.
//
// Lifecycle (Server.Run): serve gRPC first, so the replica answers before
// anyone can route to it → register in etcd under a lease → serve until ctx
// ends → deregister (revoke the lease, so the head stops routing here) →
// refuse new work (Generate: Unavailable; Health: DRAINING; grpc health:
// NOT_SERVING) → let in-flight requests finish within DrainTimeout, then
// abort the rest → stop gRPC → return nil.
package worker

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/prometheus/client_golang/prometheus"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/pkg/clusterauth"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/telemetry"
)

// Engine runs requests for a Server. Its methods may be called concurrently.
type Engine interface {
	// Generate runs one request and calls emit for each chunk in order, the
	// final one carrying the finish reason and timings. Cancelling ctx must
	// abort the request in the engine. Errors should be gRPC status errors
	// (InvalidArgument for bad input, FailedPrecondition while asleep,
	// Unavailable while the engine is down); ctx errors and emit's errors
	// are passed through.
	Generate(ctx context.Context, req *stagepb.GenerateRequest, emit func(*stagepb.GenerateChunk) error) error
	// Health describes the engine; the Server overrides Status while
	// draining.
	Health() *stagepb.HealthResponse
	// Sleep puts the engine to sleep at level 1 or 2. ctx is the Sleep
	// RPC's.
	Sleep(ctx context.Context, level int) (stagepb.SleepState, error)
	// WakeUp wakes a sleeping engine. ctx is the WakeUp RPC's.
	WakeUp(ctx context.Context) (stagepb.SleepState, error)
}

// Availability is implemented by engines that can be down while the worker
// runs, such as an upstream server that is still loading its weights or has
// stopped answering. The Server registers the replica only while the engine
// is available, revokes the registration (so the head stops routing here)
// when it becomes unavailable, and registers again under the same replica
// id when it is back. Engines without it are always available.
type Availability interface {
	// Available reports whether the engine can take requests now, and a
	// channel that is closed at the next change.
	Available() (ok bool, changed <-chan struct{})
}

// modelNamer is implemented by engines that know their model's name (an
// upstream's, once it is ready); the Server records it when Config.Model
// is empty.
type modelNamer interface{ Model() string }

// Defaults for zero Config fields.
const (
	DefaultListen       = "127.0.0.1:0"
	DefaultDrainTimeout = 30 * time.Second
)

// Config configures a Server.
type Config struct {
	Stage     string // stage name, required
	ReplicaID uint32 // used unless AutoID
	AutoID    bool   // take the smallest free id of the stage
	// Listen is the gRPC listen address (default DefaultListen); port 0
	// picks a free port.
	Listen string
	// Advertise is the addr written to etcd. Empty: the bound address, or
	// os.Hostname() and the bound port when the listen host is unspecified
	// (0.0.0.0, [::] or empty). A missing or zero port is the bound port.
	Advertise    string
	Cluster      string        // default membership.DefaultCluster
	LeaseTTL     time.Duration // default membership's (10s)
	DrainTimeout time.Duration // how long in-flight requests may finish at shutdown; default 30s
	TLS          *tls.Config   // server TLS (see pkg/tlsconfig); nil: plaintext
	// ClusterToken, when set, must come with every RPC but the
	// grpc.health.v1 probes (see pkg/clusterauth); a caller without it
	// gets Unauthenticated. Empty: any caller that reaches the port is
	// served (mutual TLS, TLS with a CA, is then the only check).
	ClusterToken string
	Engine       Engine // required
	// Member record metadata.
	EngineName string // default: what Engine.Health reports
	Model      string
	Labels     map[string]string
	Version    string
	// EtcdClient registers the replica; nil serves without registering
	// (Registered is closed once serving).
	EtcdClient *clientv3.Client
	// Metrics, when set with an EtcdClient, gets the worker's etcd gauges:
	// troupe_etcd_up (its etcd probe, as the head's) and
	// troupe_lease_keepalive_lag_seconds (see docs/contracts.md). Serve it
	// on the worker's own metrics endpoint; never the global registry.
	Metrics prometheus.Registerer
	// MetricsAddr is the host:port of the worker's own /metrics, written
	// to its record (membership.Member.MetricsAddr) so heads list it in
	// /v1/replicas/sd; an empty or unspecified host takes the advertised
	// address's host. Empty: none.
	MetricsAddr string
	// Observer, when set, sees every Generate call (see Observer).
	Observer Observer
	Logger   *slog.Logger // default slog.Default()
	// MaxMessageBytes caps a received gRPC message (a request and its
	// prompt); default stagepb.DefaultMaxMessageBytes, which takes the
	// head's default body limit. gRPC's own default is 4 MiB.
	MaxMessageBytes int
	// ServerOptions are added after the Server's own (so they win): the
	// hook for interceptors and stats handlers, e.g. otelgrpc's.
	ServerOptions []grpc.ServerOption
	// LoadInterval is the least time between two load reports of a
	// SubscribeLoad stream (default DefaultLoadInterval).
	LoadInterval time.Duration
	// MaxTensorPushBytes caps the tensors of one engine chunk, sent worker
	// to worker as one push (default DefaultMaxTensorPushBytes); the
	// server also takes pushes this large.
	MaxTensorPushBytes int64
	// MaxRequestTensorBytes caps all the tensors of one request, which a
	// producer keeps until its consumer has them all (default
	// DefaultMaxRequestTensorBytes).
	MaxRequestTensorBytes int64
	// PeerDialOptions connect this worker to the workers its engine's
	// tensors go to: the transport credentials (the worker's certificate
	// as a client, with the cluster's CA) and the cluster token, as the
	// head's. Empty: plaintext, as without TLS.
	PeerDialOptions []grpc.DialOption
}

// Server is one stage replica. New binds its listener; Run serves it.
type Server struct {
	cfg       Config
	log       *slog.Logger
	role      string // what the engine gives
	inputRole string // what it takes
	lis       net.Listener
	advertise string
	grpc      *grpc.Server
	health    *health.Server
	instance  string // random id of this process, in Health (see stagepb.HealthResponse)

	mu       sync.Mutex
	inFlight int
	draining bool
	idle     chan struct{} // closed once draining with nothing in flight

	ran        atomic.Bool
	registered chan struct{} // closed once registered (or serving, without etcd)
	member     atomic.Pointer[membership.Member]
	reg        atomic.Pointer[membership.Registration] // nil without etcd or before registering
	etcdUp     prometheus.Gauge                        // nil without Config.Metrics; set by Run's etcd monitor

	// routed publishes the blocks heads routed here (routed.go).
	routed *routedHub
	// tensors holds the inboxes of consuming attempts; peers connects to
	// the consumers of this engine's tensors (tensors.go).
	tensors *tensorHub
	peers   *peerDialer

	// sleepMu serializes sleep state changes with their record updates, so
	// the record always ends with the engine's latest state.
	sleepMu sync.Mutex
}

// recordUpdateTimeout bounds how long a Sleep or WakeUp waits for etcd to
// hold the changed record before answering anyway.
const recordUpdateTimeout = 5 * time.Second

// New checks cfg and binds the listener, so Addr and Advertise are known
// before Run. Nothing is served until Run; if Run is never called, Close
// releases the listener.
func New(cfg Config) (*Server, error) {
	if cfg.Engine == nil {
		return nil, errors.New("worker: no engine")
	}
	if cfg.Listen == "" {
		cfg.Listen = DefaultListen
	}
	if cfg.Cluster == "" {
		cfg.Cluster = membership.DefaultCluster
	}
	if err := membership.ValidateCluster(cfg.Cluster); err != nil {
		return nil, err
	}
	if cfg.DrainTimeout <= 0 {
		cfg.DrainTimeout = DefaultDrainTimeout
	}
	if cfg.MaxMessageBytes <= 0 {
		cfg.MaxMessageBytes = stagepb.DefaultMaxMessageBytes
	}
	// A push travels as one gRPC message: its tensors and their framing
	// must fit MaxMessageBytes.
	pushRoom := int64(cfg.MaxMessageBytes) / 16 * 15
	if cfg.MaxTensorPushBytes <= 0 {
		cfg.MaxTensorPushBytes = min(DefaultMaxTensorPushBytes, pushRoom)
	}
	if cfg.MaxTensorPushBytes > pushRoom {
		return nil, fmt.Errorf("worker: a tensor push of %d bytes (--max-tensor-push-bytes) needs --max-message-bytes of at least %d", cfg.MaxTensorPushBytes, cfg.MaxTensorPushBytes/15*16+16)
	}
	if cfg.MaxRequestTensorBytes <= 0 {
		cfg.MaxRequestTensorBytes = DefaultMaxRequestTensorBytes
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	h := cfg.Engine.Health()
	if cfg.EngineName == "" {
		cfg.EngineName = h.GetEngine()
	}
	cfg.Labels = maps.Clone(cfg.Labels)
	s := &Server{
		cfg:        cfg,
		log:        cfg.Logger.With("stage", cfg.Stage),
		role:       h.GetRole(),
		inputRole:  h.EffectiveInputRole(),
		health:     health.NewServer(),
		routed:     newRoutedHub(),
		tensors:    newTensorHub(),
		peers:      newPeerDialer(cfg.PeerDialOptions),
		instance:   newInstanceID(),
		idle:       make(chan struct{}),
		registered: make(chan struct{}),
	}
	// Check the record before binding, with a placeholder addr.
	probe := s.record("127.0.0.1:1")
	if err := probe.Validate(); err != nil {
		return nil, fmt.Errorf("worker: %w", err)
	}
	lis, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("worker: %w", err) // "listen tcp ADDR: ..."
	}
	s.advertise, err = advertiseAddr(lis.Addr(), cfg.Advertise)
	if err != nil {
		lis.Close()
		return nil, err
	}
	if err := s.registerMetrics(); err != nil {
		lis.Close()
		return nil, err
	}
	s.lis = lis

	opts := []grpc.ServerOption{
		// Let the head keep idle connections alive with pings every 5s or more.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 5 * time.Second, PermitWithoutStream: true}),
		grpc.MaxRecvMsgSize(cfg.MaxMessageBytes),
	}
	if cfg.TLS != nil {
		opts = append(opts, grpc.Creds(credentials.NewTLS(cfg.TLS)))
	}
	if cfg.ClusterToken != "" {
		auth, err := clusterauth.ServerOptions(cfg.ClusterToken)
		if err != nil {
			lis.Close()
			return nil, fmt.Errorf("worker: %w", err)
		}
		opts = append(opts, auth...)
	}
	s.grpc = grpc.NewServer(append(opts, cfg.ServerOptions...)...)
	stagepb.RegisterStageServiceServer(s.grpc, &service{s: s})
	healthpb.RegisterHealthServer(s.grpc, s.health)
	s.health.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	s.health.SetServingStatus(stagepb.StageService_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_NOT_SERVING)
	return s, nil
}

// registerMetrics registers the etcd gauges on Config.Metrics (see
// Config.Metrics); nothing without it or without an etcd client.
func (s *Server) registerMetrics() error {
	if s.cfg.Metrics == nil || s.cfg.EtcdClient == nil {
		return nil
	}
	s.etcdUp = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "troupe_etcd_up",
		Help: "1 while the worker's etcd client gets answers to a linearizable read (probed every 2s), else 0.",
	})
	for _, c := range []prometheus.Collector{s.etcdUp, keepAliveLag{s}} {
		if err := s.cfg.Metrics.Register(c); err != nil {
			return fmt.Errorf("worker: register metrics: %w", err)
		}
	}
	return nil
}

// keepAliveLagDesc describes troupe_lease_keepalive_lag_seconds.
var keepAliveLagDesc = prometheus.NewDesc("troupe_lease_keepalive_lag_seconds",
	"Seconds since etcd last confirmed the replica's lease (its grant or a keepalive answer, asked every third of the TTL); absent while not registered. At the TTL the lease has expired.",
	nil, nil)

// keepAliveLag writes troupe_lease_keepalive_lag_seconds from the current
// registration at each scrape.
type keepAliveLag struct{ s *Server }

func (c keepAliveLag) Describe(ch chan<- *prometheus.Desc) { ch <- keepAliveLagDesc }

func (c keepAliveLag) Collect(ch chan<- prometheus.Metric) {
	reg := c.s.reg.Load()
	if reg == nil {
		return
	}
	ch <- prometheus.MustNewConstMetric(keepAliveLagDesc, prometheus.GaugeValue, time.Since(reg.LastKeepAlive()).Seconds())
}

// newInstanceID is a random 16-byte hex id.
func newInstanceID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	return hex.EncodeToString(b[:])
}

// record is the member record this replica registers.
func (s *Server) record(addr string) membership.Member {
	return membership.Member{
		Stage:                s.cfg.Stage,
		ReplicaID:            s.cfg.ReplicaID,
		Addr:                 addr,
		Engine:               s.cfg.EngineName,
		NumSpeculativeTokens: int(s.cfg.Engine.Health().GetNumSpeculativeTokens()),
		Version:              s.cfg.Version,
		StartedAt:            time.Now().UTC(),
		Model:                s.model(),
		Labels:               s.cfg.Labels,
		SleepState:           sleepStateName(s.cfg.Engine.Health().GetSleepState()),
		MetricsAddr:          metricsAddr(s.cfg.MetricsAddr, addr),
	}
}

// model is the model name for the member record: Config.Model, else the
// engine's own name for it, if it knows one.
func (s *Server) model() string {
	if s.cfg.Model != "" {
		return s.cfg.Model
	}
	if n, ok := s.cfg.Engine.(modelNamer); ok {
		return n.Model()
	}
	return ""
}

// sleepStateName is the record's name of a state; empty for a value the
// vocabulary does not know, which the record leaves out.
func sleepStateName(st stagepb.SleepState) string {
	if _, err := stagepb.ParseSleepState(st.Name()); err != nil {
		return ""
	}
	return st.Name()
}

// Addr is the bound listen address.
func (s *Server) Addr() net.Addr { return s.lis.Addr() }

// Advertise is the address registered in etcd.
func (s *Server) Advertise() string { return s.advertise }

// Registered is closed once the replica is registered (or, without an etcd
// client, serving). It is never closed if registration fails.
func (s *Server) Registered() <-chan struct{} { return s.registered }

// Member is the registered record, with its replica id; the zero Member
// before Registered is closed.
func (s *Server) Member() membership.Member {
	if m := s.member.Load(); m != nil {
		return *m
	}
	return membership.Member{}
}

// Close releases the listener of a Server whose Run was never called.
func (s *Server) Close() error {
	if s.ran.CompareAndSwap(false, true) {
		return s.lis.Close()
	}
	return nil
}

// Run serves until ctx ends, then drains and returns nil (see the package
// doc). It returns an error when the first registration fails for good (a
// duplicate replica id returns membership's *AlreadyRegisteredError
// unchanged; the record of this replica's previous process at the same
// address, killed within its lease, is taken back instead: see
// membership.RegisterConfig.Listener) or serving fails; a first
// registration that etcd did not answer (unreachable, no leader, too many
// requests) is retried with backoff (0.5 s to 10 s, each attempt bounded
// by 5 s), logged at every failure, until it succeeds or ctx ends. With an engine that implements
// Availability, the replica is registered only while the engine is
// available (see Availability); a later registration that fails is retried
// with backoff, never fatal. Run may be called once.
func (s *Server) Run(ctx context.Context) error {
	if !s.ran.CompareAndSwap(false, true) {
		return errors.New("worker: Run called twice, or after Close")
	}
	defer s.peers.Close()
	served := make(chan error, 1)
	go func() { served <- s.grpc.Serve(s.lis) }()
	s.log.Info("worker: serving", "listen", s.lis.Addr().String(), "advertise", s.advertise)
	if s.cfg.EtcdClient != nil {
		// Logs etcd's loss and recovery, which a worker otherwise shows
		// only once its lease is lost.
		mctx, stopMonitor := context.WithCancel(ctx)
		monitored := make(chan struct{})
		go func() {
			defer close(monitored)
			membership.MonitorEtcd(mctx, s.cfg.EtcdClient, membership.HealthConfig{
				Who: "worker " + s.cfg.Stage, Logger: s.log,
				OnChange: func(up bool) {
					if s.etcdUp == nil {
						return
					}
					v := 0.0
					if up {
						v = 1
					}
					s.etcdUp.Set(v)
				},
			})
		}()
		defer func() { stopMonitor(); <-monitored }()
	}

	reg, serveErr, err := s.maintain(ctx, served)
	if err != nil {
		s.health.Shutdown()
		s.grpc.Stop()
		<-served
		return err
	}
	// Draining first: a head that sees the record vanish asks Health, and
	// must hear DRAINING (stop routing, let in-flight work finish), not
	// SERVING (a lost lease, keep routing).
	n := s.Drain()
	s.deregister(reg)
	s.log.Info("worker: draining", "in_flight", n, "timeout", s.cfg.DrainTimeout)
	deadline := time.NewTimer(s.cfg.DrainTimeout)
	defer deadline.Stop()
	select {
	case <-s.idle:
		// Only instant RPCs and health watches can be left: give them a moment.
		s.stop(served, time.Second)
	case <-deadline.C:
		s.mu.Lock()
		left := s.inFlight
		s.mu.Unlock()
		s.log.Warn("worker: drain timeout; aborting in-flight requests", "in_flight", left)
		s.stop(served, 0)
	}
	if serveErr != nil {
		return fmt.Errorf("worker: serve: %w", serveErr)
	}
	s.log.Info("worker: stopped")
	return nil
}

// newReregisterBackoff is the schedule of retries after a failed
// re-registration: 500ms doubling to 10s.
func newReregisterBackoff() *backoff.ExponentialBackOff {
	return &backoff.ExponentialBackOff{InitialInterval: 500 * time.Millisecond, Multiplier: 2, MaxInterval: 10 * time.Second}
}

// maintain keeps the replica in rotation exactly while the engine is
// available, until ctx ends or gRPC stops serving. It returns the live
// registration (nil when none), the serve error, and the error of a first
// registration that failed (then nothing else).
func (s *Server) maintain(ctx context.Context, served chan error) (reg *membership.Registration, serveErr, err error) {
	inRotation := false
	attempts := 0 // failed first registrations
	wait := newReregisterBackoff()
	var retry *time.Timer
	defer func() {
		if retry != nil {
			retry.Stop()
		}
	}()
	for {
		ok, changed := s.available()
		s.setServing(ok)
		switch {
		case ok && !inRotation && retry == nil && !s.isDraining():
			r, rerr := s.register(ctx)
			first := s.member.Load() == nil
			switch {
			case rerr == nil:
				reg, inRotation = r, true
				wait.Reset()
				s.reg.Store(r)
				if s.isDraining() { // the Drain RPC came while registering
					s.deregister(r)
				}
				m := s.record(s.advertise)
				if r != nil {
					m = r.Member()
				}
				s.member.Store(&m)
				if first {
					close(s.registered)
					s.log.Info("worker: ready", "replica", m.ReplicaID, "addr", s.advertise, "cluster", s.cfg.Cluster)
				} else {
					s.log.Info("worker: engine available again; back in rotation", "replica", m.ReplicaID)
				}
			case ctx.Err() != nil:
				return nil, nil, nil // asked to stop while registering
			case first && !transientRegisterError(rerr):
				return nil, nil, rerr
			case first:
				attempts++
				in := wait.NextBackOff()
				s.log.Warn("worker: registration failed; retrying", "err", rerr, "attempts", attempts, "in", in)
				retry = time.NewTimer(in)
			default:
				in := wait.NextBackOff()
				s.log.Warn("worker: re-registration failed; retrying", "err", rerr, "in", in)
				retry = time.NewTimer(in)
			}
		case !ok && inRotation:
			s.log.Warn("worker: engine unavailable; leaving rotation", "reason", s.cfg.Engine.Health().GetStatusMessage())
			s.deregister(reg)
			s.reg.Store(nil)
			reg, inRotation = nil, false
		}
		var retryC <-chan time.Time
		if retry != nil {
			retryC = retry.C
		}
		select {
		case <-ctx.Done():
			return reg, nil, nil
		case serveErr = <-served:
			served <- serveErr // for the wait in stop
			return reg, serveErr, nil
		case <-changed:
		case <-retryC:
			retry = nil
		}
	}
}

// available asks the engine's Availability, if it has one.
func (s *Server) available() (bool, <-chan struct{}) {
	if a, ok := s.cfg.Engine.(Availability); ok {
		return a.Available()
	}
	return true, nil
}

// setServing sets the grpc health services; after Drain it changes nothing.
func (s *Server) setServing(ok bool) {
	st := healthpb.HealthCheckResponse_NOT_SERVING
	if ok {
		st = healthpb.HealthCheckResponse_SERVING
	}
	s.health.SetServingStatus("", st)
	s.health.SetServingStatus(stagepb.StageService_ServiceDesc.ServiceName, st)
}

// register writes the member record; without an etcd client it only
// returns (nil, nil). After the first registration the replica id is
// fixed, so a replica that comes back keeps its id.
func (s *Server) register(ctx context.Context) (*membership.Registration, error) {
	if s.cfg.EtcdClient == nil {
		return nil, nil
	}
	m := s.record(s.advertise)
	auto := s.cfg.AutoID
	if prev := s.member.Load(); prev != nil {
		m.ReplicaID, auto = prev.ReplicaID, false
	}
	// Bounded: with etcd unreachable, the client would wait for it as
	// long as ctx lives; maintain retries instead, and says so.
	ctx, cancel := context.WithTimeout(ctx, registerAttemptTimeout)
	defer cancel()
	return membership.Register(ctx, s.cfg.EtcdClient, membership.RegisterConfig{
		Cluster: s.cfg.Cluster,
		Member:  m,
		AutoID:  auto,
		TTL:     s.cfg.LeaseTTL,
		Logger:  s.cfg.Logger,
		// A record left at this addr by a killed predecessor is taken back.
		Listener: s.lis,
	})
}

// registerAttemptTimeout bounds one registration attempt.
const registerAttemptTimeout = 5 * time.Second

// transientRegisterError reports whether a failed registration may succeed
// when tried again: etcd did not answer in time, is unreachable, has no
// leader, or is overloaded ("too many requests"). A live holder of the
// replica id (membership.ErrAlreadyRegistered), an invalid record or a
// stage with no free id is not: retrying would not change it.
func transientRegisterError(err error) bool {
	if errors.Is(err, membership.ErrAlreadyRegistered) {
		return false
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	code := status.Code(err)
	var ee rpctypes.EtcdError
	if errors.As(err, &ee) {
		code = ee.Code()
	}
	switch code {
	case codes.Unavailable, codes.DeadlineExceeded, codes.ResourceExhausted, codes.Aborted:
		return true
	}
	return false
}

// deregister revokes the lease, bounded, so the record goes at once.
func (s *Server) deregister(reg *membership.Registration) {
	if reg == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := reg.Close(ctx); err != nil {
		s.log.Warn("worker: deregister", "err", err)
	}
}

// stop stops gRPC gracefully within grace, then hard (which cancels the
// contexts of RPCs still running, aborting them in the engine), and waits
// for Serve to return.
func (s *Server) stop(served <-chan error, grace time.Duration) {
	graceful := make(chan struct{})
	go func() {
		s.grpc.GracefulStop()
		close(graceful)
	}()
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-graceful:
	case <-t.C:
		s.grpc.Stop()
		<-graceful
	}
	<-served
}

// Drain makes the replica refuse new work while in-flight requests go on,
// and deregisters it, so every head stops routing here. It returns how
// many are in flight; calling it again is harmless.
func (s *Server) Drain() int {
	n := s.refuseNew()
	s.deregister(s.reg.Load())
	return n
}

// refuseNew is Drain without deregistering.
func (s *Server) refuseNew() int {
	s.mu.Lock()
	first := !s.draining
	s.draining = true
	n := s.inFlight
	if first && n == 0 {
		close(s.idle)
	}
	s.mu.Unlock()
	if first {
		s.health.Shutdown() // every service NOT_SERVING from now on
		s.log.Info("worker: refusing new requests", "in_flight", n)
	}
	return n
}

func (s *Server) acquire() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.draining {
		return false
	}
	s.inFlight++
	return true
}

func (s *Server) release() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.inFlight--
	if s.draining && s.inFlight == 0 {
		close(s.idle)
	}
}

func (s *Server) isDraining() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.draining
}

// service implements StageService for a Server.
type service struct {
	stagepb.UnimplementedStageServiceServer
	s *Server
}

// Generate implements StageService.
func (svc *service) Generate(req *stagepb.GenerateRequest, stream grpc.ServerStreamingServer[stagepb.GenerateChunk]) error {
	s := svc.s
	if err := s.checkInput(req); err != nil {
		return err
	}
	if !s.acquire() {
		return stagepb.DrainingError("worker: replica is draining and takes no new requests")
	}
	defer s.release()
	return s.generate(stream.Context(), req, stream.Send, nil)
}

// generate runs a request whose input is whole, sending its chunks with
// sendChunk. before, when set, sees each chunk first and may change it or
// fail the request (the producer of tensors, GenerateStream).
func (s *Server) generate(ctx context.Context, req *stagepb.GenerateRequest, sendChunk func(*stagepb.GenerateChunk) error, before func(*stagepb.GenerateChunk) error) error {
	s.routed.publish(req.GetRoutedBlocks())
	start := time.Now()
	var timings *stagepb.Timings
	obs := s.observe(req, start)
	send, flush := newOutputHolder(req, sendChunk)
	err := s.cfg.Engine.Generate(ctx, req, func(c *stagepb.GenerateChunk) error {
		if before != nil {
			if err := before(c); err != nil {
				return err
			}
		}
		if c.GetTimings() != nil {
			timings = c.GetTimings()
		}
		obs.chunk(c)
		return send(c)
	})
	if ferr := flush(); err == nil {
		err = ferr
	}
	obs.end(ctx, err)
	if timings != nil {
		recordPhases(ctx, start, timings)
	}
	return toStatus(err)
}

// checkInput refuses an input kind the engine cannot take (see
// InputRole).
func (s *Server) checkInput(req *stagepb.GenerateRequest) error {
	var kind string
	switch req.GetInput().(type) {
	case *stagepb.GenerateRequest_Text:
		kind = "text"
	case *stagepb.GenerateRequest_Chat:
		kind = "chat"
	case *stagepb.GenerateRequest_TokenIds:
		kind = "token_ids"
	case *stagepb.GenerateRequest_Codes:
		kind = "codes"
	case nil:
		if s.inputRole == stagepb.RoleTensors {
			return nil // its input comes worker to worker (tensor_ticket)
		}
		return status.Error(codes.InvalidArgument, "request has no input (text, chat, token_ids or codes)")
	}
	want := ""
	switch s.inputRole {
	case stagepb.RoleCodes:
		if kind != "codes" {
			want = "codes"
		}
	default:
		if kind == "codes" {
			want = "text, chat or token_ids"
		}
	}
	if want != "" {
		return status.Errorf(codes.InvalidArgument, "stage %s (role %s) takes %s input, got %s", s.cfg.Stage, s.role, want, kind)
	}
	return nil
}

// toStatus turns an engine error into a gRPC status error.
func toStatus(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, err.Error())
	case errors.Is(err, context.DeadlineExceeded):
		return status.Error(codes.DeadlineExceeded, err.Error())
	}
	if st, ok := status.FromError(err); ok {
		return st.Err()
	}
	return status.Error(codes.Internal, err.Error())
}

// recordPhases adds the engine's queue, prefill and decode as child spans
// of the RPC's span (set by a stats handler such as otelgrpc's), laid end
// to end from the start of the call.
func recordPhases(ctx context.Context, start time.Time, t *stagepb.Timings) {
	parent := trace.SpanFromContext(ctx)
	if !parent.SpanContext().IsValid() {
		return
	}
	tracer := parent.TracerProvider().Tracer("github.com/troupe-serving/troupe/worker")
	at := start
	for _, ph := range []struct {
		name    string
		seconds float64
	}{{telemetry.SpanQueue, t.GetQueueSeconds()}, {telemetry.SpanPrefill, t.GetPrefillSeconds()}, {telemetry.SpanDecode, t.GetDecodeSeconds()}} {
		end := at.Add(time.Duration(ph.seconds * float64(time.Second)))
		_, span := tracer.Start(ctx, ph.name, trace.WithTimestamp(at))
		span.End(trace.WithTimestamp(end))
		at = end
	}
}

// Health implements StageService.
func (svc *service) Health(context.Context, *stagepb.HealthRequest) (*stagepb.HealthResponse, error) {
	s := svc.s
	h := s.cfg.Engine.Health()
	h.Stage = s.cfg.Stage
	_, h.CacheSubscription = s.cacheReporter(h)
	h.LoadSubscription = true
	h.RoutedSubscription = true
	// Who it is, once it knows its id: with AutoID, the record is in etcd
	// (and a head may probe) a moment before Register returns the id.
	// Without an instance id the head checks nothing, as for older workers.
	if m := s.member.Load(); m != nil {
		h.ReplicaId, h.InstanceId = m.ReplicaID, s.instance
	} else if !s.cfg.AutoID {
		h.ReplicaId, h.InstanceId = s.cfg.ReplicaID, s.instance
	}
	if s.isDraining() {
		h.Status = stagepb.ServingStatus_SERVING_STATUS_DRAINING
	} else if h.GetStatus() == stagepb.ServingStatus_SERVING_STATUS_UNSPECIFIED {
		h.Status = stagepb.ServingStatus_SERVING_STATUS_SERVING
	}
	return h, nil
}

// Sleep implements StageService.
func (svc *service) Sleep(ctx context.Context, req *stagepb.SleepRequest) (*stagepb.SleepResponse, error) {
	s := svc.s
	if _, err := stagepb.SleepStateForLevel(int(req.GetLevel())); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "worker: %v", err)
	}
	level := int(req.GetLevel())
	st, err := s.changeSleep(ctx, func() (stagepb.SleepState, error) {
		cur := s.cfg.Engine.Health().GetSleepState()
		if err := sleepTransition(cur, level); err != nil {
			return cur, err
		}
		if cur != stagepb.SleepState_SLEEP_STATE_AWAKE {
			return cur, nil // asleep at this level already: nothing to do
		}
		return s.cfg.Engine.Sleep(ctx, level)
	})
	if err != nil {
		return nil, toStatus(err)
	}
	if st == stagepb.SleepState_SLEEP_STATE_DISCARD_ALL {
		s.routed.clear() // the cache is gone: so are the blocks routed here
	}
	s.log.Info("worker: asleep", "level", level)
	return &stagepb.SleepResponse{SleepState: st}, nil
}

// WakeUp implements StageService.
func (svc *service) WakeUp(ctx context.Context, _ *stagepb.WakeUpRequest) (*stagepb.WakeUpResponse, error) {
	st, err := svc.s.changeSleep(ctx, func() (stagepb.SleepState, error) { return svc.s.cfg.Engine.WakeUp(ctx) })
	if err != nil {
		return nil, toStatus(err)
	}
	return &stagepb.WakeUpResponse{SleepState: st}, nil
}

// sleepTransition says whether a replica in state cur may be put to sleep
// at level. An awake replica may; one asleep at that level already is left
// as it is (a repeated call succeeds, idempotent); one asleep at the other
// level is refused with FailedPrecondition, whose message the head shows
// the API client (409): going from level 2 to 1 would need the weights
// reloaded, and vLLM ignores a sleep while asleep, so the answer would
// claim a state the engine is not in. Wake it first.
func sleepTransition(cur stagepb.SleepState, level int) error {
	want, err := stagepb.SleepStateForLevel(level)
	if err != nil || cur == stagepb.SleepState_SLEEP_STATE_AWAKE || cur == want {
		return err
	}
	return status.Errorf(codes.FailedPrecondition,
		"the replica is asleep at level %d (%s); wake it up first (POST …/wake_up), then put it to sleep at level %d",
		sleepLevel(cur), cur.Name(), level)
}

// sleepLevel is the level a sleep state is reached by (0 for awake).
func sleepLevel(st stagepb.SleepState) int {
	for level := stagepb.SleepLevelOffload; level <= stagepb.SleepLevelDiscard; level++ {
		if s, _ := stagepb.SleepStateForLevel(level); s == st {
			return level
		}
	}
	return 0
}

// changeSleep runs change (the engine's Sleep or WakeUp) and writes the
// state it ends in into the member record: the record is what every head
// routes by, so a sleep asked through one head is respected by all. It
// answers once etcd holds the record, or after recordUpdateTimeout (the
// record is then written when etcd answers).
func (s *Server) changeSleep(ctx context.Context, change func() (stagepb.SleepState, error)) (stagepb.SleepState, error) {
	s.sleepMu.Lock()
	defer s.sleepMu.Unlock()
	st, err := change()
	if err != nil {
		return st, err
	}
	reg := s.reg.Load()
	name := sleepStateName(st)
	if reg == nil || name == "" {
		return st, nil
	}
	uctx, cancel := context.WithTimeout(ctx, recordUpdateTimeout)
	defer cancel()
	if err := reg.Update(uctx, func(m *membership.Member) { m.SleepState = name }); err != nil {
		s.log.Warn("worker: sleep state not in the member record yet; heads learn it once etcd answers", "sleep_state", name, "err", err)
	}
	return st, nil
}

// Drain implements StageService: see Server.Drain.
func (svc *service) Drain(context.Context, *stagepb.DrainRequest) (*stagepb.DrainResponse, error) {
	return &stagepb.DrainResponse{InFlight: uint32(svc.s.Drain())}, nil
}

// advertiseAddr decides the address registered in etcd.
func advertiseAddr(bound net.Addr, advertise string) (string, error) {
	_, port, err := net.SplitHostPort(bound.String())
	if err != nil {
		return "", fmt.Errorf("worker: bound address %q: %w", bound, err)
	}
	if advertise != "" {
		host, p, err := net.SplitHostPort(advertise)
		if err != nil {
			// No port: a bare host name or IP (IPv6 with or without brackets).
			host = strings.TrimSuffix(strings.TrimPrefix(advertise, "["), "]")
			if strings.Contains(host, ":") && net.ParseIP(host) == nil {
				return "", fmt.Errorf("worker: invalid --advertise %q: %w", advertise, err)
			}
			p = ""
		}
		if host == "" {
			return "", fmt.Errorf("worker: invalid --advertise %q: no host", advertise)
		}
		if p == "" || p == "0" {
			p = port
		}
		return net.JoinHostPort(host, p), nil
	}
	host, _, _ := net.SplitHostPort(bound.String())
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		name, err := os.Hostname()
		if err != nil {
			return "", fmt.Errorf("worker: listening on all interfaces and no --advertise: %w", err)
		}
		host = name
	}
	return net.JoinHostPort(host, port), nil
}
