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
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/stats"

	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/pkg/clusterauth"
	"github.com/troupe-serving/troupe/pkg/oippb"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/telemetry"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/espeak"
	"github.com/troupe-serving/troupe/worker/oip"
	"github.com/troupe-serving/troupe/worker/openai"
	"github.com/troupe-serving/troupe/worker/sim"
)

// workerFlags are the flags of `troupe worker`; `troupe up` may reuse them.
type workerFlags struct {
	stage, replicaID, listen, advertise, engine, cluster, simRole, model string
	leaseTTL, drainTimeout, decodeLatency                                time.Duration
	numSpec, maxNumSeqs, maxBatchedTokens, numKVBlocks, blockSize        int
	prefillTPS                                                           float64
	encoderCacheEntries                                                  int
	encodeTimePerKiB                                                     time.Duration
	noPrefixCaching, advertiseDNS                                        bool
	upstream                                                             upstreamFlags
	voice, espeakBinary                                                  string
	metricsListen                                                        string
	espeakConcurrency                                                    int
	maxMessage, maxTensorPush, maxRequestTensors                         byteSize
	tls                                                                  *tlsFlags
	otel                                                                 *otelFlags
	log                                                                  *logFlags
}

// upstreamFlags configure the openai, openai-speech and openai-transcription
// engines, and (--upstream and the ready and health flags) the oip engine.
type upstreamFlags struct {
	url, model, apiKeyFile, ca, speechFormat string
	metrics                                  string // oip: the engine's Prometheus metrics URL
	readyTimeout, healthInterval             time.Duration
	healthFailures                           int
}

// Engine names --engine takes.
var engineNames = []string{sim.EngineName, openai.EngineName, openai.SpeechEngineName, openai.TranscriptionEngineName, espeak.EngineName, oip.EngineName}

func addWorkerFlags(fs *flag.FlagSet) *workerFlags {
	f := &workerFlags{maxMessage: stagepb.DefaultMaxMessageBytes, maxRequestTensors: worker.DefaultMaxRequestTensorBytes}
	fs.StringVar(&f.stage, "stage", "", "stage name, e.g. thinker, talker, vocoder (required)")
	fs.StringVar(&f.replicaID, "replica-id", "auto", "replica id: a number, or auto for the smallest free id of the stage")
	fs.StringVar(&f.listen, "listen", worker.DefaultListen, "gRPC listen address; port 0 picks a free port")
	fs.StringVar(&f.advertise, "advertise", "", "address registered in etcd (default: the bound address; the hostname when listening on all interfaces)")
	fs.BoolVar(&f.advertiseDNS, "advertise-dns", false, "listening on all interfaces without --advertise: advertise the name DNS gives this host's address (a reverse lookup checked forward; in compose, the container's name) instead of the hostname")
	fs.StringVar(&f.engine, "engine", sim.EngineName, "engine: sim, openai (an OpenAI-compatible server's completions), openai-speech (its /v1/audio/speech), openai-transcription (its /v1/audio/transcriptions), espeak (espeak-ng speech) or oip (an Open Inference Protocol engine over gRPC)")
	fs.StringVar(&f.cluster, "cluster", membership.DefaultCluster, "cluster name (etcd key prefix)")
	fs.StringVar(&f.model, "model", "", "model name recorded in the member record (informational); oip: the OIP model name (required)")
	fs.DurationVar(&f.leaseTTL, "lease-ttl", membership.DefaultTTL, "etcd lease TTL of the registration")
	fs.DurationVar(&f.drainTimeout, "drain-timeout", worker.DefaultDrainTimeout, "how long in-flight requests may finish at shutdown")
	fs.Var(&f.maxMessage, "max-message-bytes", "largest gRPC request accepted, prompt included: a `size` such as 17MiB, at least the head's --max-body-bytes plus 1MiB")
	fs.Var(&f.maxTensorPush, "max-tensor-push-bytes", "largest tensors of one engine chunk, sent worker to worker as one message: a `size` within 15/16 of --max-message-bytes (default: 16MiB, or 15/16 of --max-message-bytes when less)")
	fs.Var(&f.maxRequestTensors, "max-request-tensor-bytes", "most tensor bytes of one request, which a producing worker keeps until its consumer has them all: a `size`")
	fs.IntVar(&f.numSpec, "num-speculative-tokens", 0, "speculative decoding draft positions K (0: off)")
	fs.StringVar(&f.simRole, "sim-role", "", "sim: text, codes or audio (default: from the stage name)")
	fs.IntVar(&f.maxNumSeqs, "max-num-seqs", sim.DefaultMaxNumSeqs, "sim: most requests running at once")
	fs.IntVar(&f.maxBatchedTokens, "max-num-batched-tokens", sim.DefaultMaxNumBatchedTokens, "sim: token budget of one engine step")
	fs.IntVar(&f.numKVBlocks, "num-kv-blocks", sim.DefaultNumKVBlocks, "sim: KV cache size in blocks")
	fs.IntVar(&f.blockSize, "block-size", sim.DefaultBlockSize, "sim: tokens per KV block")
	fs.BoolVar(&f.noPrefixCaching, "no-enable-prefix-caching", false, "sim: turn the prefix cache off")
	fs.Float64Var(&f.prefillTPS, "prefill-tps", 0, "sim: prefill throughput in tokens per second (0: instant)")
	fs.DurationVar(&f.decodeLatency, "decode-latency", 0, "sim: duration of one decode step (0: instant)")
	fs.IntVar(&f.encoderCacheEntries, "encoder-cache-entries", sim.DefaultEncoderCacheEntries, "sim: media parts the multimodal encoder cache keeps")
	fs.DurationVar(&f.encodeTimePerKiB, "encode-time-per-kib", sim.DefaultEncodeTimePerKiB, "sim: encoder time per KiB of a media part missing from the encoder cache (negative: instant)")
	u := &f.upstream
	fs.StringVar(&u.url, "upstream", "", "openai engines: the upstream's base URL as OpenAI clients take it, e.g. http://127.0.0.1:8001/v1 (/v1 may be left out); oip: the engine's gRPC address, unix:///path/engine.sock or host:port")
	fs.StringVar(&u.model, "upstream-model", "", "openai engines: the upstream's model (default: the first of its /v1/models)")
	fs.StringVar(&u.apiKeyFile, "upstream-api-key-file", "", "openai engines: file holding the upstream's API key (default: $TROUPE_UPSTREAM_API_KEY; never on the command line)")
	fs.StringVar(&u.metrics, "upstream-metrics", "", "oip: the engine's Prometheus metrics URL, e.g. Triton's http://127.0.0.1:8002/metrics, scraped at every health check: the model's nv_inference_pending_request_count is reported as its queue (default: the load is this worker's requests in flight)")
	fs.StringVar(&u.ca, "upstream-ca", "", "openai engines: CA bundle (PEM) trusted for the upstream's TLS, on top of the system roots")
	fs.DurationVar(&u.readyTimeout, "upstream-ready-timeout", openai.DefaultReadyTimeout, "openai and oip engines: how long to wait for the upstream to be ready (openai: /health and the model listed; oip: ServerReady, ModelReady and the model's metadata) before giving up")
	fs.DurationVar(&u.healthInterval, "upstream-health-interval", openai.DefaultHealthInterval, "openai and oip engines: period of the upstream's health checks (and openai's metric scrapes)")
	fs.IntVar(&u.healthFailures, "upstream-health-failures", openai.DefaultHealthFailures, "openai and oip engines: failed health checks in a row that take the replica out of rotation")
	fs.StringVar(&u.speechFormat, "upstream-speech-format", openai.DefaultSpeechFormat, "openai-speech: response_format asked of /v1/audio/speech: wav or pcm (PCM16 at 24 kHz)")
	fs.StringVar(&f.voice, "voice", "", "speech engines: voice when the request names none (default: the upstream's own for openai-speech, en for espeak)")
	fs.StringVar(&f.espeakBinary, "espeak-binary", espeak.DefaultBinary, "espeak: the espeak-ng executable")
	fs.IntVar(&f.espeakConcurrency, "espeak-concurrency", runtime.NumCPU(), "espeak: most espeak-ng processes at once; more requests wait")
	fs.StringVar(&f.metricsListen, "metrics-listen", "", "serve the worker's own /metrics (troupe_etcd_up, troupe_lease_keepalive_lag_seconds, Go and process) and /healthz (a liveness probe) over plain HTTP on this address (default: none)")
	f.tls = addTLSFlags(fs, "the worker's gRPC server; a CA requires client certificates")
	f.otel = addOtelFlags(fs)
	f.log = addLogFlags(fs)
	return f
}

func runWorker(ctx context.Context, args []string, stdout io.Writer) error {
	fs := newFlagSet("worker")
	ef := addEtcdFlags(fs)
	wf := addWorkerFlags(fs)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if wf.stage == "" {
		fmt.Fprintln(fs.Output(), "troupe worker: --stage is required")
		return errUsage
	}
	log, flushLog := wf.log.logger()
	defer flushLog()
	ef.warnArgvPassword(fs, log)
	// Refuse bad flags before waiting on etcd.
	if _, _, err := parseReplicaID(wf.replicaID); err != nil {
		return err
	}
	if err := wf.checkEngine(log); err != nil {
		return err
	}
	cli, err := membership.Dial(ctx, ef.config())
	if err != nil {
		return err
	}
	defer cli.Close()
	return serveWorker(ctx, cli, wf, log, stdout, nil)
}

// simConfig builds the sim engine's configuration from the flags.
func (f *workerFlags) simConfig(log *slog.Logger) (sim.Config, error) {
	role := sim.RoleForStage(f.stage)
	if f.simRole != "" {
		r, err := stagepb.ParseRole(f.simRole)
		if err != nil {
			return sim.Config{}, err
		}
		role = r
	}
	cfg := sim.Config{
		Role:                 role,
		InputRole:            sim.InputRoleForStage(f.stage),
		MaxNumSeqs:           f.maxNumSeqs,
		MaxNumBatchedTokens:  f.maxBatchedTokens,
		NumKVBlocks:          f.numKVBlocks,
		BlockSize:            f.blockSize,
		DisablePrefixCaching: f.noPrefixCaching,
		PrefillTokensPerSec:  f.prefillTPS,
		DecodeTokenLatency:   f.decodeLatency,
		NumSpeculativeTokens: f.numSpec,
		EncoderCacheEntries:  f.encoderCacheEntries,
		EncodeTimePerKiB:     f.encodeTimePerKiB,
		Logger:               log,
	}
	for name, v := range map[string]int{"max-num-seqs": f.maxNumSeqs, "max-num-batched-tokens": f.maxBatchedTokens, "num-kv-blocks": f.numKVBlocks, "block-size": f.blockSize, "encoder-cache-entries": f.encoderCacheEntries} {
		if v <= 0 {
			return sim.Config{}, fmt.Errorf("--%s must be positive, got %d", name, v)
		}
	}
	return cfg, cfg.Validate()
}

// checkEngine refuses bad engine flags before anything waits on etcd or
// an upstream.
func (f *workerFlags) checkEngine(log *slog.Logger) error {
	if f.upstream.metrics != "" && f.engine != oip.EngineName {
		return fmt.Errorf("--upstream-metrics is for --engine oip (the openai engines scrape their upstream's /metrics themselves), not --engine %s", f.engine)
	}
	switch f.engine {
	case sim.EngineName:
		_, err := f.simConfig(log)
		return err
	case openai.EngineName, openai.SpeechEngineName, openai.TranscriptionEngineName:
		_, err := f.openaiConfig(log)
		return err
	case espeak.EngineName:
		_, err := exec.LookPath(f.espeakBinary)
		if err != nil {
			return fmt.Errorf("--engine espeak needs %s (Debian: apt-get install espeak-ng): %w", f.espeakBinary, err)
		}
		return nil
	case oip.EngineName:
		_, err := f.oipConfig(log)
		return err
	}
	return fmt.Errorf("unknown --engine %q (supported: %s)", f.engine, strings.Join(engineNames, ", "))
}

// openaiConfig builds the openai engines' configuration. The API key comes
// from --upstream-api-key-file, else TROUPE_UPSTREAM_API_KEY; never argv.
func (f *workerFlags) openaiConfig(log *slog.Logger) (openai.Config, error) {
	u := f.upstream
	if u.url == "" {
		return openai.Config{}, fmt.Errorf("--engine %s needs --upstream URL (e.g. http://127.0.0.1:8001/v1)", f.engine)
	}
	if _, _, err := openai.Endpoints(u.url); err != nil {
		return openai.Config{}, err
	}
	if u.speechFormat != "wav" && u.speechFormat != "pcm" {
		return openai.Config{}, fmt.Errorf("--upstream-speech-format %q: want wav or pcm", u.speechFormat)
	}
	if u.healthFailures < 1 || u.healthInterval <= 0 || u.readyTimeout <= 0 {
		return openai.Config{}, errors.New("--upstream-health-failures, --upstream-health-interval and --upstream-ready-timeout must be positive")
	}
	key := os.Getenv("TROUPE_UPSTREAM_API_KEY")
	if u.apiKeyFile != "" {
		b, err := os.ReadFile(u.apiKeyFile)
		if err != nil {
			return openai.Config{}, fmt.Errorf("--upstream-api-key-file: %w", err)
		}
		key = strings.TrimSpace(string(b))
	}
	return openai.Config{
		URL:            u.url,
		Model:          u.model,
		APIKey:         key,
		CAFile:         u.ca,
		ReadyTimeout:   u.readyTimeout,
		HealthInterval: u.healthInterval,
		HealthFailures: u.healthFailures,
		Voice:          f.voice,
		SpeechFormat:   u.speechFormat,
		Logger:         log,
	}, nil
}

// oipConfig builds the oip engine's configuration: --upstream is the
// engine's gRPC address, --model its OIP model name; both required. The
// openai engines' TLS, key and model flags do not apply.
func (f *workerFlags) oipConfig(log *slog.Logger) (oip.Config, error) {
	u := f.upstream
	if u.url == "" {
		return oip.Config{}, errors.New("--engine oip needs --upstream ADDR (unix:///path/engine.sock or host:port)")
	}
	if err := oip.CheckAddr(u.url); err != nil {
		return oip.Config{}, err
	}
	if f.model == "" {
		return oip.Config{}, errors.New("--engine oip needs --model NAME (the OIP model name)")
	}
	if u.model != "" || u.apiKeyFile != "" || u.ca != "" {
		return oip.Config{}, errors.New("--upstream-model, --upstream-api-key-file and --upstream-ca are for the openai engines; --engine oip takes --model and a local --upstream address")
	}
	if u.healthFailures < 1 || u.healthInterval <= 0 || u.readyTimeout <= 0 {
		return oip.Config{}, errors.New("--upstream-health-failures, --upstream-health-interval and --upstream-ready-timeout must be positive")
	}
	if u.metrics != "" {
		if err := oip.CheckMetricsURL(u.metrics); err != nil {
			return oip.Config{}, fmt.Errorf("--upstream-metrics: %w", err)
		}
	}
	return oip.Config{
		Upstream:       u.url,
		Model:          f.model,
		ReadyTimeout:   u.readyTimeout,
		HealthInterval: u.healthInterval,
		HealthFailures: u.healthFailures,
		MetricsURL:     u.metrics,
		Logger:         log,
	}, nil
}

// runnableEngine is an engine and what must run beside it for as long as
// the worker serves: the sim's scheduler, an upstream's monitor.
type runnableEngine struct {
	worker.Engine
	// run runs until ctx ends (then it returns nil), or fails (the
	// upstream never became ready). nil: nothing to run.
	run func(ctx context.Context) error
	// ready, when not nil, is closed once the engine knows its roles (an
	// oip engine, from its model's metadata): the worker is built after
	// it, since it checks input against the roles of its engine's first
	// Health.
	ready <-chan struct{}
}

// buildEngine makes the --engine engine. dial is added to the dial options
// of an engine that dials gRPC (oip).
func (f *workerFlags) buildEngine(log *slog.Logger, dial []grpc.DialOption) (runnableEngine, error) {
	switch f.engine {
	case sim.EngineName:
		cfg, err := f.simConfig(log)
		if err != nil {
			return runnableEngine{}, err
		}
		eng := sim.New(cfg)
		return runnableEngine{Engine: eng, run: eng.Run}, nil
	case openai.EngineName, openai.SpeechEngineName, openai.TranscriptionEngineName:
		cfg, err := f.openaiConfig(log)
		if err != nil {
			return runnableEngine{}, err
		}
		switch f.engine {
		case openai.SpeechEngineName:
			eng, err := openai.NewSpeech(cfg)
			return runnableEngine{Engine: eng, run: eng.Run}, err
		case openai.TranscriptionEngineName:
			eng, err := openai.NewTranscription(cfg)
			return runnableEngine{Engine: eng, run: eng.Run}, err
		}
		eng, err := openai.New(cfg)
		return runnableEngine{Engine: eng, run: eng.Run}, err
	case espeak.EngineName:
		eng, err := espeak.New(espeak.Config{Binary: f.espeakBinary, Voice: f.voice, Concurrency: f.espeakConcurrency, Logger: log})
		return runnableEngine{Engine: eng}, err
	case oip.EngineName:
		cfg, err := f.oipConfig(log)
		if err != nil {
			return runnableEngine{}, err
		}
		cfg.DialOptions = dial
		eng, err := oip.New(cfg)
		if err != nil {
			return runnableEngine{}, err
		}
		// The connection closes when Run returns: after the worker has
		// drained (serveWorker).
		run := func(ctx context.Context) error {
			defer eng.Close()
			return eng.Run(ctx)
		}
		return runnableEngine{Engine: eng, run: run, ready: eng.Ready()}, nil
	}
	return runnableEngine{}, fmt.Errorf("unknown --engine %q (supported: %s)", f.engine, strings.Join(engineNames, ", "))
}

// parseReplicaID reads --replica-id: a number or "auto".
func parseReplicaID(s string) (id uint32, auto bool, err error) {
	if strings.EqualFold(s, "auto") {
		return 0, true, nil
	}
	n, err := strconv.ParseUint(s, 10, 32)
	if err != nil {
		return 0, false, fmt.Errorf("invalid --replica-id %q: want a number or auto", s)
	}
	return uint32(n), false, nil
}

// serveWorker runs a worker until ctx ends. ready, when not nil, receives
// the member record once the replica is registered. The engine lives
// until the server has drained; an engine that fails (an upstream that is
// never ready) stops the worker with its error.
func serveWorker(ctx context.Context, cli *clientv3.Client, wf *workerFlags, log *slog.Logger, stdout io.Writer, ready chan<- membership.Member) error {
	id, auto, err := parseReplicaID(wf.replicaID)
	if err != nil {
		return err
	}
	if err := wf.checkEngine(log); err != nil {
		return err
	}
	creds, err := wf.tls.serverCredentials() // plaintext without TLS flags
	if err != nil {
		return err
	}
	peerCreds, err := wf.tls.clientCredentials()
	if err != nil {
		return err
	}
	token, err := wf.tls.token()
	if err != nil {
		return err
	}
	if token == "" && !wf.tls.mutual() && !loopbackOnly(wf.listen) {
		log.Warn("troupe worker: anyone who reaches this port can generate, sleep and drain this replica: set --cluster-token-file (or TROUPE_CLUSTER_TOKEN) or mutual TLS (docs/security.md)", "listen", wf.listen)
	}
	tp, shutdown, err := wf.otel.setup(ctx, telemetry.Config{
		ServiceName:     "troupe-worker",
		ParentBasedOnly: true, // record exactly the requests the head sampled
	}, log)
	if err != nil {
		return err
	}
	defer shutdown()

	var engineDial []grpc.DialOption
	if tp.Enabled() {
		// The trace of a request the head sampled goes on into the engine
		// process: its ModelStreamInfer calls only, not the health checks.
		engineDial = append(engineDial, grpc.WithStatsHandler(otelgrpc.NewClientHandler(
			otelgrpc.WithTracerProvider(tp.TracerProvider()),
			otelgrpc.WithPropagators(tp.Propagator()),
			otelgrpc.WithFilter(func(info *stats.RPCTagInfo) bool {
				return info.FullMethodName == oippb.GRPCInferenceService_ModelStreamInfer_FullMethodName
			}),
		)))
	}
	eng, err := wf.buildEngine(log, engineDial)
	if err != nil {
		return err
	}
	// The engine's context is not ctx: it must outlive the drain.
	engCtx, stopEngine := context.WithCancel(context.WithoutCancel(ctx))
	defer stopEngine()
	engDone := make(chan error, 1)
	if eng.run != nil {
		go func() { engDone <- eng.run(engCtx) }()
	} else {
		go func() { <-engCtx.Done(); engDone <- nil }()
	}
	defer func() { stopEngine(); <-engDone }()
	if eng.ready != nil {
		log.Info("troupe worker: waiting for the engine and its model's metadata before serving", "upstream", wf.upstream.url, "model", wf.model, "timeout", wf.upstream.readyTimeout)
		select {
		case <-eng.ready:
		case err := <-engDone:
			engDone <- err // for the deferred wait
			return err
		case <-ctx.Done():
			return nil
		}
	}

	metrics, metricsAddr, stopMetrics, err := serveWorkerMetrics(wf.metricsListen, log, stdout)
	if err != nil {
		return err
	}
	defer stopMetrics()
	replicaStats, err := newWorkerStats(metrics, wf.stage, workerModel(wf.model, eng.Engine, wf.stage), log)
	if err != nil {
		return err
	}
	if !auto {
		replicaStats.bind(id, eng.Health())
	}

	advertise := wf.advertise
	if wf.advertiseDNS && advertise == "" && allInterfaces(wf.listen) {
		advertise = dnsAdvertise(ctx, log)
	}
	srv, err := worker.New(worker.Config{
		Stage:           wf.stage,
		ReplicaID:       id,
		AutoID:          auto,
		Listen:          wf.listen,
		Advertise:       advertise,
		Cluster:         wf.cluster,
		LeaseTTL:        wf.leaseTTL,
		DrainTimeout:    wf.drainTimeout,
		MaxMessageBytes: int(min(int64(wf.maxMessage), math.MaxInt32)),
		// Tensors go to other workers with this worker's identity: its
		// certificate as a client, the cluster's CA and token, as the head's.
		MaxTensorPushBytes:    int64(wf.maxTensorPush),
		MaxRequestTensorBytes: int64(wf.maxRequestTensors),
		PeerDialOptions:       peerDialOptions(peerCreds, token, tp),
		Engine:                eng.Engine,
		ClusterToken:          token,
		Model:                 wf.model,
		Version:               version,
		EtcdClient:            cli,
		Metrics:               metrics,
		MetricsAddr:           metricsAddr,
		Observer:              replicaStats.observer(),
		Logger:                log,
		ServerOptions: []grpc.ServerOption{
			grpc.Creds(creds),
			grpc.StatsHandler(otelgrpc.NewServerHandler(
				otelgrpc.WithTracerProvider(tp.TracerProvider()),
				otelgrpc.WithPropagators(tp.Propagator()),
				otelgrpc.WithFilter(telemetry.TraceRPC),
			)),
		},
	})
	if err != nil {
		return err
	}
	srvCtx, stopServer := context.WithCancel(ctx)
	defer stopServer()
	done := make(chan error, 1)
	go func() { done <- srv.Run(srvCtx) }()
	if wf.engine == openai.EngineName || wf.engine == openai.SpeechEngineName || wf.engine == openai.TranscriptionEngineName {
		log.Info("troupe worker: waiting for the upstream before registering", "upstream", wf.upstream.url, "timeout", wf.upstream.readyTimeout)
	}
	registered := srv.Registered()
	for {
		select {
		case <-registered:
			registered = nil
			m := srv.Member()
			if auto {
				replicaStats.bind(m.ReplicaID, eng.Health()) // known now
			}
			fmt.Fprintf(stdout, "troupe worker: stage %s replica %d addr %s (cluster %s, engine %s, role %s, listening on %s)\n",
				m.Stage, m.ReplicaID, m.Addr, wf.cluster, m.Engine, roleOf(eng.Health()), srv.Addr())
			if ready != nil {
				select {
				case ready <- m:
				case <-ctx.Done():
				}
			}
		case err := <-done:
			return err
		case err := <-engDone:
			engDone <- err // for the deferred wait
			stopServer()
			serr := <-done
			if err != nil {
				return err
			}
			return serr
		}
	}
}

// serveWorkerMetrics serves a fresh registry's /metrics on listen until
// stop is called (stop waits for the server). With an empty listen there is
// no endpoint: the registerer is nil (an untyped nil, which
// worker.Config.Metrics takes for none) and stop does nothing.
func serveWorkerMetrics(listen string, log *slog.Logger, stdout io.Writer) (_ prometheus.Registerer, addr string, stop func(), err error) {
	if listen == "" {
		return nil, "", func() {}, nil
	}
	lis, err := net.Listen("tcp", listen)
	if err != nil {
		return nil, "", nil, fmt.Errorf("troupe worker: --metrics-listen: %w", err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	// A liveness probe: the process answers, whatever its engine's or
	// drain's state (gRPC health says NOT_SERVING for those, which a
	// liveness probe must not restart the worker for).
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok\n") })
	hs := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	served := make(chan struct{})
	go func() {
		defer close(served)
		if err := hs.Serve(lis); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("troupe worker: metrics server stopped", "err", err)
		}
	}()
	fmt.Fprintf(stdout, "troupe worker: metrics on http://%s/metrics\n", lis.Addr())
	return reg, lis.Addr().String(), func() { _ = hs.Close(); <-served }, nil
}

// allInterfaces reports whether listen binds every interface (no host,
// 0.0.0.0 or ::), where a worker advertises its hostname by default.
func allInterfaces(listen string) bool {
	host, _, err := net.SplitHostPort(listen)
	if err != nil {
		return false
	}
	ip := net.ParseIP(host)
	return host == "" || (ip != nil && ip.IsUnspecified())
}

// dnsAdvertise is the host --advertise-dns advertises: the name DNS gives
// one of this host's addresses, or "" (the hostname) when none has one,
// which it logs.
func dnsAdvertise(ctx context.Context, log *slog.Logger) string {
	ips, err := hostIPs()
	if err != nil {
		log.Warn("troupe worker: --advertise-dns: this host's addresses; advertising the hostname", "err", err)
		return ""
	}
	lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	name := reverseName(lctx, nameservers("/etc/resolv.conf"), net.DefaultResolver, ips)
	if name == "" {
		log.Warn("troupe worker: --advertise-dns: no DNS name of this host's addresses leads back to it; advertising the hostname", "addresses", ips)
	}
	return name
}

// loopbackOnly reports whether listen binds a loopback address only.
func loopbackOnly(listen string) bool {
	host, _, err := net.SplitHostPort(listen)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// roleOf describes what an engine takes and gives, e.g. "text → audio";
// just the role when it takes what the sim's role would.
func roleOf(h *stagepb.HealthResponse) string {
	in, out := h.EffectiveInputRole(), h.EffectiveRole()
	if (out == stagepb.RoleAudio && in == stagepb.RoleCodes) || (out != stagepb.RoleAudio && in == stagepb.RoleText) {
		return out
	}
	return in + " → " + out
}

// peerDialOptions connect a worker to the workers its engine's tensors go
// to (PushTensors): its TLS as a client, the cluster token, and trace
// context, as the head's calls carry them.
func peerDialOptions(creds credentials.TransportCredentials, token string, tp *telemetry.Provider) []grpc.DialOption {
	opts := []grpc.DialOption{grpc.WithTransportCredentials(creds)}
	if token != "" {
		opts = append(opts, clusterauth.DialOption(token))
	}
	if tp.Enabled() {
		opts = append(opts, grpc.WithStatsHandler(otelgrpc.NewClientHandler(
			otelgrpc.WithTracerProvider(tp.TracerProvider()), otelgrpc.WithPropagators(tp.Propagator()))))
	}
	return opts
}
