package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"google.golang.org/grpc"

	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/pkg/telemetry"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/sim"
)

// workerFlags are the flags of `troupe worker`; `troupe up` may reuse them.
type workerFlags struct {
	stage, replicaID, listen, advertise, engine, cluster, simRole, model string
	leaseTTL, drainTimeout, decodeLatency                                time.Duration
	numSpec, maxNumSeqs, maxBatchedTokens, numKVBlocks, blockSize        int
	prefillTPS                                                           float64
	noPrefixCaching                                                      bool
	tls                                                                  *tlsFlags
	otel                                                                 *otelFlags
	log                                                                  *logFlags
}

func addWorkerFlags(fs *flag.FlagSet) *workerFlags {
	f := &workerFlags{}
	fs.StringVar(&f.stage, "stage", "", "stage name, e.g. thinker, talker, vocoder (required)")
	fs.StringVar(&f.replicaID, "replica-id", "auto", "replica id: a number, or auto for the smallest free id of the stage")
	fs.StringVar(&f.listen, "listen", worker.DefaultListen, "gRPC listen address; port 0 picks a free port")
	fs.StringVar(&f.advertise, "advertise", "", "address registered in etcd (default: the bound address; the hostname when listening on all interfaces)")
	fs.StringVar(&f.engine, "engine", sim.EngineName, "engine: sim")
	fs.StringVar(&f.cluster, "cluster", membership.DefaultCluster, "cluster name (etcd key prefix)")
	fs.StringVar(&f.model, "model", "", "model name recorded in the member record (informational)")
	fs.DurationVar(&f.leaseTTL, "lease-ttl", membership.DefaultTTL, "etcd lease TTL of the registration")
	fs.DurationVar(&f.drainTimeout, "drain-timeout", worker.DefaultDrainTimeout, "how long in-flight requests may finish at shutdown")
	fs.IntVar(&f.numSpec, "num-speculative-tokens", 0, "speculative decoding draft positions K (0: off)")
	fs.StringVar(&f.simRole, "sim-role", "", "sim: text, codes or audio (default: from the stage name)")
	fs.IntVar(&f.maxNumSeqs, "max-num-seqs", sim.DefaultMaxNumSeqs, "sim: most requests running at once")
	fs.IntVar(&f.maxBatchedTokens, "max-num-batched-tokens", sim.DefaultMaxNumBatchedTokens, "sim: token budget of one engine step")
	fs.IntVar(&f.numKVBlocks, "num-kv-blocks", sim.DefaultNumKVBlocks, "sim: KV cache size in blocks")
	fs.IntVar(&f.blockSize, "block-size", sim.DefaultBlockSize, "sim: tokens per KV block")
	fs.BoolVar(&f.noPrefixCaching, "no-enable-prefix-caching", false, "sim: turn the prefix cache off")
	fs.Float64Var(&f.prefillTPS, "prefill-tps", 0, "sim: prefill throughput in tokens per second (0: instant)")
	fs.DurationVar(&f.decodeLatency, "decode-latency", 0, "sim: duration of one decode step (0: instant)")
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
	log := wf.log.logger()
	// Refuse bad flags before waiting on etcd.
	if _, _, err := parseReplicaID(wf.replicaID); err != nil {
		return err
	}
	if _, err := wf.simConfig(log); err != nil {
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
		r, err := sim.ParseRole(f.simRole)
		if err != nil {
			return sim.Config{}, err
		}
		role = r
	}
	cfg := sim.Config{
		Role:                 role,
		MaxNumSeqs:           f.maxNumSeqs,
		MaxNumBatchedTokens:  f.maxBatchedTokens,
		NumKVBlocks:          f.numKVBlocks,
		BlockSize:            f.blockSize,
		DisablePrefixCaching: f.noPrefixCaching,
		PrefillTokensPerSec:  f.prefillTPS,
		DecodeTokenLatency:   f.decodeLatency,
		NumSpeculativeTokens: f.numSpec,
		Logger:               log,
	}
	for name, v := range map[string]int{"max-num-seqs": f.maxNumSeqs, "max-num-batched-tokens": f.maxBatchedTokens, "num-kv-blocks": f.numKVBlocks, "block-size": f.blockSize} {
		if v <= 0 {
			return sim.Config{}, fmt.Errorf("--%s must be positive, got %d", name, v)
		}
	}
	return cfg, cfg.Validate()
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
// the member record once the replica is registered.
func serveWorker(ctx context.Context, cli *clientv3.Client, wf *workerFlags, log *slog.Logger, stdout io.Writer, ready chan<- membership.Member) error {
	if wf.engine != sim.EngineName {
		return fmt.Errorf("unknown --engine %q (supported: %s)", wf.engine, sim.EngineName)
	}
	id, auto, err := parseReplicaID(wf.replicaID)
	if err != nil {
		return err
	}
	simCfg, err := wf.simConfig(log)
	if err != nil {
		return err
	}
	creds, err := wf.tls.serverCredentials() // plaintext without TLS flags
	if err != nil {
		return err
	}
	tp, shutdown, err := wf.otel.setup(ctx, telemetry.Config{
		ServiceName:     "troupe-worker",
		ParentBasedOnly: true, // record exactly the requests the head sampled
	}, log)
	if err != nil {
		return err
	}
	defer shutdown()

	eng := sim.New(simCfg)
	defer eng.Close()
	srv, err := worker.New(worker.Config{
		Stage:        wf.stage,
		ReplicaID:    id,
		AutoID:       auto,
		Listen:       wf.listen,
		Advertise:    wf.advertise,
		Cluster:      wf.cluster,
		LeaseTTL:     wf.leaseTTL,
		DrainTimeout: wf.drainTimeout,
		Engine:       eng,
		Model:        wf.model,
		Version:      version,
		EtcdClient:   cli,
		Logger:       log,
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
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	select {
	case <-srv.Registered():
		m := srv.Member()
		fmt.Fprintf(stdout, "troupe worker: stage %s replica %d addr %s (cluster %s, engine %s, role %s, listening on %s)\n",
			m.Stage, m.ReplicaID, m.Addr, wf.cluster, m.Engine, simCfg.Role, srv.Addr())
		if ready != nil {
			select {
			case ready <- m:
			case <-ctx.Done():
			}
		}
	case err := <-done:
		return err
	}
	return <-done
}
