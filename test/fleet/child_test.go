package fleet

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/sim"
)

// childEnv selects the replica child mode of the test binary; the child's
// settings come in the TROUPE_FLEET_CHILD_* variables (childConfig).
const childEnv = "TROUPE_FLEET_CHILD"

// registerParallel is how many registrations a child has in flight at once
// during the join storm.
const registerParallel = 64

// childConfig is what the benchmark tells one replica child.
type childConfig struct {
	etcd    string        // client URL
	first   uint32        // first replica id
	count   int           // replica records, ids first..first+count-1
	servers int           // worker servers the records share
	ttl     time.Duration // lease TTL
}

func childConfigFromEnv() (childConfig, error) {
	var c childConfig
	var err error
	num := func(name string) int {
		if err != nil {
			return 0
		}
		var v int
		v, err = strconv.Atoi(os.Getenv(name))
		return v
	}
	c.etcd = os.Getenv("TROUPE_FLEET_CHILD_ETCD")
	c.first = uint32(num("TROUPE_FLEET_CHILD_FIRST"))
	c.count = num("TROUPE_FLEET_CHILD_COUNT")
	c.servers = num("TROUPE_FLEET_CHILD_SERVERS")
	if err == nil {
		c.ttl, err = time.ParseDuration(os.Getenv("TROUPE_FLEET_CHILD_TTL"))
	}
	if err != nil || c.etcd == "" || c.count < 1 || c.servers < 1 {
		return c, fmt.Errorf("fleet child: bad settings: %v", err)
	}
	return c, nil
}

func runChild() int {
	if err := child(os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// child serves cfg.count replica records from cfg.servers worker servers
// (one sim engine) and follows the parent's lines on in: "join" registers
// every record (a real lease each, registerParallel at a time) and prints
// "joined ID UNIX_NANOS" as each Register returns, then "joined-all
// RETRIES"; "leave" drains the servers (Health says DRAINING, as a worker
// on SIGTERM) and revokes every lease at once, then prints "left FAILED",
// FAILED the revokes etcd did not answer in time. At EOF it exits without
// revoking: the leases end with etcd, which the parent stops next.
func child(in io.Reader, out io.Writer) error {
	cfg, err := childConfigFromEnv()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	var running sync.WaitGroup
	defer func() { cancel(); running.Wait() }()
	servers, err := childServers(ctx, &running, cfg.servers)
	if err != nil {
		return err
	}
	cli, err := membership.Dial(ctx, membership.ClientConfig{Endpoints: []string{cfg.etcd}})
	if err != nil {
		return err
	}
	defer func() { _ = cli.Close() }()
	w := &lines{w: bufio.NewWriter(out)}
	w.printf("ready")
	var regs []*membership.Registration
	sc := bufio.NewScanner(in)
	for sc.Scan() {
		switch sc.Text() {
		case "join":
			var retries int64
			if regs, retries, err = childJoin(ctx, cli, cfg, servers, w); err != nil {
				return err
			}
			w.printf("joined-all %d", retries)
		case "leave":
			for _, s := range servers {
				s.Drain()
			}
			// Every lease at once, as workers stopping together; a revoke
			// that etcd does not answer in time (Close's own bound) leaves
			// the lease to expire within its TTL, as a worker's would.
			var failed atomic.Int64
			var all sync.WaitGroup
			for _, r := range regs {
				all.Go(func() {
					if r.Close(ctx) != nil {
						failed.Add(1)
					}
				})
			}
			all.Wait()
			w.printf("left %d", failed.Load())
		}
	}
	return nil
}

// childServers starts k worker servers of the thinker stage sharing one sim
// engine, each answering Health as a worker that predates instance ids (no
// replica id, no instance id): one server stands for many records, and the
// head's identity check finds nothing to refuse. running owns their Run.
func childServers(ctx context.Context, running *sync.WaitGroup, k int) ([]*worker.Server, error) {
	lg := slog.New(slog.DiscardHandler)
	eng := sim.New(sim.Config{Role: stagepb.RoleText, Logger: lg})
	running.Go(func() { <-ctx.Done(); _ = eng.Close() })
	out := make([]*worker.Server, k)
	for i := range out {
		srv, err := worker.New(worker.Config{Stage: "thinker", AutoID: true, Engine: eng, Logger: lg,
			ServerOptions: []grpc.ServerOption{grpc.ChainUnaryInterceptor(anonymousHealth)}})
		if err != nil {
			return nil, fmt.Errorf("fleet child: %w", err)
		}
		running.Go(func() { _ = srv.Run(ctx) })
		select {
		case <-srv.Registered():
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		out[i] = srv
	}
	return out, nil
}

func anonymousHealth(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	resp, err := handler(ctx, req)
	if h, ok := resp.(*stagepb.HealthResponse); ok {
		h.ReplicaId, h.InstanceId = 0, ""
	}
	return resp, err
}

// childJoin registers every record of the child, registerParallel at a
// time, and prints each one's commit time (Register returned). A
// registration etcd refuses or does not answer in time (an overloaded
// etcd: "too many requests", "request timed out") is tried again after
// 0.5 s, doubling up to 5 s, for up to a minute: a worker's own first
// registration does not retry (it exits 1 for its supervisor to restart
// it), which this stands for. A timed-out attempt may have committed, so
// a retry can find the key held by that attempt's orphaned lease until it
// expires (the TTL). It returns the registrations and the retries.
func childJoin(ctx context.Context, cli *clientv3.Client, cfg childConfig, servers []*worker.Server, w *lines) ([]*membership.Registration, int64, error) {
	regs := make([]*membership.Registration, cfg.count)
	var retries atomic.Int64
	var g errgroup.Group
	g.SetLimit(registerParallel)
	lg := slog.New(slog.DiscardHandler)
	for i := range cfg.count {
		id := cfg.first + uint32(i)
		g.Go(func() error {
			rc := membership.RegisterConfig{
				Member: membership.Member{Stage: "thinker", ReplicaID: id, Addr: servers[i%len(servers)].Advertise(), Engine: "sim", Version: "fleet"},
				TTL:    cfg.ttl, Logger: lg,
			}
			giveUp := time.Now().Add(time.Minute)
			for pause := 500 * time.Millisecond; ; pause = min(2*pause, 5*time.Second) {
				reg, err := membership.Register(ctx, cli, rc)
				if err == nil {
					regs[i] = reg
					w.printf("joined %d %d", id, time.Now().UnixNano())
					return nil
				}
				if time.Now().After(giveUp) {
					return fmt.Errorf("fleet child: register %d: %w", id, err)
				}
				retries.Add(1)
				t := time.NewTimer(pause)
				select {
				case <-t.C:
				case <-ctx.Done():
					t.Stop()
					return ctx.Err()
				}
			}
		})
	}
	err := g.Wait()
	return regs, retries.Load(), err
}

// lines writes whole lines from any goroutine, each flushed at once.
type lines struct {
	mu sync.Mutex
	w  *bufio.Writer
}

func (l *lines) printf(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	fmt.Fprintf(l.w, format+"\n", args...)
	_ = l.w.Flush()
}
