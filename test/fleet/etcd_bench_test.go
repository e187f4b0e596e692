package fleet

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/troupe-serving/troupe/membership"
)

// BenchmarkEtcdHeads measures what a fleet and its heads cost etcd, at
// sizes and head counts whose full heads a small machine could not also
// run (five heads at 10,000 replicas are 50,000 connections, probes and
// keepalive pings besides etcd). The etcd process and the replica children are BenchmarkFleetProcs'
// (real leases and records, written with membership.Register, kept alive
// by each child's etcd client). Each "head" is what a head runs against
// etcd: a membership.Watcher (the head's own watch: one list, then a
// prefix watch with progress requests, and the periodic re-list every
// membership.DefaultReconcileInterval) and membership.MonitorEtcd, on an
// etcd client of its own, in this benchmark's process; it routes nothing,
// so its CPU is not measured, only etcd's.
//
// Per size it reports:
//   - join storm: every child registers its records at once; join-seen-all
//     until every watcher has seen all N joins;
//   - etcd at rest over the reconcile interval plus 5 s (so each watcher's
//     periodic re-list is in it), twice, the second window's units
//     suffixed -2: LeaseKeepAlive messages received, Range
//     and Txn calls, Watch messages sent, per second, from etcd's
//     /metrics, etcd's CPU and RSS;
//   - head restart: watcher 0 stops and a new one, on a new client,
//     starts: restart-seen-all until it has listed all N, and etcd's CPU
//     while it does;
//   - leave storm: half the children revoke every lease at once;
//     leave-seen-all until every watcher has seen all N/2 leaves.
//
// Sizes, head counts and TTL are BenchmarkFleetProcs' variables:
//
//	TROUPE_FLEET_N=1000,10000 TROUPE_FLEET_HEADS=1,5 go test -run '^$' -bench EtcdHeads -benchtime 1x -timeout 60m ./test/fleet/
func BenchmarkEtcdHeads(b *testing.B) {
	eachFleet(b, "1000", "5", runEtcdHeads)
}

func runEtcdHeads(b *testing.B, bin string, nHeads, n int, ttl time.Duration) {
	if n < 8 {
		b.Fatalf("fleet: N=%d: at least 8 replicas", n)
	}
	limit := 2*time.Minute + time.Duration(n)*40*time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), 4*limit)
	defer cancel()
	b.ReportMetric(loadAvg(), "loadavg-start")
	f := &fleet{bin: bin, n: n, ttl: ttl}
	f.startEtcd(b, ctx)
	f.startChildren(b, ctx)
	watchers := make([]*etcdHead, nHeads)
	for i := range watchers {
		watchers[i] = startEtcdHead(b, ctx, f.etcdURL)
	}
	defer func() {
		for _, w := range watchers {
			w.stop()
		}
	}()
	b.ResetTimer()

	seenAll := func(limit time.Duration, what string, cond func(joined, left int64) bool) time.Duration {
		wctx, cancel := context.WithTimeout(ctx, limit)
		defer cancel()
		start := time.Now()
		for _, w := range watchers {
			if err := w.wait(wctx, cond); err != nil {
				b.Fatalf("fleet: %s: %v (joined %d, left %d)", what, err, w.joined.Load(), w.left.Load())
			}
		}
		return time.Since(start)
	}

	start := time.Now()
	for _, c := range f.children() {
		c.send(b, "join")
	}
	seenAll(limit, "join storm", func(joined, _ int64) bool { return joined >= int64(n) })
	joinTook := time.Since(start)
	retries := 0
	for _, c := range f.children() {
		line, err := c.waitLine(ctx, "joined-all")
		if err != nil {
			b.Fatalf("%s: %v\n%s", c.name, err, c.stderr.tail(20))
		}
		var r int
		_, _ = fmt.Sscanf(line, "joined-all %d", &r)
		retries += r
	}
	report(b, joinTook.Seconds()*1000, "join-seen-all-ms")
	report(b, float64(retries), "join-register-retries")

	// Twice: the first window may still hold the storm's tail (a client's
	// watch creations are answered one after the other), the second is
	// the fleet at rest.
	rest := max(membership.DefaultReconcileInterval+5*time.Second, ttl)
	f.etcdAtRest(b, ctx, rest, "")
	f.etcdAtRest(b, ctx, rest, "-2")

	cpu0, err := readProc(f.etcd.pid())
	if err != nil {
		b.Fatal(err)
	}
	watchers[0].stop()
	t0 := time.Now()
	watchers[0] = startEtcdHead(b, ctx, f.etcdURL)
	seenAll(limit, "head restart", func(joined, _ int64) bool { return joined >= int64(n) })
	cpu1, err := readProc(f.etcd.pid())
	if err != nil {
		b.Fatal(err)
	}
	report(b, time.Since(t0).Seconds()*1000, "restart-seen-all-ms")
	report(b, (cpu1.cpu-cpu0.cpu).Seconds()*1000, "restart-etcd-cpu-ms")

	for _, c := range f.leave {
		c.send(b, "leave")
	}
	leaving := int64(n - n/2)
	took := seenAll(limit, "leave storm", func(_, left int64) bool { return left >= leaving })
	report(b, took.Seconds()*1000, "leave-seen-all-ms")
	b.StopTimer()
	b.ReportMetric(loadAvg(), "loadavg-end")
}

// etcdAtRest reports etcd's request rates, CPU and memory over window,
// each metric's unit suffixed with suffix.
func (f *fleet) etcdAtRest(b *testing.B, ctx context.Context, window time.Duration, suffix string) {
	read := func() (map[string]float64, procStat) {
		m, err := scrape(ctx, f.etcdURL+"/metrics")
		if err != nil {
			b.Fatal(err)
		}
		st, err := readProc(f.etcd.pid())
		if err != nil {
			b.Fatal(err)
		}
		return m, st
	}
	m0, s0 := read()
	t0 := time.Now()
	timer := time.NewTimer(window)
	select {
	case <-timer.C:
	case <-ctx.Done():
		b.Fatal(ctx.Err())
	}
	m1, s1 := read()
	secs := time.Since(t0).Seconds()
	rate := func(name string, labels ...string) float64 {
		return (sum(m1, name, labels...) - sum(m0, name, labels...)) / secs
	}
	report(b, rate("grpc_server_msg_received_total", `grpc_method="LeaseKeepAlive"`), "etcd-keepalives/s"+suffix)
	report(b, rate("grpc_server_handled_total", `grpc_method="Range"`), "etcd-ranges/s"+suffix)
	report(b, rate("grpc_server_handled_total", `grpc_method="Txn"`), "etcd-txns/s"+suffix)
	report(b, rate("grpc_server_msg_sent_total", `grpc_method="Watch"`), "etcd-watch-msgs/s"+suffix)
	report(b, 100*(s1.cpu-s0.cpu).Seconds()/secs, "etcd-cpu-%"+suffix)
	report(b, float64(s1.rss)/(1<<20), "etcd-rss-MiB"+suffix)
}

// etcdHead is what one head runs against etcd: its membership watch and
// its etcd health probe, on a client of its own. It counts the joins and
// leaves it sees (a join of a key it already knows, a changed record,
// counts once more; the storms here change no record twice).
type etcdHead struct {
	cli          *clientv3.Client
	cancel       context.CancelFunc
	done         sync.WaitGroup
	joined, left atomic.Int64
	changed      chan struct{} // closed and replaced on every event; guarded by mu
	mu           sync.Mutex
}

func startEtcdHead(b *testing.B, ctx context.Context, etcdURL string) *etcdHead {
	cli, err := membership.Dial(ctx, membership.ClientConfig{Endpoints: []string{etcdURL}})
	if err != nil {
		b.Fatal(err)
	}
	quiet := slog.New(slog.DiscardHandler)
	hctx, cancel := context.WithCancel(ctx)
	h := &etcdHead{cli: cli, cancel: cancel, changed: make(chan struct{})}
	events := make(chan membership.Event)
	w := membership.NewWatcher(cli, membership.WatchConfig{Logger: quiet})
	h.done.Go(func() { _ = w.Run(hctx, events) })
	h.done.Go(func() { membership.MonitorEtcd(hctx, cli, membership.HealthConfig{Who: "fleet head", Logger: quiet}) })
	h.done.Go(func() {
		for {
			select {
			case <-hctx.Done():
				return
			case ev := <-events:
				if ev.Type == membership.Join {
					h.joined.Add(1)
				} else {
					h.left.Add(1)
				}
				h.mu.Lock()
				close(h.changed)
				h.changed = make(chan struct{})
				h.mu.Unlock()
			}
		}
	})
	return h
}

// wait returns once cond holds for the head's counts, or ctx ends.
func (h *etcdHead) wait(ctx context.Context, cond func(joined, left int64) bool) error {
	for {
		h.mu.Lock()
		changed := h.changed
		h.mu.Unlock()
		if cond(h.joined.Load(), h.left.Load()) {
			return nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// stop ends the head's goroutines and closes its client.
func (h *etcdHead) stop() {
	h.cancel()
	h.done.Wait()
	_ = h.cli.Close()
}
