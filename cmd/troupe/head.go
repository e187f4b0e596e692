package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"os"
	"runtime/debug"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"

	"github.com/troupe-serving/troupe/internal/httpapi"
	"github.com/troupe-serving/troupe/internal/router"
	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/telemetry"
	"github.com/troupe-serving/troupe/worker/sim"
)

// headFlags are the flags of `troupe head`; `troupe up` reuses them.
type headFlags struct {
	http, adminHTTP, pipeline, cluster, apiKey, policy string
	sessionHeader                                      string
	logStats, untrustedParent, sessionUser             bool
	maxBody                                            byteSize
	maxInFlight                                        int
	detachedTTL, reconcile                             time.Duration
	stallTimeout, leaseLossGrace                       time.Duration
	tls                                                *tlsFlags
	otel                                               *otelFlags
	log                                                *logFlags
	// builtPipeline, when set, is the pipeline instead of --pipeline's
	// (troupe up --speech builds its own).
	builtPipeline *orchestrator.Pipeline
}

func addHeadFlags(fs *flag.FlagSet) *headFlags {
	f := &headFlags{maxBody: 16 << 20}
	fs.StringVar(&f.http, "http", "127.0.0.1:8000", "address of the HTTP API")
	fs.StringVar(&f.adminHTTP, "admin-http", "", "serve admin routes and /metrics on this separate address")
	fs.StringVar(&f.pipeline, "pipeline", "", "pipeline YAML file (default: thinker → talker → vocoder, model troupe-omni-sim)")
	fs.StringVar(&f.cluster, "cluster", membership.DefaultCluster, "cluster name (etcd key prefix)")
	fs.StringVar(&f.apiKey, "api-key", "", "require Authorization: Bearer <key> on every route but /metrics, /healthz, /readyz")
	fs.StringVar(&f.policy, "policy", router.PolicyRoundRobin, "routing policy of stages whose pipeline entry names none: "+strings.Join(router.PolicyNames, ", "))
	fs.StringVar(&f.sessionHeader, "session-header", "X-Session-ID", "header carrying a session key for session affinity (empty: none)")
	fs.BoolVar(&f.sessionUser, "session-user", true, "use the OpenAI `user` field as the session key when the header is absent")
	fs.BoolVar(&f.logStats, "log-stats", true, "register and record the per-replica stat families")
	fs.BoolVar(&f.untrustedParent, "trace-untrusted-parent", false, "link to a client's traceparent instead of parenting under it")
	fs.Var(&f.maxBody, "max-body-bytes", "largest request body accepted (e.g. 16MiB)")
	fs.IntVar(&f.maxInFlight, "max-in-flight", 1024, "completions the head runs at once; beyond it 429 with Retry-After (0: no limit)")
	fs.DurationVar(&f.detachedTTL, "detached-series-ttl", 0, "delete the series of replicas detached longer than this (0: keep forever)")
	fs.DurationVar(&f.reconcile, "reconcile-interval", 30*time.Second, "period of the full membership re-list that repairs drift")
	fs.DurationVar(&f.stallTimeout, "stall-timeout", 5*time.Second, "fail and retry a stage attempt that makes no progress for this long")
	fs.DurationVar(&f.leaseLossGrace, "lease-loss-grace", 15*time.Second, "keep routing to a replica whose record vanished but that still serves, while it re-registers")
	f.tls = addTLSFlags(fs, "gRPC to workers")
	f.otel = addOtelFlags(fs)
	f.log = addLogFlags(fs)
	return f
}

// grpcMessageLimit is the gRPC message limit that lets a prompt as large
// as the HTTP body limit through: the body limit plus the request's
// headroom, capped at what gRPC can take.
func grpcMessageLimit(maxBody byteSize) int {
	return int(min(int64(maxBody)+stagepb.MessageHeadroom, math.MaxInt32))
}

// loadPipeline reads --pipeline, or returns the default pipeline.
func (f *headFlags) loadPipeline() (orchestrator.Pipeline, error) {
	if f.builtPipeline != nil {
		return *f.builtPipeline, nil
	}
	if f.pipeline == "" {
		return orchestrator.DefaultPipeline(), nil
	}
	return orchestrator.LoadPipeline(f.pipeline)
}

func runHead(ctx context.Context, args []string, stdout io.Writer) error {
	fs := newFlagSet("head")
	ef := addEtcdFlags(fs)
	hf := addHeadFlags(fs)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	log := hf.log.logger()
	setHeadGC()
	p, err := hf.loadPipeline() // refuse a bad file or policy before waiting on etcd
	if err != nil {
		return err
	}
	if err := p.ValidateRouting(hf.policy); err != nil {
		return err
	}
	cli, err := membership.Dial(ctx, ef.config())
	if err != nil {
		return err
	}
	defer cli.Close()
	return serveHead(ctx, cli, hf, log, stdout, nil)
}

// headGCPercent is the head's GOGC unless the environment sets one. The
// head's live heap is small (snapshots, series, in-flight requests) and its
// garbage is per request and per token, so collecting at 4× the live heap
// instead of 2× halves the GC work for a few more MB (docs/benchmarks.md).
const headGCPercent = 400

// setHeadGC applies headGCPercent when GOGC is not set: the operator's
// GOGC (and GOMEMLIMIT, which the runtime reads itself) win.
func setHeadGC() {
	if _, ok := os.LookupEnv("GOGC"); !ok {
		debug.SetGCPercent(headGCPercent)
	}
}

// headAddrs are the bound addresses of a head's listeners.
type headAddrs struct {
	api   net.Addr
	admin net.Addr // nil without --admin-http: the admin routes are on api
}

// serveHead runs a head until ctx ends. ready, when not nil, receives the
// bound addresses once the listeners are open.
func serveHead(ctx context.Context, cli *clientv3.Client, hf *headFlags, log *slog.Logger, stdout io.Writer, ready chan<- headAddrs) error {
	pipeline, err := hf.loadPipeline()
	if err != nil {
		return err
	}
	tp, shutdown, err := hf.otel.setup(ctx, telemetry.Config{ServiceName: "troupe-head"}, log)
	if err != nil {
		return err
	}
	defer shutdown()
	creds, err := hf.tls.clientCredentials()
	if err != nil {
		return err
	}

	metrics := prometheus.NewRegistry()
	metrics.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	dialOpts := []grpc.DialOption{
		grpc.WithTransportCredentials(creds),
		grpc.WithStatsHandler(otelgrpc.NewClientHandler(
			otelgrpc.WithTracerProvider(tp.TracerProvider()),
			otelgrpc.WithPropagators(tp.Propagator()),
			otelgrpc.WithFilter(telemetry.TraceRPC),
		)),
		// Pings notice a peer that vanished without closing its socket (a
		// partition), so it leaves rotation before its lease expires.
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 10 * time.Second, Timeout: 5 * time.Second, PermitWithoutStream: true}),
	}
	head, err := orchestrator.New(cli, orchestrator.Config{
		Cluster:           hf.cluster,
		Pipeline:          pipeline,
		Policy:            hf.policy,
		Tokenizers:        map[string]func(string) []uint32{sim.EngineName: sim.Tokenize},
		LogStats:          hf.logStats,
		DetachedSeriesTTL: hf.detachedTTL,
		ReconcileInterval: hf.reconcile,
		MaxMessageBytes:   grpcMessageLimit(hf.maxBody),
		StallTimeout:      hf.stallTimeout,
		LeaseLossGrace:    hf.leaseLossGrace,
		Metrics:           metrics,
		Dial:              func(addr string) (*grpc.ClientConn, error) { return grpc.NewClient(addr, dialOpts...) },
		TracerProvider:    tp.TracerProvider(),
		Logger:            log,
	})
	if err != nil {
		return err
	}
	httpMetrics, err := httpapi.NewMetrics(metrics)
	if err != nil {
		return err
	}
	api := httpapi.New(head, httpapi.Config{
		MaxBodyBytes:    int64(hf.maxBody),
		APIKey:          hf.apiKey,
		Gatherer:        metrics,
		Metrics:         httpMetrics,
		TracerProvider:  tp.TracerProvider(),
		Propagator:      tp.Propagator(),
		UntrustedParent: hf.untrustedParent,
		Logger:          log,
		SessionHeader:   hf.sessionHeader,
		SessionFromUser: hf.sessionUser,
		MaxInFlight:     hf.maxInFlight,
	})

	handler := api.Handler()
	if hf.adminHTTP != "" {
		handler = api.ServingHandler()
	}
	lis, err := net.Listen("tcp", hf.http)
	if err != nil {
		return err // "listen tcp ADDR: ..."
	}
	servers := []*http.Server{httpapi.NewHTTPServer(hf.http, handler)}
	listeners := []net.Listener{lis}
	if hf.adminHTTP != "" {
		alis, err := net.Listen("tcp", hf.adminHTTP)
		if err != nil {
			lis.Close()
			return err
		}
		servers = append(servers, httpapi.NewHTTPServer(hf.adminHTTP, api.AdminHandler()))
		listeners = append(listeners, alis)
		fmt.Fprintf(stdout, "troupe head: admin and metrics on http://%s\n", alis.Addr())
	}
	fmt.Fprintf(stdout, "troupe head: model %s, stages %v, API on http://%s\n", pipeline.Model, pipeline.StageNames(), lis.Addr())
	if ready != nil {
		addrs := headAddrs{api: lis.Addr()}
		if len(listeners) > 1 {
			addrs.admin = listeners[1].Addr()
		}
		ready <- addrs
	}

	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return head.Run(gctx) })
	for i, srv := range servers {
		g.Go(func() error {
			if err := srv.Serve(httpapi.NewListener(listeners[i])); !errors.Is(err, http.ErrServerClosed) {
				return fmt.Errorf("http: %w", err)
			}
			return nil
		})
	}
	g.Go(func() error {
		<-gctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		for _, srv := range servers {
			_ = srv.Shutdown(sctx)
		}
		return nil
	})
	if err := g.Wait(); err != nil && ctx.Err() == nil {
		return err
	}
	return nil
}
