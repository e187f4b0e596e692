package membership

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	grpcbackoff "google.golang.org/grpc/backoff"
)

// DefaultDialTimeout bounds Dial's connectivity check when
// ClientConfig.DialTimeout is zero.
const DefaultDialTimeout = 5 * time.Second

// ClientConfig says how to reach etcd; it mirrors etcdctl's flags.
type ClientConfig struct {
	Endpoints   []string
	CACert      string // --etcd-cacert
	Cert        string // --etcd-cert
	Key         string // --etcd-key
	Username    string // --etcd-user; "user:password" when Password is empty
	Password    string // --etcd-password
	DialTimeout time.Duration
}

// Dial connects to etcd and checks, within DialTimeout (default 5s) or
// until ctx ends, that the cluster answers a linearizable read. A dead
// endpoint fails within that bound with an error naming the endpoints. The
// caller closes the returned client.
//
// The client reconnects with a backoff capped at 2s, so watches and lease
// keepalives resume soon after etcd comes back, and it pings idle
// connections so a silently dead server is noticed.
func Dial(ctx context.Context, cfg ClientConfig) (*clientv3.Client, error) {
	if len(cfg.Endpoints) == 0 {
		return nil, errors.New("membership: no etcd endpoints")
	}
	for _, ep := range cfg.Endpoints {
		if strings.TrimSpace(ep) == "" {
			return nil, fmt.Errorf("membership: empty etcd endpoint in %q", cfg.Endpoints)
		}
	}
	timeout := cfg.DialTimeout
	if timeout <= 0 {
		timeout = DefaultDialTimeout
	}
	tlsCfg, err := clientTLS(cfg)
	if err != nil {
		return nil, err
	}
	user, password := cfg.Username, cfg.Password
	if password == "" {
		if u, p, ok := strings.Cut(user, ":"); ok {
			user, password = u, p
		}
	}
	if (user == "") != (password == "") {
		return nil, errors.New("membership: etcd user and password must be given together")
	}

	unreachable := func(err error) error {
		return fmt.Errorf("membership: etcd at %v unreachable after %v: %w", cfg.Endpoints, timeout, err)
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   cfg.Endpoints,
		TLS:         tlsCfg,
		Username:    user,
		Password:    password,
		DialTimeout: timeout, // bounds the authentication round trip
		// grpc-go raises a smaller ping interval to 10s; etcd answers
		// pings only while a stream is open (no PermitWithoutStream).
		DialKeepAliveTime:    10 * time.Second,
		DialKeepAliveTimeout: 3 * time.Second,
		DialOptions: []grpc.DialOption{grpc.WithConnectParams(grpc.ConnectParams{
			Backoff: grpcbackoff.Config{
				BaseDelay:  100 * time.Millisecond,
				Multiplier: 1.6,
				Jitter:     0.2,
				MaxDelay:   2 * time.Second,
			},
			MinConnectTimeout: timeout,
		})},
		Logger: zap.NewNop(), // errors reach callers; etcd's own logs would be noise
	})
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			return nil, unreachable(err)
		}
		return nil, fmt.Errorf("membership: etcd at %v: %w", cfg.Endpoints, err)
	}
	checkCtx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	// A linearizable read needs a leader: it proves the cluster can serve,
	// not just that a port is open. Denied access still proves that.
	_, err = cli.Get(checkCtx, KeyRoot, clientv3.WithCountOnly(), clientv3.WithLimit(1))
	if err != nil && !errors.Is(err, rpctypes.ErrPermissionDenied) {
		_ = cli.Close()
		if ctx.Err() != nil {
			return nil, fmt.Errorf("membership: dial etcd at %v: %w", cfg.Endpoints, ctx.Err())
		}
		return nil, unreachable(err)
	}
	return cli, nil
}

// clientTLS builds the TLS config as etcdctl does: from the given files, or
// the system roots when an endpoint is https and no file is given.
func clientTLS(cfg ClientConfig) (*tls.Config, error) {
	if cfg.CACert != "" || cfg.Cert != "" || cfg.Key != "" {
		if (cfg.Cert == "") != (cfg.Key == "") {
			return nil, errors.New("membership: etcd cert and key must be given together")
		}
		info := transport.TLSInfo{CertFile: cfg.Cert, KeyFile: cfg.Key, TrustedCAFile: cfg.CACert}
		tc, err := info.ClientConfig()
		if err != nil {
			return nil, fmt.Errorf("membership: etcd TLS: %w", err)
		}
		return tc, nil
	}
	for _, ep := range cfg.Endpoints {
		if strings.HasPrefix(ep, "https://") || strings.HasPrefix(ep, "unixs://") {
			return &tls.Config{MinVersion: tls.VersionTLS12}, nil
		}
	}
	return nil, nil
}
