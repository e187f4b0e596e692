// Package orchestratortest runs a whole troupe in one test process: a real
// embedded etcd, a running Head and sim workers serving real gRPC on
// loopback, each registered through its own etcd lease.
package orchestratortest

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/troupe-serving/troupe/internal/core/stats"
	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/membership/membershiptest"
	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/pkg/tokenizers"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/sim"
)

// Options configure Start. The zero value runs the default three-stage
// pipeline with one replica per stage and stats on.
type Options struct {
	Pipeline         orchestrator.Pipeline // default orchestrator.DefaultPipeline()
	ReplicasPerStage int                   // default 1; 0 replicas: use -1
	Policy           string
	MaxMigrations    int // orchestrator.Config.MaxMigrations
	DisableStats     bool
	ReplicaSeries    stats.ReplicaSeries // orchestrator.Config.ReplicaSeries
	Sim              sim.Config          // base engine config; Role comes from the stage
	LeaseTTL         time.Duration
	HeadTracer       trace.TracerProvider
	// WorkerServerOptions are added to every worker's gRPC server.
	WorkerServerOptions []grpc.ServerOption
	// HeadDialOptions are added to the head's dialer (after insecure creds).
	HeadDialOptions []grpc.DialOption
	Logger          *slog.Logger
	// Breaker is the head's circuit breaker (zero: the defaults).
	Breaker orchestrator.BreakerConfig
	// StallTimeout is orchestrator.Config.StallTimeout (zero: the default).
	StallTimeout time.Duration
	// SeparateStats registers the head's per-replica stats on
	// Cluster.StatsMetrics instead of Metrics, as troupe head does; /metrics
	// then serves them with the Head as its httpapi.Exposer.
	SeparateStats bool
	// Autoscale is orchestrator.Config.Autoscale (zero: the defaults).
	Autoscale orchestrator.AutoscaleConfig
	// SignalMaxAge is orchestrator.Config.SignalMaxAge (zero: the default).
	SignalMaxAge time.Duration
}

// Cluster is a running troupe. Its goroutines are stopped by t.Cleanup.
type Cluster struct {
	Etcd    *membershiptest.Etcd
	Client  *clientv3.Client
	Head    *orchestrator.Head
	Metrics *prometheus.Registry
	// StatsMetrics holds the head's per-replica stats with
	// Options.SeparateStats; nil otherwise (they are on Metrics).
	StatsMetrics *prometheus.Registry
	opts         Options

	mu      sync.Mutex
	workers []*Worker
}

// Worker is one in-process replica.
type Worker struct {
	Stage  string
	Server *worker.Server
	Engine *sim.Engine
	cli    *clientv3.Client
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
}

// ReplicaID is the registered replica id.
func (w *Worker) ReplicaID() uint32 { return w.Server.Member().ReplicaID }

// Addr is the advertised address.
func (w *Worker) Addr() string { return w.Server.Advertise() }

// Stop drains the worker as SIGTERM does: deregister, finish in-flight, exit.
func (w *Worker) Stop(t testing.TB) {
	t.Helper()
	w.once.Do(func() {
		w.cancel()
		require.NoError(t, <-w.done)
		w.Engine.Close()
		w.cli.Close()
	})
}

// Kill stops the worker as SIGKILL would, as far as one process allows:
// its etcd session is cut first, so the lease is not revoked and must
// expire, then its gRPC server stops without draining.
func (w *Worker) Kill(t testing.TB) {
	t.Helper()
	w.once.Do(func() {
		w.cli.Close()
		w.Engine.Close() // in-flight requests end with an error, as on a crash
		w.cancel()
		<-w.done
	})
}

// Start runs etcd, a head and the workers, and waits until every stage is
// routable (unless there are no replicas).
func Start(t testing.TB, opts Options) *Cluster {
	t.Helper()
	if len(opts.Pipeline.Stages) == 0 {
		opts.Pipeline = orchestrator.DefaultPipeline()
	}
	if opts.ReplicasPerStage == 0 {
		opts.ReplicasPerStage = 1
	}
	if opts.LeaseTTL == 0 {
		opts.LeaseTTL = 3 * time.Second
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	e := membershiptest.Start(t)
	c := &Cluster{Etcd: e, Client: e.Client(t), Metrics: prometheus.NewRegistry(), opts: opts}
	if opts.SeparateStats {
		c.StatsMetrics = prometheus.NewRegistry()
	}
	c.Head = c.startHead(t, c.Metrics, c.StatsMetrics, func() {
		c.mu.Lock()
		ws := c.workers
		c.mu.Unlock()
		for _, w := range ws {
			w.Stop(t)
		}
	})
	if opts.ReplicasPerStage > 0 {
		for _, st := range opts.Pipeline.Stages {
			for range opts.ReplicasPerStage {
				w := c.AddWorker(t, st.Name, WorkerOptions{})
				c.WaitState(t, st.Name, w.ReplicaID(), "attached")
			}
		}
	}
	return c
}

// startHead runs a head on the cluster's membership until cleanup, which
// calls before first.
func (c *Cluster) startHead(t testing.TB, metrics, statsMetrics *prometheus.Registry, before func()) *orchestrator.Head {
	t.Helper()
	dialOpts := append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, orchestrator.FlowControlDialOptions()...)
	dialOpts = append(dialOpts, c.opts.HeadDialOptions...)
	cfg := orchestrator.Config{
		Pipeline:          c.opts.Pipeline,
		Policy:            c.opts.Policy,
		MaxMigrations:     c.opts.MaxMigrations,
		Tokenizers:        tokenizers.All(),
		LogStats:          !c.opts.DisableStats,
		ReplicaSeries:     c.opts.ReplicaSeries,
		Metrics:           metrics,
		ReconcileInterval: membership.DefaultReconcileInterval,
		Dial:              func(addr string) (*grpc.ClientConn, error) { return grpc.NewClient(addr, dialOpts...) },
		TracerProvider:    c.opts.HeadTracer,
		Logger:            c.opts.Logger,
		Breaker:           c.opts.Breaker,
		StallTimeout:      c.opts.StallTimeout,
		Autoscale:         c.opts.Autoscale,
		SignalMaxAge:      c.opts.SignalMaxAge,
	}
	if statsMetrics != nil { // a nil *Registry is not a nil Registerer
		cfg.StatsMetrics = statsMetrics
	}
	h, err := orchestrator.New(c.Client, cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.Run(ctx) }()
	t.Cleanup(func() {
		if before != nil {
			before()
		}
		cancel()
		require.NoError(t, <-done)
	})
	return h
}

// AddHead runs one more head on the same membership, with its own metrics
// registry, as a second `troupe head` process would. It is stopped at
// cleanup, before the cluster's workers.
func (c *Cluster) AddHead(t testing.TB) (*orchestrator.Head, *prometheus.Registry) {
	t.Helper()
	metrics := prometheus.NewRegistry()
	return c.startHead(t, metrics, nil, nil), metrics
}

// WorkerOptions configure one worker.
type WorkerOptions struct {
	ReplicaID *uint32     // default: auto
	Sim       *sim.Config // default: the cluster's Sim
	Listen    string      // default 127.0.0.1:0
	// Engine, when set, wraps the sim engine the worker serves (e.g. to
	// alter what it reports); the Worker's Engine stays the sim itself.
	Engine func(*sim.Engine) worker.Engine
}

// AddWorker starts a sim worker for stage and waits until it is registered
// in etcd (not until the head routes to it: see WaitRoutable).
func (c *Cluster) AddWorker(t testing.TB, stage string, wo WorkerOptions) *Worker {
	t.Helper()
	w, err := c.startWorker(stage, wo)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	select {
	case <-w.Server.Registered():
	case err := <-w.done:
		t.Fatalf("orchestratortest: worker %s exited before registering: %v", stage, err)
	case <-ctx.Done():
		t.Fatalf("orchestratortest: worker %s not registered within 30s", stage)
	}
	return w
}

// startWorker starts a worker and returns at once; AddWorker waits for it.
func (c *Cluster) startWorker(stage string, wo WorkerOptions) (*Worker, error) {
	cfg := c.opts.Sim
	if wo.Sim != nil {
		cfg = *wo.Sim
	}
	cfg.Role, cfg.InputRole = sim.RoleForStage(stage), sim.InputRoleForStage(stage)
	if c.opts.Sim.Role != "" && wo.Sim == nil {
		cfg.Role = c.opts.Sim.Role
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: c.Etcd.Endpoints(), DialTimeout: 5 * time.Second})
	if err != nil {
		return nil, fmt.Errorf("orchestratortest: etcd client: %w", err)
	}
	eng := sim.New(cfg)
	wcfg := worker.Config{
		Stage:         stage,
		AutoID:        wo.ReplicaID == nil,
		Listen:        wo.Listen,
		LeaseTTL:      c.opts.LeaseTTL,
		DrainTimeout:  10 * time.Second,
		Engine:        worker.Engine(eng),
		Version:       "test",
		EtcdClient:    cli,
		Logger:        c.opts.Logger,
		ServerOptions: c.opts.WorkerServerOptions,
	}
	if wo.Engine != nil {
		wcfg.Engine = wo.Engine(eng)
	}
	if wcfg.Listen == "" {
		wcfg.Listen = "127.0.0.1:0"
	}
	if wo.ReplicaID != nil {
		wcfg.ReplicaID = *wo.ReplicaID
	}
	srv, err := worker.New(wcfg)
	if err != nil {
		eng.Close()
		cli.Close()
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	w := &Worker{Stage: stage, Server: srv, Engine: eng, cli: cli, cancel: cancel, done: make(chan error, 1)}
	go func() { w.done <- srv.Run(ctx) }()
	c.mu.Lock()
	c.workers = append(c.workers, w)
	c.mu.Unlock()
	return w, nil
}

// Workers returns the workers started so far, in start order.
func (c *Cluster) Workers() []*Worker {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]*Worker(nil), c.workers...)
}

// WaitReady waits until every stage has a routable replica.
func (c *Cluster) WaitReady(t testing.TB) {
	t.Helper()
	require.Eventually(t, func() bool { ok, _ := c.Head.Ready(); return ok }, 30*time.Second, 5*time.Millisecond, "cluster not ready")
}

// WaitState waits until a replica shows the given state in Head.Replicas.
func (c *Cluster) WaitState(t testing.TB, stage string, replica uint32, state orchestrator.ReplicaState) orchestrator.ReplicaStatus {
	t.Helper()
	var got orchestrator.ReplicaStatus
	require.Eventually(t, func() bool {
		for _, r := range c.Head.Replicas() {
			if r.StageName == stage && r.Replica == replica {
				got = r
				return r.State == state
			}
		}
		return false
	}, 30*time.Second, 5*time.Millisecond, "replica %s/%d never reached state %s", stage, replica, state)
	return got
}
