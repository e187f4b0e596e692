// Package embedetcd runs an etcd server in this process with the official
// server/v3/embed package: a single node by default, or one member of a
// cluster bootstrapped from a static initial cluster. `troupe etcd`,
// `troupe up` and the tests (through membershiptest) share it.
//
// Compared to embed.StartEtcd it adds three things: sane defaults for one
// node (advertised URLs are the listen URLs, the initial cluster is this
// node), a bounded wait for readiness, and a fast Close: open client streams
// (watches, lease keepalives) are cancelled first, so the server does not
// wait its request timeout (over 5s) for them to end on their own.
package embedetcd

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	"go.etcd.io/etcd/client/pkg/v3/types"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// DefaultClientURL is where the server serves clients when
// Config.ListenClientURLs is empty, and where troupe's clients look for
// etcd by default.
const DefaultClientURL = "http://127.0.0.1:2379"

// Config says where the server keeps its data and listens.
type Config struct {
	// Name of the member; default "default".
	Name string
	// DataDir holds the WAL and the database. Required.
	DataDir string
	// ListenClientURLs default to DefaultClientURL. A port 0 binds a
	// free port; ClientURLs reports the bound one.
	ListenClientURLs []string
	// ListenPeerURLs default to the first client URL's host with the next
	// port (2380 for 2379), so servers on different client ports do not
	// clash; a client port 0 gives a peer port 0. A single node never dials
	// its own peer URL.
	ListenPeerURLs []string
	// AdvertiseClientURLs default to ListenClientURLs; an unspecified host
	// (0.0.0.0, [::]) is replaced by the host name.
	AdvertiseClientURLs []string
	// AdvertisePeerURLs default to ListenPeerURLs, likewise.
	AdvertisePeerURLs []string
	// InitialCluster lists every member of a new cluster as etcd's
	// --initial-cluster does: "name=peerURL,name2=peerURL2" (a name may
	// repeat for several URLs). It must name this member (Name) with its
	// AdvertisePeerURLs. Default: this member alone.
	InitialCluster string
	// ClusterState is "new" (default) to bootstrap a cluster with
	// InitialCluster, or "existing" to join one whose members already run
	// (the member was added with `etcdctl member add` first).
	ClusterState string
	// ClusterToken keeps the members of different clusters bootstrapped
	// with the same InitialCluster apart; default etcd's "etcd-cluster".
	ClusterToken string
	// TickMs and ElectionMs are raft's heartbeat and election timeout;
	// defaults 100 and 1000 as in etcd. The smallest lease TTL etcd grants
	// is 1.5 × ElectionMs (rounded up to seconds).
	TickMs, ElectionMs uint
	// SnapshotCount: committed entries between snapshots; default etcd's.
	SnapshotCount uint64
	// UnsafeNoFsync turns fsync off. Faster, loses data on power loss:
	// only for throwaway test servers.
	UnsafeNoFsync bool
	// ClientCertFile and ClientKeyFile serve clients over TLS (listen URLs
	// must then be https://). With ClientCAFile as well, clients must show
	// a certificate that chains to it (mutual TLS), as etcd's
	// --client-cert-auth --trusted-ca-file.
	ClientCertFile, ClientKeyFile, ClientCAFile string
	// Logger receives etcd's logs; nil logs warnings and errors to stderr.
	Logger *zap.Logger
}

// Server is a running etcd. Close it exactly once it is no longer needed;
// Close is safe to call more than once and from any goroutine.
type Server struct {
	etcd        *embed.Etcd
	clientURLs  []string
	closeOnce   sync.Once
	closing     atomic.Bool
	stopping    chan struct{} // closed by Close: ends every client stream
	stopStreams func()
}

// Start starts the server and waits until it serves clients, ctx ends, or
// the server fails. On error nothing is left running.
func Start(ctx context.Context, cfg Config) (*Server, error) {
	if cfg.DataDir == "" {
		return nil, errors.New("embedetcd: data dir is required")
	}
	ec := embed.NewConfig()
	ec.Dir = cfg.DataDir
	if cfg.Name != "" {
		ec.Name = cfg.Name
	}
	var err error
	if ec.ListenClientUrls, err = parseURLs("listen client", cfg.ListenClientURLs, DefaultClientURL); err != nil {
		return nil, err
	}
	peerDefault, err := nextPort(ec.ListenClientUrls[0])
	if err != nil {
		return nil, err
	}
	if ec.ListenPeerUrls, err = parseURLs("listen peer", cfg.ListenPeerURLs, peerDefault); err != nil {
		return nil, err
	}
	if ec.AdvertiseClientUrls, err = parseURLs("advertise client", cfg.AdvertiseClientURLs, ""); err != nil {
		return nil, err
	}
	if len(ec.AdvertiseClientUrls) == 0 {
		ec.AdvertiseClientUrls = advertised(ec.ListenClientUrls)
	}
	if ec.AdvertisePeerUrls, err = parseURLs("advertise peer", cfg.AdvertisePeerURLs, ""); err != nil {
		return nil, err
	}
	if len(ec.AdvertisePeerUrls) == 0 {
		ec.AdvertisePeerUrls = advertised(ec.ListenPeerUrls)
	}
	if err := initialCluster(ec, cfg); err != nil {
		return nil, err
	}
	if cfg.TickMs > 0 {
		ec.TickMs = cfg.TickMs
	}
	if cfg.ElectionMs > 0 {
		ec.ElectionMs = cfg.ElectionMs
	}
	if cfg.SnapshotCount > 0 {
		ec.SnapshotCount = cfg.SnapshotCount
	}
	ec.UnsafeNoFsync = cfg.UnsafeNoFsync
	if err := clientTLS(ec, cfg); err != nil {
		return nil, err
	}
	lg := cfg.Logger
	if lg == nil {
		lg = stderrLogger(zapcore.WarnLevel)
	}
	s := &Server{}
	// etcd reports its own listeners closing as errors: noise on shutdown.
	lg = lg.WithOptions(zap.WrapCore(func(c zapcore.Core) zapcore.Core {
		return quietWhileClosing{Core: c, closing: &s.closing}
	}))
	ec.ZapLoggerBuilder = embed.NewZapLoggerBuilder(lg)

	s.stopping = make(chan struct{})
	var stopOnce sync.Once
	s.stopStreams = func() { stopOnce.Do(func() { close(s.stopping) }) }
	// Cancel every client stream when Close begins (see the package doc).
	ec.GRPCAdditionalServerOptions = append(ec.GRPCAdditionalServerOptions,
		grpc.ChainStreamInterceptor(s.cancelStreamsOnClose))

	e, err := embed.StartEtcd(ec)
	if err != nil {
		s.stopStreams()
		return nil, fmt.Errorf("embedetcd: start: %w", err)
	}
	s.etcd = e
	for _, l := range e.Clients {
		u := url.URL{Scheme: "http", Host: l.Addr().String()}
		if ec.ListenClientUrls[0].Scheme == "https" {
			u.Scheme = "https"
		}
		s.clientURLs = append(s.clientURLs, u.String())
	}
	select {
	case <-e.Server.ReadyNotify():
		return s, nil
	case err := <-e.Err():
		s.Close()
		return nil, fmt.Errorf("embedetcd: server failed while starting: %w", err)
	case <-ctx.Done():
		s.Close()
		return nil, fmt.Errorf("embedetcd: not ready: %w", ctx.Err())
	}
}

// ClientURLs are the URLs clients reach the server at, with bound ports.
func (s *Server) ClientURLs() []string { return append([]string(nil), s.clientURLs...) }

// Err reports a fatal server error; it is closed once the server is over.
func (s *Server) Err() <-chan error { return s.etcd.Err() }

// Close stops the server and waits until it has stopped.
func (s *Server) Close() {
	s.closeOnce.Do(func() {
		s.closing.Store(true)
		s.stopStreams()
		s.etcd.Close()
		<-s.etcd.Server.StopNotify()
	})
}

// cancelStreamsOnClose gives each stream a context that ends when Close
// begins, so watch and keepalive handlers return and graceful stop is quick.
// The client sees Unavailable, as when a server process goes away.
func (s *Server) cancelStreamsOnClose(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	ctx, cancel := context.WithCancel(ss.Context())
	defer cancel()
	handled := make(chan struct{})
	defer close(handled)
	go func() {
		select {
		case <-s.stopping:
			cancel()
		case <-handled:
		}
	}()
	err := handler(srv, &streamWithContext{ServerStream: ss, ctx: ctx})
	if isClosed(s.stopping) && ss.Context().Err() == nil {
		// As if the process had gone: clients retry Unavailable (on another
		// endpoint, or here after a restart); Canceled would end their watch.
		return status.Error(codes.Unavailable, "embedetcd: server stopping")
	}
	return err
}

func isClosed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// streamWithContext swaps a stream's context, as grpc-go's wrapped streams do.
type streamWithContext struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *streamWithContext) Context() context.Context { return s.ctx }

// initialCluster sets the bootstrap membership and checks it names this
// member at its advertised peer URLs, so a typo fails here with a message
// that names the flag values rather than deep in raft's bootstrap.
func initialCluster(ec *embed.Config, cfg Config) error {
	switch cfg.ClusterState {
	case "", embed.ClusterStateFlagNew:
		ec.ClusterState = embed.ClusterStateFlagNew
	case embed.ClusterStateFlagExisting:
		ec.ClusterState = embed.ClusterStateFlagExisting
	default:
		return fmt.Errorf("embedetcd: cluster state %q: want %q or %q", cfg.ClusterState, embed.ClusterStateFlagNew, embed.ClusterStateFlagExisting)
	}
	if cfg.ClusterToken != "" {
		ec.InitialClusterToken = cfg.ClusterToken
	}
	if strings.TrimSpace(cfg.InitialCluster) == "" {
		ec.InitialCluster = ec.InitialClusterFromName(ec.Name)
		return nil
	}
	members, err := types.NewURLsMap(cfg.InitialCluster)
	if err != nil {
		return fmt.Errorf("embedetcd: initial cluster %q: want name=http://host:port,...: %w", cfg.InitialCluster, err)
	}
	for name, urls := range members {
		if name == "" {
			return fmt.Errorf("embedetcd: initial cluster %q: a member has no name", cfg.InitialCluster)
		}
		for _, u := range urls {
			if u.Scheme != "http" && u.Scheme != "https" || u.Port() == "" {
				return fmt.Errorf("embedetcd: initial cluster: member %q peer URL %q: want http://host:port", name, u.String())
			}
		}
	}
	mine, ok := members[ec.Name]
	if !ok {
		return fmt.Errorf("embedetcd: initial cluster %q does not name this member %q", cfg.InitialCluster, ec.Name)
	}
	for _, adv := range ec.AdvertisePeerUrls {
		if !slices.ContainsFunc(mine, func(u url.URL) bool { return u.String() == adv.String() }) {
			return fmt.Errorf("embedetcd: initial cluster gives member %q the peer URLs %s, not its advertised peer URL %s", ec.Name, mine.String(), adv.String())
		}
	}
	ec.InitialCluster = members.String()
	return nil
}

// clientTLS configures TLS for clients and checks that it agrees with the
// listen URLs' schemes, so a half-configured server fails at start.
func clientTLS(ec *embed.Config, cfg Config) error {
	https := false
	for _, u := range ec.ListenClientUrls {
		if u.Scheme == "https" {
			https = true
		}
	}
	tlsSet := cfg.ClientCertFile != "" || cfg.ClientKeyFile != ""
	switch {
	case cfg.ClientCAFile != "" && !tlsSet:
		return errors.New("embedetcd: a client CA needs a server certificate and key")
	case tlsSet && (cfg.ClientCertFile == "" || cfg.ClientKeyFile == ""):
		return errors.New("embedetcd: client TLS needs both a certificate and a key")
	case tlsSet && !https:
		return errors.New("embedetcd: client TLS needs https:// listen client URLs")
	case https && !tlsSet:
		return errors.New("embedetcd: https:// listen client URLs need a certificate and key")
	case !tlsSet:
		return nil
	}
	ec.ClientTLSInfo = transport.TLSInfo{
		CertFile:       cfg.ClientCertFile,
		KeyFile:        cfg.ClientKeyFile,
		TrustedCAFile:  cfg.ClientCAFile,
		ClientCertAuth: cfg.ClientCAFile != "",
	}
	return nil
}

func parseURLs(what string, in []string, def string) ([]url.URL, error) {
	if len(in) == 0 && def != "" {
		in = []string{def}
	}
	out := make([]url.URL, 0, len(in))
	for _, raw := range in {
		u, err := url.Parse(raw)
		if err != nil {
			return nil, fmt.Errorf("embedetcd: %s URL %q: %w", what, raw, err)
		}
		if u.Scheme != "http" && u.Scheme != "https" || u.Host == "" {
			return nil, fmt.Errorf("embedetcd: %s URL %q: want http://host:port", what, raw)
		}
		out = append(out, *u)
	}
	return out, nil
}

// nextPort is u with its port plus one (port 0 stays 0), as a string.
func nextPort(u url.URL) (string, error) {
	host, port, err := net.SplitHostPort(u.Host)
	if err != nil {
		return "", fmt.Errorf("embedetcd: client URL %q: %w", u.String(), err)
	}
	p, err := strconv.Atoi(port)
	if err != nil || p < 0 || p > 65534 {
		return "", fmt.Errorf("embedetcd: client URL %q: bad port", u.String())
	}
	if p > 0 {
		p++
	}
	u.Host = net.JoinHostPort(host, strconv.Itoa(p))
	return u.String(), nil
}

// advertised copies listen URLs, naming this host where they bind all
// interfaces: 0.0.0.0 is not an address a client can dial.
func advertised(listen []url.URL) []url.URL {
	out := slices.Clone(listen)
	for i, u := range out {
		host, port, err := net.SplitHostPort(u.Host)
		if err != nil {
			continue
		}
		if ip := net.ParseIP(host); host == "" || ip != nil && ip.IsUnspecified() {
			if name, err := os.Hostname(); err == nil && name != "" {
				out[i].Host = net.JoinHostPort(name, port)
			}
		}
	}
	return out
}

// stderrLogger is a plain console logger at the given level.
func stderrLogger(level zapcore.Level) *zap.Logger {
	zc := zap.NewProductionConfig()
	zc.Level = zap.NewAtomicLevelAt(level)
	zc.Encoding = "console"
	zc.EncoderConfig.EncodeTime = zapcore.ISO8601TimeEncoder
	zc.Sampling = nil
	zc.DisableStacktrace = true
	lg, err := zc.Build()
	if err != nil {
		return zap.NewNop()
	}
	return lg
}

// LoggerAt returns a stderr logger at a level named like zap's ("debug",
// "info", "warn", "error").
func LoggerAt(level string) (*zap.Logger, error) {
	l, err := zapcore.ParseLevel(level)
	if err != nil {
		return nil, fmt.Errorf("embedetcd: log level %q: %w", level, err)
	}
	return stderrLogger(l), nil
}

// quietWhileClosing drops warnings and errors once Close has begun.
type quietWhileClosing struct {
	zapcore.Core
	closing *atomic.Bool
}

func (q quietWhileClosing) With(fields []zapcore.Field) zapcore.Core {
	return quietWhileClosing{Core: q.Core.With(fields), closing: q.closing}
}

func (q quietWhileClosing) Check(e zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	if q.closing.Load() && e.Level >= zapcore.WarnLevel && e.Level < zapcore.DPanicLevel {
		return ce
	}
	return q.Core.Check(e, ce)
}
