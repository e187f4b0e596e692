package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"

	"github.com/troupe-serving/troupe/internal/core/fdtable"
	"github.com/troupe-serving/troupe/internal/core/memreturn"
	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/internal/core/stats"
	"github.com/troupe-serving/troupe/internal/front/httpapi"
	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/pkg/clusterauth"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/telemetry"
	"github.com/troupe-serving/troupe/pkg/tlsconfig"
	"github.com/troupe-serving/troupe/pkg/tokenizers"
)

// headFlags are the flags of `troupe head`; `troupe up` reuses them.
type headFlags struct {
	http, adminHTTP, pipeline, cluster, apiKey, policy string
	apiKeyFile, adminAPIKeyFile                        string
	// apiKeyOnArgv: --api-key came from the command line (see
	// noteArgvSecrets), where ps shows it.
	apiKeyOnArgv bool
	// followLimit: the soft memory limit is the default one, so it
	// follows the fleet (see setHeadGC).
	followLimit                                bool
	sessionHeader, headID, advertise           string
	logStats, untrustedParent, sessionUser     bool
	maxBody                                    byteSize
	maxInFlight                                int
	maxPartBytes                               byteSize
	maxContentParts                            int
	detachedTTL, reconcile                     time.Duration
	replicaSeries                              string
	stallTimeout, leaseLossGrace, signalMaxAge time.Duration
	maxMigrations                              int
	leaseTTL, shutdownDelay, drainTimeout      time.Duration
	tls                                        *tlsFlags
	otel                                       *otelFlags
	log                                        *logFlags
	// builtPipeline, when set, is the pipeline instead of --pipeline's
	// (troupe up --speech builds its own).
	builtPipeline *orchestrator.Pipeline
	// realtime bounds GET /v1/realtime (--realtime-*).
	realtimeMaxSessions     int
	realtimeIdleTimeout     time.Duration
	realtimeMaxMessageBytes byteSize
	// realtimeMaxItems, realtimeMaxItemsBytes, realtimeMaxInputAudio,
	// realtimeBudget bound what realtime sessions hold (docs/api.md,
	// "Realtime memory").
	realtimeMaxItems                                             int
	realtimeMaxItemsBytes, realtimeMaxInputAudio, realtimeBudget byteSize

	// autoscaleTarget, autoscaleCooldown, autoscaleInterval: the
	// recommendation of troupe_stage_desired_replicas (see autoscale).
	autoscaleTarget                      float64
	autoscaleCooldown, autoscaleInterval time.Duration

	// bodyIdleTimeout, bodyMinRate pace request bodies (httpapi.pacedBody).
	bodyIdleTimeout time.Duration
	bodyMinRate     byteSize

	// httpTLSCert, httpTLSKey serve the HTTP API over TLS (troupe head's
	// --http-tls-cert, --http-tls-key; troupe up serves plain HTTP).
	httpTLSCert, httpTLSKey string
}

func addHeadFlags(fs *flag.FlagSet) *headFlags {
	f := &headFlags{maxBody: httpapi.DefaultMaxBodyBytes, maxPartBytes: httpapi.DefaultMaxPartBytes,
		realtimeMaxMessageBytes: httpapi.DefaultRealtimeMaxMessageBytes, bodyMinRate: httpapi.DefaultBodyMinRate,
		realtimeMaxItemsBytes: httpapi.DefaultRealtimeMaxItemsBytes, realtimeMaxInputAudio: httpapi.DefaultRealtimeMaxInputAudioBytes,
		realtimeBudget: httpapi.DefaultRealtimeMemoryBudget}
	fs.StringVar(&f.http, "http", "127.0.0.1:8000", "address of the HTTP API")
	fs.StringVar(&f.adminHTTP, "admin-http", "", "serve admin routes and /metrics on this separate address")
	fs.StringVar(&f.pipeline, "pipeline", "", "pipeline YAML file (default: thinker → talker → vocoder, model troupe-omni-sim)")
	fs.StringVar(&f.cluster, "cluster", membership.DefaultCluster, "cluster name (etcd key prefix)")
	fs.StringVar(&f.apiKey, "api-key", "", "require Authorization: Bearer <key> on every route but /metrics, /healthz, /readyz (prefer --api-key-file or $TROUPE_API_KEY: ps shows the command line)")
	fs.StringVar(&f.apiKeyFile, "api-key-file", "", "file holding the API key (see --api-key)")
	fs.StringVar(&f.adminAPIKeyFile, "admin-api-key-file", "", "file holding the admin key, the one key of /v1/replicas, sleep and wake_up (default: $TROUPE_ADMIN_API_KEY; never on the command line). Without it the API key cannot sleep or wake replicas")
	fs.StringVar(&f.policy, "policy", router.PolicyRoundRobin, "routing policy of stages whose pipeline entry names none: "+strings.Join(router.PolicyNames, ", "))
	fs.StringVar(&f.sessionHeader, "session-header", "X-Session-ID", "header carrying a session key for session affinity (empty: none)")
	fs.BoolVar(&f.sessionUser, "session-user", true, "use the OpenAI request's \"user\" field as the session key when the header is absent")
	fs.BoolVar(&f.logStats, "log-stats", true, "register and record the per-replica stat families")
	fs.BoolVar(&f.untrustedParent, "trace-untrusted-parent", false, "link to a client's traceparent instead of parenting under it")
	fs.Var(&f.maxBody, "max-body-bytes", "largest request body accepted, a `size` such as 16MiB")
	fs.Var(&f.maxPartBytes, "max-part-bytes", "largest media part (image, audio, video) of a chat request once decoded, a `size` such as 8MiB")
	fs.IntVar(&f.maxContentParts, "max-content-parts", httpapi.DefaultMaxContentParts, "most media parts one chat request may hold")
	fs.IntVar(&f.maxInFlight, "max-in-flight", 1024, "completions the head runs at once; beyond it 429 with Retry-After (0: no limit)")
	fs.IntVar(&f.realtimeMaxSessions, "realtime-max-sessions", httpapi.DefaultRealtimeMaxSessions, "most realtime (WebSocket) sessions the head holds at once; one more is closed with 1013")
	fs.DurationVar(&f.realtimeIdleTimeout, "realtime-idle-timeout", httpapi.DefaultRealtimeIdleTimeout, "close (4000) a realtime session that sent no event for this long")
	fs.Var(&f.realtimeMaxMessageBytes, "realtime-max-message-bytes", "largest client message of a realtime session, a `size` such as 1MiB; a bigger one closes the session with 1009")
	fs.IntVar(&f.realtimeMaxItems, "realtime-max-items", httpapi.DefaultRealtimeMaxItems, "most conversation items a realtime session holds; a new one drops the oldest (conversation.item.deleted)")
	fs.Var(&f.realtimeMaxItemsBytes, "realtime-max-items-bytes", "most bytes of conversation items (text, and audio as WAV) a realtime session holds, a `size` such as 16MiB; a new item drops the oldest (conversation.item.deleted); at least --realtime-max-input-audio-bytes plus 44")
	fs.Var(&f.realtimeMaxInputAudio, "realtime-max-input-audio-bytes", "largest input audio buffer of a realtime session, a `size` such as 15MiB; an append past it is an error event (input_audio_buffer_full)")
	fs.Var(&f.realtimeBudget, "realtime-memory-budget", "most bytes every realtime session of the head holds together (items and input audio buffers), a `size` such as 256MiB; past it an event is refused (memory_budget_exceeded)")
	fs.DurationVar(&f.detachedTTL, "detached-series-ttl", 0, "delete the series of replicas detached longer than this (0: keep forever)")
	fs.StringVar(&f.replicaSeries, "replica-series", string(stats.ReplicaSeriesFull), "per-replica stat series on /metrics: full (every family per replica) or minimal (gauges and cache info per replica; counters and histograms per stage, with replica=\"\"); docs/stats.md")
	fs.DurationVar(&f.reconcile, "reconcile-interval", membership.DefaultReconcileInterval, "period of the full membership re-list that repairs drift")
	fs.DurationVar(&f.stallTimeout, "stall-timeout", orchestrator.DefaultStallTimeout, "fail and retry a stage attempt that makes no progress for this long")
	fs.DurationVar(&f.signalMaxAge, "signal-max-age", router.DefaultSignalMaxAge, "a replica's load report older than this counts as unknown in routing")
	fs.DurationVar(&f.leaseLossGrace, "lease-loss-grace", orchestrator.DefaultLeaseLossGrace, "keep routing to a replica whose record vanished but that still serves, while it re-registers")
	fs.IntVar(&f.maxMigrations, "max-migrations", 1, "times an answer whose thinker failed after text reached the client is continued on another replica (0: it ends with an error)")
	fs.StringVar(&f.headID, "head-id", "", "id of this head's record in etcd (/troupe/<cluster>/heads/<id>; default: <hostname>-<pid>-<4 random hex digits>)")
	fs.StringVar(&f.advertise, "advertise", "", "API address recorded in the head's etcd record (default: the bound address; the hostname when listening on all interfaces)")
	fs.DurationVar(&f.leaseTTL, "lease-ttl", membership.DefaultTTL, "etcd lease TTL of the head's record")
	fs.DurationVar(&f.shutdownDelay, "shutdown-delay", 0, "on SIGTERM, answer /readyz 503 and keep serving this long before draining, so a load balancer stops sending first")
	fs.DurationVar(&f.drainTimeout, "drain-timeout", httpapi.DefaultDrainTimeout, "on SIGTERM, how long in-flight requests may finish before they are cut")
	fs.Float64Var(&f.autoscaleTarget, "autoscale-target-utilization", orchestrator.DefaultTargetUtilization, "share of a replica's capacity troupe_stage_desired_replicas aims to use, a `fraction` in (0, 1]")
	fs.DurationVar(&f.autoscaleCooldown, "autoscale-cooldown", orchestrator.DefaultScaleDownCooldown, "troupe_stage_desired_replicas rises at once but falls only after the lower figure held this long")
	fs.DurationVar(&f.bodyIdleTimeout, "body-idle-timeout", httpapi.DefaultBodyIdleTimeout, "longest pause while a request body arrives, and the time before --body-min-rate applies; slower: 408 body_too_slow")
	fs.Var(&f.bodyMinRate, "body-min-rate", "slowest average rate of a request body once --body-idle-timeout has passed since the request began, a `size` per second such as 8KiB")
	fs.DurationVar(&f.autoscaleInterval, "autoscale-interval", orchestrator.DefaultAutoscaleInterval, "how often troupe_stage_desired_replicas is computed")
	f.tls = addTLSFlags(fs, "gRPC to workers")
	f.otel = addOtelFlags(fs)
	f.log = addLogFlags(fs)
	return f
}

// autoscale is the orchestrator's AutoscaleConfig from the --autoscale-*
// flags; a value out of range is an error (the orchestrator would silently
// take its default instead).
func (f *headFlags) autoscale() (orchestrator.AutoscaleConfig, error) {
	switch {
	case !(f.autoscaleTarget > 0 && f.autoscaleTarget <= 1): // also NaN
		return orchestrator.AutoscaleConfig{}, fmt.Errorf("troupe head: --autoscale-target-utilization %v: want a fraction in (0, 1], e.g. 0.7", f.autoscaleTarget)
	case f.autoscaleCooldown <= 0:
		return orchestrator.AutoscaleConfig{}, fmt.Errorf("troupe head: --autoscale-cooldown %v: want a positive duration, e.g. 5m", f.autoscaleCooldown)
	case f.autoscaleInterval <= 0:
		return orchestrator.AutoscaleConfig{}, fmt.Errorf("troupe head: --autoscale-interval %v: want a positive duration, e.g. 1s", f.autoscaleInterval)
	}
	return orchestrator.AutoscaleConfig{
		TargetUtilization: f.autoscaleTarget,
		ScaleDownCooldown: f.autoscaleCooldown,
		Interval:          f.autoscaleInterval,
	}, nil
}

// noteArgvSecrets records which secrets fs took from the command line
// (parseFlags leaves the environment's out of fs.Visit).
func (f *headFlags) noteArgvSecrets(fs *flag.FlagSet) {
	fs.Visit(func(fl *flag.Flag) {
		if fl.Name == "api-key" {
			f.apiKeyOnArgv = true
		}
	})
}

// keys returns the API key (--api-key-file, else --api-key or
// $TROUPE_API_KEY) and the admin key (--admin-api-key-file, else
// $TROUPE_ADMIN_API_KEY). --api-key on the command line is accepted with a
// warning.
func (f *headFlags) keys(log *slog.Logger) (api, admin string, err error) {
	api = f.apiKey
	if f.apiKeyFile != "" {
		if f.apiKeyOnArgv {
			return "", "", errors.New("troupe head: --api-key and --api-key-file both given")
		}
		if api, err = readKeyFile("--api-key-file", f.apiKeyFile); err != nil {
			return "", "", err
		}
	} else if f.apiKeyOnArgv {
		log.Warn("troupe head: --api-key on the command line is visible to every user of this host (ps); use --api-key-file or TROUPE_API_KEY")
	}
	admin = strings.TrimSpace(os.Getenv("TROUPE_ADMIN_API_KEY"))
	if f.adminAPIKeyFile != "" {
		if admin, err = readKeyFile("--admin-api-key-file", f.adminAPIKeyFile); err != nil {
			return "", "", err
		}
	}
	if admin != "" && admin == api {
		return "", "", errors.New("troupe head: the admin key must differ from the API key")
	}
	return api, admin, nil
}

// readKeyFile reads a key, trimmed of surrounding white space; an empty
// file is an error, since it would turn auth off.
func readKeyFile(flagName, path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("troupe head: %s: %w", flagName, err)
	}
	k := strings.TrimSpace(string(b))
	if k == "" {
		return "", fmt.Errorf("troupe head: %s %s is empty", flagName, path)
	}
	return k, nil
}

// realtime is the realtime sessions' limits. The flags' zero values, which
// validate refuses, never reach it.
func (f *headFlags) realtime() httpapi.RealtimeConfig {
	return httpapi.RealtimeConfig{MaxSessions: f.realtimeMaxSessions, IdleTimeout: f.realtimeIdleTimeout,
		MaxMessageBytes: int64(f.realtimeMaxMessageBytes), MaxItems: f.realtimeMaxItems,
		MaxItemsBytes: int(f.realtimeMaxItemsBytes), MaxInputAudioBytes: int(f.realtimeMaxInputAudio),
		MemoryBudget: int64(f.realtimeBudget)}
}

// validateLimits refuses --realtime-* limits and a --body-idle-timeout
// that are not positive.
func (f *headFlags) validateLimits() error {
	switch {
	case f.realtimeMaxSessions <= 0:
		return fmt.Errorf("troupe head: --realtime-max-sessions must be at least 1, got %d", f.realtimeMaxSessions)
	case f.realtimeIdleTimeout <= 0:
		return fmt.Errorf("troupe head: --realtime-idle-timeout must be positive, got %s", f.realtimeIdleTimeout)
	case f.realtimeMaxMessageBytes <= 0:
		return errors.New("troupe head: --realtime-max-message-bytes must be positive")
	case f.realtimeMaxItems <= 0:
		return fmt.Errorf("troupe head: --realtime-max-items must be at least 1, got %d", f.realtimeMaxItems)
	case f.realtimeMaxInputAudio < 2 || f.realtimeMaxInputAudio > math.MaxInt32:
		return fmt.Errorf("troupe head: --realtime-max-input-audio-bytes must be from 2 bytes to 2GiB, got %d", f.realtimeMaxInputAudio)
	case f.realtimeMaxItemsBytes < f.realtimeMaxInputAudio+44 || f.realtimeMaxItemsBytes > math.MaxInt32:
		return fmt.Errorf("troupe head: --realtime-max-items-bytes (%d) must hold a full input audio buffer's commit: at least --realtime-max-input-audio-bytes plus 44 (%d), at most 2GiB", f.realtimeMaxItemsBytes, f.realtimeMaxInputAudio+44)
	case f.realtimeBudget <= 0:
		return errors.New("troupe head: --realtime-memory-budget must be positive")
	case f.bodyIdleTimeout <= 0:
		return fmt.Errorf("troupe head: --body-idle-timeout must be positive, got %s", f.bodyIdleTimeout)
	}
	if _, err := stats.ParseReplicaSeries(f.replicaSeries); err != nil {
		return fmt.Errorf("troupe head: --replica-series: %w", err)
	}
	return nil
}

// apiTLS is the HTTP API's TLS configuration from --http-tls-cert and
// --http-tls-key; nil without them. HTTP/1.1 only, as the plaintext API:
// a realtime session's WebSocket upgrade needs it.
func (f *headFlags) apiTLS() (*tls.Config, error) {
	if f.httpTLSCert == "" && f.httpTLSKey == "" {
		return nil, nil
	}
	if f.httpTLSCert == "" || f.httpTLSKey == "" {
		return nil, errors.New("troupe head: --http-tls-cert and --http-tls-key go together")
	}
	cfg, err := tlsconfig.Server(tlsconfig.Files{Cert: f.httpTLSCert, Key: f.httpTLSKey})
	if err != nil {
		return nil, fmt.Errorf("troupe head: --http-tls-cert: %w", err)
	}
	cfg.NextProtos = []string{"http/1.1"}
	return cfg, nil
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
	fs.StringVar(&hf.httpTLSCert, "http-tls-cert", "", "certificate (PEM) to serve the HTTP API (and --admin-http) over TLS with, e.g. troupe certs' api.pem; needs --http-tls-key")
	fs.StringVar(&hf.httpTLSKey, "http-tls-key", "", "private key (PEM) of --http-tls-cert")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	hf.noteArgvSecrets(fs)
	if err := hf.validateLimits(); err != nil {
		return err
	}
	if _, err := hf.apiTLS(); err != nil { // before etcd: a wrong file is the command's error
		return err
	}
	log, flushLog := hf.log.logger()
	defer flushLog()
	ef.warnArgvPassword(fs, log)
	hf.followLimit = setHeadGC(log)
	// Grow the descriptor table now, not at the join or request that
	// crosses 256, 512, 1024... descriptors (see internal/core/fdtable).
	if err := fdtable.Reserve(fdtable.DefaultReserve); err != nil {
		log.Warn("troupe head: descriptor table not reserved", "err", err)
	}
	p, err := hf.loadPipeline() // refuse a bad file or policy before waiting on etcd
	if err != nil {
		return err
	}
	if err := p.ValidateRouting(hf.policy); err != nil {
		return err
	}
	if _, err := hf.autoscale(); err != nil {
		return err
	}
	cli, err := membership.Dial(ctx, ef.config())
	if err != nil {
		return err
	}
	defer cli.Close()
	return serveHead(ctx, cli, hf, log, stdout, nil)
}

// exportedTracer is the tracer provider of the head's HTTP layer and
// pipeline: none when the head exports nothing. Every span would be
// unsampled then; without a provider the HTTP layer starts bare server
// spans (real ids for traceparent and the logs, see httpapi.Config) and the
// pipeline's spans are no-ops that carry that context on.
func exportedTracer(tp *telemetry.Provider) trace.TracerProvider {
	if !tp.Enabled() {
		return nil
	}
	return tp.TracerProvider()
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
	token, err := hf.tls.token()
	if err != nil {
		return err
	}
	apiKey, adminKey, err := hf.keys(log)
	if err != nil {
		return err
	}
	autoscale, err := hf.autoscale()
	if err != nil {
		return err
	}

	// metrics is gathered on /metrics; the per-replica stats are not on it
	// (they are written by the head, the API's Exposer, see
	// orchestrator.Config.StatsMetrics): their registry only checks them.
	metrics := prometheus.NewRegistry()
	metrics.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	statsMetrics := prometheus.NewRegistry()
	dialOpts := []grpc.DialOption{
		grpc.WithTransportCredentials(creds),
		// Pings notice a peer that vanished without closing its socket (a
		// partition), so it leaves rotation before its lease expires.
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 10 * time.Second, Timeout: 5 * time.Second, PermitWithoutStream: true}),
		// The head retries a failed stage itself, on another replica
		// (orchestrator.runStage); gRPC's transparent retry would only
		// buffer every message sent for a retry that is never wanted.
		grpc.WithDisableRetry(),
	}
	// Fixed flow-control windows: what the head may hold of a stream
	// nobody reads (docs/architecture.md, "Transport").
	dialOpts = append(dialOpts, orchestrator.FlowControlDialOptions()...)
	if token != "" {
		dialOpts = append(dialOpts, clusterauth.DialOption(token))
	}
	if tp.Enabled() {
		// Only a head that exports traces propagates them to its workers:
		// without an exporter every span is unsampled, so workers (which
		// follow the head's sampling decision) would record nothing either,
		// and the stats handler's work on every message would be spent for
		// nothing.
		dialOpts = append(dialOpts, grpc.WithStatsHandler(otelgrpc.NewClientHandler(
			otelgrpc.WithTracerProvider(tp.TracerProvider()),
			otelgrpc.WithPropagators(tp.Propagator()),
			otelgrpc.WithFilter(telemetry.TraceRPC),
		)))
	}
	head, err := orchestrator.New(cli, orchestrator.Config{
		Cluster:           hf.cluster,
		Pipeline:          pipeline,
		Policy:            hf.policy,
		Tokenizers:        tokenizers.All(),
		LogStats:          hf.logStats,
		DetachedSeriesTTL: hf.detachedTTL,
		ReplicaSeries:     stats.ReplicaSeries(hf.replicaSeries),
		ReconcileInterval: hf.reconcile,
		MaxMessageBytes:   grpcMessageLimit(hf.maxBody),
		StallTimeout:      hf.stallTimeout,
		SignalMaxAge:      hf.signalMaxAge,
		LeaseLossGrace:    hf.leaseLossGrace,
		MaxMigrations:     hf.maxMigrations,
		Autoscale:         autoscale,
		Metrics:           metrics,
		StatsMetrics:      statsMetrics,
		Dial:              func(addr string) (*grpc.ClientConn, error) { return grpc.NewClient(addr, dialOpts...) },
		TracerProvider:    exportedTracer(tp),
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
		APIKey:          apiKey,
		AdminAPIKey:     adminKey,
		Gatherer:        metrics,
		Exposer:         head,
		ExposerGatherer: statsMetrics,
		Metrics:         httpMetrics,
		TracerProvider:  exportedTracer(tp),
		Propagator:      tp.Propagator(),
		UntrustedParent: hf.untrustedParent,
		Logger:          log,
		SessionHeader:   hf.sessionHeader,
		SessionFromUser: hf.sessionUser,
		MaxInFlight:     hf.maxInFlight,
		MaxContentParts: hf.maxContentParts,
		MaxPartBytes:    int64(hf.maxPartBytes),
		Realtime:        hf.realtime(),
		BodyIdleTimeout: hf.bodyIdleTimeout,
		BodyMinRate:     int64(hf.bodyMinRate),
	})

	handler := api.Handler()
	if hf.adminHTTP != "" {
		handler = api.ServingHandler()
	}
	apiTLS, err := hf.apiTLS()
	if err != nil {
		return err
	}
	scheme := "http"
	if apiTLS != nil {
		scheme = "https"
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
		fmt.Fprintf(stdout, "troupe head: admin and metrics on %s://%s\n", scheme, alis.Addr())
	}
	reg, err := registerHead(ctx, cli, hf, lis.Addr(), log)
	if err != nil {
		for _, l := range listeners {
			l.Close()
		}
		return err
	}
	defer deregisterHead(reg, log)
	fmt.Fprintf(stdout, "troupe head: id %s, model %s, stages %v, API on %s://%s\n", reg.Head().ID, pipeline.Model, pipeline.StageNames(), scheme, lis.Addr())
	if ready != nil {
		addrs := headAddrs{api: lis.Addr()}
		if len(listeners) > 1 {
			addrs.admin = listeners[1].Addr()
		}
		ready <- addrs
	}

	// The head's loop outlives ctx: requests in flight at SIGTERM still
	// need its routes, so it stops only after the HTTP servers drained.
	runCtx, stopRun := context.WithCancel(context.WithoutCancel(ctx))
	defer stopRun()
	g, gctx := errgroup.WithContext(runCtx)
	g.Go(func() error { return head.Run(gctx) })
	if hf.followLimit {
		g.Go(func() error {
			followLimit(gctx, head.Known, liveMemory, log)
			return nil
		})
	}
	// After a burst (large bodies, streams nobody reads) the heap is given
	// back once the head is quiet, not two minutes later (memreturn).
	g.Go(func() error {
		memreturn.Run(gctx, memreturn.Config{Logger: log})
		return nil
	})
	for i, srv := range servers {
		l := listeners[i]
		if apiTLS != nil {
			// TLS below the API's own listener, whose connections rewrite
			// net/http's plaintext errors before they are encrypted.
			l = tls.NewListener(l, apiTLS)
		}
		g.Go(func() error {
			if err := srv.Serve(httpapi.NewListener(l)); !errors.Is(err, http.ErrServerClosed) {
				return fmt.Errorf("http: %w", err)
			}
			return nil
		})
	}
	g.Go(func() error {
		defer stopRun()
		select {
		case <-ctx.Done():
			stopGracefully(api, reg, servers, hf, log)
		case <-gctx.Done(): // a server or the loop failed: stop at once
			for _, srv := range servers {
				_ = srv.Close()
			}
		}
		return nil
	})
	if err := g.Wait(); err != nil && ctx.Err() == nil {
		return err
	}
	return nil
}

// stopGracefully is the head's SIGTERM: /readyz turns unready and the
// head's record leaves etcd at once; the head keeps serving for
// --shutdown-delay, so a load balancer's health check takes it out of
// rotation before anything is refused; then the listeners close and
// in-flight requests get --drain-timeout to finish before they are cut.
func stopGracefully(api *httpapi.Server, reg *membership.HeadRegistration, servers []*http.Server, hf *headFlags, log *slog.Logger) {
	api.Drain()
	for _, srv := range servers {
		srv.SetKeepAlivesEnabled(false) // clients reconnect, through the balancer, elsewhere
	}
	deregisterHead(reg, log)
	log.Info("troupe head: shutting down: /readyz unready", "shutdown_delay", hf.shutdownDelay, "drain_timeout", hf.drainTimeout)
	if hf.shutdownDelay > 0 {
		time.Sleep(hf.shutdownDelay)
	}
	sctx, cancel := context.WithTimeout(context.Background(), hf.drainTimeout)
	defer cancel()
	var wg sync.WaitGroup
	for _, srv := range servers {
		wg.Go(func() {
			if err := srv.Shutdown(sctx); err != nil {
				log.Warn("troupe head: drain timeout; cutting the requests still in flight", "addr", srv.Addr, "drain_timeout", hf.drainTimeout)
				_ = srv.Close()
			}
		})
	}
	wg.Go(func() {
		if err := api.WaitRealtime(sctx); err != nil {
			log.Warn("troupe head: drain timeout; cutting the realtime sessions still open", "drain_timeout", hf.drainTimeout)
		}
	})
	wg.Wait()
	log.Info("troupe head: drained")
}

// registerHead writes the head's record (/troupe/<cluster>/heads/<id>)
// under its own lease. An --head-id that another live head holds is an
// error, as a duplicate replica id is for a worker.
func registerHead(ctx context.Context, cli *clientv3.Client, hf *headFlags, bound net.Addr, log *slog.Logger) (*membership.HeadRegistration, error) {
	id := hf.headID
	if id == "" {
		id = defaultHeadID()
	}
	addr, err := apiAddr(bound, hf.advertise)
	if err != nil {
		return nil, err
	}
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	return membership.RegisterHead(rctx, cli, membership.HeadConfig{
		Cluster: hf.cluster,
		Head:    membership.Head{ID: id, Addr: addr, Version: version, StartedAt: time.Now().UTC()},
		TTL:     hf.leaseTTL,
		Logger:  log,
	})
}

// deregisterHead revokes the head's lease, bounded; calling it again does
// nothing.
func deregisterHead(reg *membership.HeadRegistration, log *slog.Logger) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if err := reg.Close(ctx); err != nil {
		log.Warn("troupe head: deregister", "err", err)
	}
}

// defaultHeadID is <hostname>-<pid>-<4 hex digits>: the host and process
// name the head for an operator, and the random part keeps a restarted
// container (same hostname, often pid 1) from meeting its predecessor's
// record, which lives until its lease expires.
func defaultHeadID() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "head"
	}
	host = strings.Map(func(r rune) rune {
		if r == '-' || r == '_' || r == '.' || (r >= 'a' && r <= 'z') || (r >= 'A' && r <= 'Z') || (r >= '0' && r <= '9') {
			return r
		}
		return '-'
	}, host)
	if len(host) > 100 {
		host = host[:100]
	}
	return fmt.Sprintf("%s-%d-%04x", host, os.Getpid(), rand.N(0x10000))
}

// apiAddr is the API address recorded for the head: --advertise (a host
// alone takes the bound port), else the bound address, with the hostname
// when it is bound to every interface.
func apiAddr(bound net.Addr, advertise string) (string, error) {
	_, port, err := net.SplitHostPort(bound.String())
	if err != nil {
		return "", fmt.Errorf("bound address %q: %w", bound, err)
	}
	if advertise != "" {
		h, p, err := net.SplitHostPort(advertise)
		if err != nil {
			h, p = strings.TrimSuffix(strings.TrimPrefix(advertise, "["), "]"), ""
		}
		if _, perr := strconv.ParseUint(p, 10, 16); h == "" || strings.ContainsAny(h, "/ ") || (p != "" && perr != nil) {
			return "", fmt.Errorf("invalid --advertise %q: want host or host:port", advertise)
		}
		if p != "" && p != "0" {
			port = p
		}
		return net.JoinHostPort(h, port), nil
	}
	host, _, _ := net.SplitHostPort(bound.String())
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		name, err := os.Hostname()
		if err != nil {
			return "", fmt.Errorf("listening on all interfaces and no --advertise: %w", err)
		}
		host = name
	}
	return net.JoinHostPort(host, port), nil
}
