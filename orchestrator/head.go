// Package orchestrator is the head: it turns membership events into engine
// indexes, bound metric series and routable replicas, in that order, and
// walks requests through the pipeline's stages.
package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/internal/core/stats"
	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/telemetry"
)

// Defaults of Config.
const (
	DefaultProbeTimeout   = 3 * time.Second
	DefaultLeaseLossGrace = 15 * time.Second
	DefaultStallTimeout   = 5 * time.Second
)

// Dialer opens a client connection to a replica's address, for example
// grpc.NewClient with the head's dial options.
type Dialer func(addr string) (*grpc.ClientConn, error)

// BreakerConfig configures the circuit breaker: a replica whose attempts
// fail Failures times in a row is ejected from routing for Backoff,
// doubling with each ejection in a row up to MaxBackoff. A success closes
// the breaker and resets the back-off. Zero fields take the defaults.
type BreakerConfig struct {
	Failures   int           // default 3
	Backoff    time.Duration // default 1s
	MaxBackoff time.Duration // default 30s, at least Backoff
}

// Config configures a Head.
type Config struct {
	Cluster           string
	Pipeline          Pipeline
	Policy            string        // default policy of stages that name none; default round_robin
	LogStats          bool          // register and record the stat families
	DetachedSeriesTTL time.Duration // 0: keep a detached replica's series forever
	// ReplicaSeries: which stat families are kept per replica (default
	// full; see stats.ReplicaSeries).
	ReplicaSeries     stats.ReplicaSeries
	ReconcileInterval time.Duration // membership full re-list period; default membership.DefaultReconcileInterval
	ProbeTimeout      time.Duration // per Health call on join; default DefaultProbeTimeout
	// LeaseLossGrace is how long a replica whose record vanished but that
	// still answers Health as serving (its lease was lost, for example when
	// etcd froze past the TTL) stays routable while it re-registers.
	// Default DefaultLeaseLossGrace.
	LeaseLossGrace time.Duration
	// StallTimeout fails a stage attempt that makes no progress (no chunk,
	// and for a streamed stage no input sent) for this long, so a frozen
	// replica's requests are retried elsewhere before its lease runs out.
	// Default DefaultStallTimeout.
	StallTimeout time.Duration
	// MaxMigrations is how many times a stage-0 answer whose replica failed
	// after text reached the client is continued on another replica, from
	// the prompt and the text already delivered (troupe head: 1). 0: such a
	// request ends with an error.
	MaxMigrations int
	// Breaker ejects a replica whose attempts fail repeatedly from routing
	// for a back-off (the zero value: 3 failures in a row, 1s doubling to
	// 30s).
	Breaker BreakerConfig
	// MaxMessageBytes caps each gRPC message to and from a replica (the
	// client side of the replicas' own limit); default
	// stagepb.DefaultMaxMessageBytes. A prompt whose request would exceed
	// it is refused with ErrInputTooLarge before it is sent.
	MaxMessageBytes int
	Metrics         prometheus.Registerer
	Dial            Dialer // required
	// TracerProvider makes the head's spans, whose context goes to the
	// workers with each call through the dialer's stats handler. nil: no
	// spans, and calls carry no trace context.
	TracerProvider trace.TracerProvider
	Logger         *slog.Logger
	// Tokenizers, by engine name as Health reports it, let prefix_aware
	// name an engine's blocks as the engine does, so engines that report
	// their cache (KvEvents) get the engine-reported mode. Optional.
	Tokenizers map[string]func(text string) []uint32
	// SignalMaxAge is how old a replica's load report may be before the
	// policies count it as unknown (--signal-max-age; 0:
	// router.DefaultSignalMaxAge).
	SignalMaxAge time.Duration
	// StatsMetrics is where the per-replica stat families (a stats.Logger,
	// registered as one Collector) go; nil: Metrics. Gathering them builds
	// a dto.Metric per series (hundreds of milliseconds for 1,000
	// replicas), so /metrics writes them through the Head's WriteMetrics
	// instead (an httpapi.Exposer) and gathers only a registry that does
	// not hold them: troupe head gives them a registry of their own, which
	// nothing gathers on the /metrics path.
	StatsMetrics prometheus.Registerer
	// Autoscale configures troupe_stage_desired_replicas (zero: the
	// defaults of AutoscaleConfig).
	Autoscale AutoscaleConfig
}

// Head is the orchestrator: a fleet, which owns membership and publishes
// the replicas to route to, and the request path, which reads what the
// fleet published and reports attempts' outcomes through router.Call.
// Run owns the fleet's goroutines; Execute, Replicas, Sleep and WakeUp may
// be called concurrently from request goroutines.
type Head struct {
	cfg    Config
	log    *slog.Logger
	fleet  *fleet
	stats  *stats.Logger
	router *router.Router // written by the fleet; the request path picks from its snapshots
	// pipeline holds the pipeline-level families; nil without LogStats.
	pipeline *stats.Pipeline
	tracer   trace.Tracer
	// stageSpans are the names of the stage attempt spans, by stage.
	stageSpans []string
	// calls are the options of every call to a replica (callOptions),
	// built once: they are the same for every request.
	calls []grpc.CallOption
	// decisions[stage][reason] are the pre-bound children of
	// troupe_router_decisions_total; nil where the stage's configuration
	// never gives that reason (decisionVec makes them if it ever does).
	decisions   [][len(router.Reasons)]prometheus.Counter
	decisionVec *prometheus.CounterVec
	ejections   []prometheus.Counter // by stage
	deadline    stageDeadlines
}

// stageDeadlines is deadline routing, by stage: whether the stage's
// policy is deadline, the pipeline's targets for it, and its prediction
// error histogram (nil unless deadline).
type stageDeadlines struct {
	on              []bool
	admits          []bool          // deadline.admission on
	rtfWindow       []time.Duration // Deadline.RTFWindow or its default
	targets         []Targets
	predictionError []prometheus.Observer
}

// New builds a head. It starts nothing; call Run.
func New(cli *clientv3.Client, cfg Config) (*Head, error) {
	cfg, err := withDefaults(cfg)
	if err != nil {
		return nil, err
	}
	routing, err := stageRouting(cfg)
	if err != nil {
		return nil, err
	}
	st, pipe, err := newStats(cfg)
	if err != nil {
		return nil, err
	}
	rt := router.NewWithBreaker(routing, router.Dialer(cfg.Dial), cfg.Logger, router.Breaker(cfg.Breaker))
	f, err := newFleet(cli, cfg, st, rt)
	if err != nil {
		return nil, err
	}
	h := &Head{
		cfg:      cfg,
		log:      cfg.Logger,
		fleet:    f,
		stats:    st,
		router:   rt,
		pipeline: pipe,
		tracer:   cfg.TracerProvider.Tracer("github.com/troupe-serving/troupe/orchestrator"),
		calls:    callOptions(cfg),
	}
	for _, st := range cfg.Pipeline.Stages {
		h.stageSpans = append(h.stageSpans, telemetry.StageSpanName(st.Name))
	}
	if err := h.registerMetrics(routing); err != nil {
		return nil, err
	}
	return h, nil
}

// callOptions are the options of every call to a replica: gRPC's default
// would stop at 4 MiB received.
func callOptions(cfg Config) []grpc.CallOption {
	return []grpc.CallOption{grpc.MaxCallSendMsgSize(cfg.MaxMessageBytes), grpc.MaxCallRecvMsgSize(cfg.MaxMessageBytes)}
}

// withDefaults checks cfg and fills in its defaults.
func withDefaults(cfg Config) (Config, error) {
	if err := cfg.Pipeline.Validate(); err != nil {
		return cfg, err
	}
	if cfg.Cluster == "" {
		cfg.Cluster = membership.DefaultCluster
	}
	if cfg.ProbeTimeout <= 0 {
		cfg.ProbeTimeout = DefaultProbeTimeout
	}
	if cfg.MaxMessageBytes <= 0 {
		cfg.MaxMessageBytes = stagepb.DefaultMaxMessageBytes
	}
	if cfg.LeaseLossGrace <= 0 {
		cfg.LeaseLossGrace = DefaultLeaseLossGrace
	}
	if cfg.StallTimeout <= 0 {
		cfg.StallTimeout = DefaultStallTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	cfg.Autoscale = cfg.Autoscale.withDefaults()
	if cfg.TracerProvider == nil {
		cfg.TracerProvider = noop.NewTracerProvider()
	}
	if cfg.Metrics == nil {
		return cfg, errors.New("orchestrator: a metrics registerer is required")
	}
	if cfg.Dial == nil {
		return cfg, errors.New("orchestrator: a dialer is required")
	}
	if err := cfg.Pipeline.ValidateRouting(cfg.Policy); err != nil {
		return cfg, err
	}
	return cfg, nil
}

// stageRouting is each stage's routing: its policy and session affinity.
func stageRouting(cfg Config) ([]router.StageRouting, error) {
	tokenizers := make(map[string]router.Tokenizer, len(cfg.Tokenizers))
	for name, t := range cfg.Tokenizers {
		tokenizers[name] = t
	}
	routing := make([]router.StageRouting, len(cfg.Pipeline.Stages))
	for i, st := range cfg.Pipeline.Stages {
		p, err := router.NewPolicy(st.EffectivePolicy(cfg.Policy), router.PolicyOptions{PrefixSource: st.PrefixSource, Tokenizers: tokenizers, SignalMaxAge: cfg.SignalMaxAge, Balance: st.RouterBalance(), Deadline: st.deadlineOptions()})
		if err != nil {
			return nil, fmt.Errorf("orchestrator: stage %q: %w", st.Name, err)
		}
		routing[i] = router.StageRouting{Policy: p, SessionAffinity: st.Affinity()}
	}
	return routing, nil
}

// newStats builds the stat logger (on cfg.StatsMetrics, else cfg.Metrics)
// and, when stats are logged, the pipeline's metrics.
func newStats(cfg Config) (*stats.Logger, *stats.Pipeline, error) {
	statsReg := cfg.StatsMetrics
	if statsReg == nil {
		statsReg = cfg.Metrics
	}
	st, err := stats.New(statsReg, cfg.Pipeline.Model, stats.Options{
		Disabled:          !cfg.LogStats,
		DetachedSeriesTTL: cfg.DetachedSeriesTTL,
		Series:            cfg.ReplicaSeries,
		StageNames:        cfg.Pipeline.StageNames(),
	})
	if err != nil {
		return nil, nil, fmt.Errorf("orchestrator: stats: %w", err)
	}
	var pipe *stats.Pipeline
	if cfg.LogStats {
		if pipe, err = stats.NewPipeline(cfg.Metrics, cfg.Pipeline.Model, len(cfg.Pipeline.Stages)); err != nil {
			return nil, nil, fmt.Errorf("orchestrator: %w", err)
		}
	}
	return st, pipe, nil
}

// registerMetrics makes the request path's metrics, binds every child it
// knows of at 0, and registers them on cfg.Metrics.
func (h *Head) registerMetrics(routing []router.StageRouting) error {
	decisions := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "troupe_router_decisions_total",
		Help: "Replicas chosen for stage attempts, by stage, the stage's policy, and why.",
	}, []string{"stage", "policy", "reason"})
	h.decisionVec = decisions
	ejections := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "troupe_router_ejections_total",
		Help: "Replicas ejected from routing by the circuit breaker (repeated failed attempts), by stage.",
	}, []string{"stage"})
	h.ejections = make([]prometheus.Counter, len(routing))
	for i := range routing {
		h.ejections[i] = ejections.WithLabelValues(strconv.Itoa(i))
	}
	h.decisions = make([][len(router.Reasons)]prometheus.Counter, len(routing))
	for i, st := range routing {
		reasons := st.Policy.Reasons()
		if st.SessionAffinity {
			reasons = append(reasons, router.ReasonAffinity, router.ReasonLoadFallback)
		}
		for _, r := range reasons {
			h.decisions[i][r] = decisions.WithLabelValues(strconv.Itoa(i), st.Policy.Name(), r.String())
		}
	}
	for _, c := range []prometheus.Collector{decisions, ejections, h.deadlineMetrics(routing)} {
		if err := h.cfg.Metrics.Register(c); err != nil {
			return fmt.Errorf("orchestrator: register metrics: %w", err)
		}
	}
	return nil
}

// TracerProvider is the provider the head's spans come from.
func (h *Head) TracerProvider() trace.TracerProvider { return h.cfg.TracerProvider }

// Pipeline returns the head's pipeline.
func (h *Head) Pipeline() Pipeline { return h.cfg.Pipeline }

// Run runs the head's fleet until ctx ends: it watches membership and
// applies it, the only writer of the registry, the stat bindings and the
// router.
func (h *Head) Run(ctx context.Context) error { return h.fleet.run(ctx) }

// MetricFamilyNames are the per-replica stat families WriteMetrics writes.
// Safe for concurrent use.
func (h *Head) MetricFamilyNames() []string { return h.stats.MetricFamilyNames() }

// WriteMetrics writes the per-replica stat families in format f (the text
// format or OpenMetrics, without "# EOF"), straight from the stat logger,
// for /metrics (see Config.StatsMetrics and stats.Logger.WriteMetrics).
// Safe for concurrent use.
func (h *Head) WriteMetrics(w io.Writer, f expfmt.Format) error { return h.stats.WriteMetrics(w, f) }

// Replicas lists every replica the head knows, detached ones included.
func (h *Head) Replicas() []ReplicaStatus { return h.fleet.replicas() }

// Known is how many replica records the head knows (routed, joining,
// refused or detached): the size of its view, O(1).
func (h *Head) Known() int { return h.fleet.view.Load().Len() }

// Ready reports whether every stage has a routable replica; otherwise it
// names the first stage that has none, and says the head is starting
// while no stage has been routable since it started.
func (h *Head) Ready() (bool, string) {
	snap := h.router.Snapshot()
	for i, st := range h.cfg.Pipeline.Stages {
		if snap.CheckRoutable(i) != nil {
			return false, h.starting() + fmt.Sprintf("stage %d (%s) has no routable replica", i, st.Name)
		}
	}
	return true, ""
}

// starting prefixes why a stage has no replica while the head has not yet
// routed every stage since it started (its first joins are under way).
func (h *Head) starting() string {
	if h.fleet.served.Load() {
		return ""
	}
	return "the head is starting: "
}

// noReplica is ErrNoReplica for stage, whose snapshot said err.
func (h *Head) noReplica(stage int, err error) error {
	return newError(ErrNoReplica, err, "%sstage %q has no routable replica", h.starting(), h.cfg.Pipeline.Stages[stage].Name)
}
