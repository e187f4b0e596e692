// Package membershiptest starts a real, embedded, single-node etcd for tests.
//
//	e := membershiptest.Start(t)      // stopped and removed at cleanup
//	cli := e.Client(t)                // closed at cleanup
//	e.Stop(); e.Restart(t)            // same data dir, same client URL
//
// The server listens on a free loopback port, keeps its data in t.TempDir,
// and logs nothing unless TROUPE_TEST_ETCD_LOG is set to a zap level
// ("debug", "info", "warn", "error").
//
// Unless Options.Fsync is set, the server runs with etcd's unsafe-no-fsync:
// it only loses data on power loss, which no test survives anyway, and it
// keeps tests fast on a loaded disk. Benchmarks of write latency must set
// Fsync to measure what production pays.
//
// Raft ticks are short (20ms heartbeat, 200ms election), so the server is
// ready within tens of milliseconds and etcd grants leases as short as 1s.
package membershiptest

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"

	"github.com/troupe-serving/troupe/membership/embedetcd"
)

// Options tune Start.
type Options struct {
	// Fsync keeps etcd's fsync on (production behaviour, slower writes).
	Fsync bool
}

// Etcd is a test etcd server. Its methods may be called from any goroutine.
type Etcd struct {
	opts    Options
	dataDir string

	mu        sync.Mutex
	clientURL string // fixed by the first start: Restart reuses the port
	srv       *embedetcd.Server
}

// Start starts an etcd server and registers its stop with t.Cleanup.
func Start(t testing.TB) *Etcd { return StartWith(t, Options{}) }

// StartWith is Start with options.
func StartWith(t testing.TB, opts Options) *Etcd {
	t.Helper()
	e := &Etcd{opts: opts, dataDir: t.TempDir()}
	t.Cleanup(e.Stop) // registered after TempDir: runs before its removal
	if err := e.start("http://127.0.0.1:0"); err != nil {
		t.Fatalf("membershiptest: %v", err)
	}
	return e
}

// Endpoints are the client URLs of the server. They stay the same across
// Stop and Restart.
func (e *Etcd) Endpoints() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return []string{e.clientURL}
}

// Client returns a client of the server, closed at t's cleanup. It fails t
// when the client cannot be created.
func (e *Etcd) Client(t testing.TB) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:            e.Endpoints(),
		DialTimeout:          5 * time.Second,
		DialKeepAliveTime:    2 * time.Second,
		DialKeepAliveTimeout: 2 * time.Second,
		// Reconnect within a second once the server is back (Restart).
		DialOptions: []grpc.DialOption{grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 50 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
			MinConnectTimeout: 5 * time.Second,
		})},
		Logger: zap.NewNop(),
	})
	if err != nil {
		t.Fatalf("membershiptest: client: %v", err)
	}
	t.Cleanup(func() { _ = cli.Close() })
	return cli
}

// Stop stops the server and waits for it; its data stays. Stopping a
// stopped server does nothing.
func (e *Etcd) Stop() {
	e.mu.Lock()
	srv := e.srv
	e.srv = nil
	e.mu.Unlock()
	if srv != nil {
		srv.Close()
	}
}

// Restart stops the server if it runs, then starts it again on the same
// data dir and the same client URL.
func (e *Etcd) Restart(t testing.TB) {
	t.Helper()
	e.Stop()
	e.mu.Lock()
	u := e.clientURL
	e.mu.Unlock()
	// The port was free a moment ago; another process may grab it in
	// between, which is rare enough to fail the test with a clear message.
	if err := e.start(u); err != nil {
		t.Fatalf("membershiptest: restart on %s: %v", u, err)
	}
}

func (e *Etcd) start(clientURL string) error {
	lg := zap.NewNop()
	if lvl := os.Getenv("TROUPE_TEST_ETCD_LOG"); lvl != "" {
		l, err := embedetcd.LoggerAt(lvl)
		if err != nil {
			return err
		}
		lg = l
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var (
		srv *embedetcd.Server
		err error
	)
	// A just-closed listener may linger for a moment; retry briefly.
	for attempt := 0; ; attempt++ {
		srv, err = embedetcd.Start(ctx, embedetcd.Config{
			DataDir:          e.dataDir,
			ListenClientURLs: []string{clientURL},
			// A single node never dials its own peer URL: any free port.
			ListenPeerURLs: []string{"http://127.0.0.1:0"},
			TickMs:         20,
			ElectionMs:     200,
			SnapshotCount:  1000,
			UnsafeNoFsync:  !e.opts.Fsync,
			Logger:         lg,
		})
		if err == nil || attempt >= 20 || !isAddrInUse(clientURL) {
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("start etcd: %w", err)
		case <-time.After(100 * time.Millisecond):
		}
	}
	if err != nil {
		return fmt.Errorf("start etcd: %w", err)
	}
	e.mu.Lock()
	e.srv = srv
	e.clientURL = srv.ClientURLs()[0]
	e.mu.Unlock()
	return nil
}

// isAddrInUse reports whether the host:port of u cannot be bound now.
func isAddrInUse(u string) bool {
	pu, err := url.Parse(u)
	if err != nil {
		return false
	}
	if _, port, _ := net.SplitHostPort(pu.Host); port == "0" {
		return false
	}
	l, err := net.Listen("tcp", pu.Host)
	if err != nil {
		return true
	}
	_ = l.Close()
	return false
}
