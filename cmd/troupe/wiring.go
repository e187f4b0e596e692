package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc/credentials"

	"github.com/troupe-serving/troupe/pkg/clusterauth"
	"github.com/troupe-serving/troupe/pkg/telemetry"
	"github.com/troupe-serving/troupe/pkg/tlsconfig"
)

// tlsFlags configure the security of the head↔worker gRPC link: TLS (with
// only a CA the peer's certificate is verified; with a cert and key as
// well, the link is mutual TLS) and the cluster token (pkg/clusterauth),
// read from a file or $TROUPE_CLUSTER_TOKEN, never from argv.
type tlsFlags struct{ cert, key, ca, tokenFile string }

func addTLSFlags(fs *flag.FlagSet, what string) *tlsFlags {
	f := &tlsFlags{}
	fs.StringVar(&f.cert, "tls-cert", "", "certificate (PEM) for "+what)
	fs.StringVar(&f.key, "tls-key", "", "private key (PEM) for "+what)
	fs.StringVar(&f.ca, "tls-ca", "", "CA bundle (PEM) that peers' certificates must chain to ("+what+")")
	fs.StringVar(&f.tokenFile, "cluster-token-file", "", "file holding the cluster token that the head sends and workers require on every RPC (default: $"+clusterauth.EnvVar+"; never on the command line)")
	return f
}

// token is the cluster token: --cluster-token-file's, else
// $TROUPE_CLUSTER_TOKEN's, else "".
func (f *tlsFlags) token() (string, error) { return clusterauth.Load(f.tokenFile) }

// mutual reports whether the link is mutual TLS (a CA on the worker makes
// it require client certificates).
func (f *tlsFlags) mutual() bool { return f.ca != "" && f.cert != "" && f.key != "" }

func (f *tlsFlags) files() tlsconfig.Files {
	return tlsconfig.Files{Cert: f.cert, Key: f.key, CA: f.ca}
}

// clientCredentials are plaintext without TLS flags.
func (f *tlsFlags) clientCredentials() (credentials.TransportCredentials, error) {
	return tlsconfig.ClientCredentials(f.files())
}

// serverCredentials are plaintext without TLS flags.
func (f *tlsFlags) serverCredentials() (credentials.TransportCredentials, error) {
	return tlsconfig.ServerCredentials(f.files())
}

// otelFlags override the OTEL_EXPORTER_OTLP_* environment.
type otelFlags struct{ endpoint, protocol string }

func addOtelFlags(fs *flag.FlagSet) *otelFlags {
	f := &otelFlags{}
	fs.StringVar(&f.endpoint, "otlp-endpoint", "", "OTLP endpoint for traces (default: OTEL_EXPORTER_OTLP_ENDPOINT; none: nothing exported)")
	fs.StringVar(&f.protocol, "otlp-protocol", "", "OTLP protocol: grpc or http/protobuf (default: OTEL_EXPORTER_OTLP_PROTOCOL, then http/protobuf)")
	return f
}

// setup starts tracing for cfg.ServiceName with the flags' overrides. The
// returned function flushes and stops it, bounded.
func (f *otelFlags) setup(ctx context.Context, cfg telemetry.Config, log *slog.Logger) (*telemetry.Provider, func(), error) {
	cfg.ServiceVersion = version
	cfg.Endpoint, cfg.Protocol = f.endpoint, f.protocol
	cfg.Logger = log
	tp, err := telemetry.Setup(ctx, cfg)
	if err != nil {
		return nil, nil, err
	}
	return tp, func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := tp.Shutdown(sctx); err != nil {
			log.Warn("troupe: flushing traces", "service", cfg.ServiceName, "err", err)
		}
	}, nil
}

// logFlags choose the log level and format.
type logFlags struct{ level, format string }

func addLogFlags(fs *flag.FlagSet) *logFlags {
	f := &logFlags{}
	fs.StringVar(&f.level, "log-level", "info", "debug, info, warn or error")
	fs.StringVar(&f.format, "log-format", "text", "text or json")
	return f
}

// logger is the command's logger on stderr, buffered (see
// telemetry.NewBufferedLogger): the caller defers flush.
func (f *logFlags) logger() (log *slog.Logger, flush func()) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(f.level)); err != nil {
		fmt.Fprintf(os.Stderr, "troupe: invalid --log-level %q, using info\n", f.level)
		level = slog.LevelInfo
	}
	return telemetry.NewBufferedLogger(os.Stderr, level, strings.EqualFold(f.format, "json"))
}
