package fleet

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"golang.org/x/sync/errgroup"
)

// perChild is the most replica records one child serves: with five heads
// its servers hold 5 × 1,000 connections, a quarter of this machine's
// descriptor limit of 20,000 per process.
const perChild = 1000

// childServers is how many worker servers (listeners) each child's
// records share.
const serversPerChild = 2

const model = "fleet-sim"

// BenchmarkFleetProcs simulates a fleet of N replicas of one stage with
// every party a process of its own: a `troupe etcd`, H `troupe head`
// processes (built from ./cmd/troupe, --log-stats=false: no per-replica
// series) and replica children, this test binary re-executed with
// TROUPE_FLEET_CHILD set. A child serves up to 1,000 replica records from
// two worker servers (sim engine, no etcd client of their own), each
// record a real lease and key written with membership.Register by the
// child's etcd client; the records point at the child's two listeners in
// turn, so a head dials, probes and routes to each record as to a worker
// of its own, over its own connection. The servers answer Health as
// workers that predate instance ids (no replica or instance id), so the
// head's identity check (one process, one record) has nothing to refuse.
// Half the children hold replicas 1..N/2 (they stay), half N/2+1..N
// (they leave). No process holds more than H × 1,000 connections of the
// fleet, plus a head's N.
//
// "Routable" is what the heads say from outside: a replica is routable on
// a head when its GET /v1/replicas lists it attached (routed, healthy,
// awake), polled every 20 ms plus 25 µs a replica per head (270 ms at
// 10,000: the answer is about 250 bytes of JSON a replica), so each time
// is late by up to one poll.
//
// Per size it reports:
//   - join storm: every child registers its records at once, 64 at a time
//     each; register-all until the last Register returned, join-all-routable
//     until every head lists all N attached, join p50/p99/max per replica
//     from its Register returning to the first poll of head 0 that lists it;
//   - head memory: VmRSS and go_memstats_heap_inuse_bytes of each head,
//     after the storm less before it, per replica (the largest head);
//   - etcd load at rest over max(10 s, TTL): requests per second by kind
//     from etcd's own /metrics (LeaseKeepAlive messages received, Range and
//     Txn calls, Watch messages sent), etcd's CPU (from /proc/PID/stat) and
//     VmRSS, and the heads' CPU;
//   - head restart: head 0 stops (SIGTERM) and a new head process starts;
//     restart-ready until its /readyz answers 200, restart-all-routable
//     until it lists all N attached;
//   - leave storm: the leaving children drain their servers and revoke all
//     their leases at once, while four clients send chat completions through
//     the heads (openai-go, no retries); leave-none-picked until no head
//     lists any of them attached; every request must succeed;
//   - freeze: one staying child is stopped (SIGSTOP: its keepalives stop,
//     its connections stay open); freeze-none-picked until no head lists
//     its replicas attached (the lease's TTL, or the head's gRPC keepalive).
//
// TROUPE_FLEET_N (default "10,100,1000") and TROUPE_FLEET_HEADS (default
// "1") list the sizes and head counts, TROUPE_FLEET_TTL the replicas' lease
// TTL (default 10s, as a worker's), TROUPE_FLEET_HEAD_GOMEMLIMIT the heads'
// GOMEMLIMIT (default: none, the head's own soft limit, which follows the
// fleet's size: docs/deploy.md); TROUPE_FLEET_SKIP_LEAVE=1
// stops after the head restart (no leave storm, no freeze):
//
//	TROUPE_FLEET_N=10,100,1000,10000 TROUPE_FLEET_HEADS=1,5 go test -run '^$' -bench FleetProcs -benchtime 1x -timeout 60m ./test/fleet/
func BenchmarkFleetProcs(b *testing.B) {
	eachFleet(b, "10,100,1000", "1", runFleet)
}

// eachFleet runs run once per head count and size (TROUPE_FLEET_HEADS and
// TROUPE_FLEET_N, else defHeads and defSizes) with the TTL of
// TROUPE_FLEET_TTL (default 10s) and a troupe binary built for them.
func eachFleet(b *testing.B, defSizes, defHeads string, run func(b *testing.B, bin string, heads, n int, ttl time.Duration)) {
	sizes, heads := envInts(b, "TROUPE_FLEET_N", defSizes), envInts(b, "TROUPE_FLEET_HEADS", defHeads)
	ttl, err := time.ParseDuration(cmpOr(os.Getenv("TROUPE_FLEET_TTL"), "10s"))
	if err != nil {
		b.Fatalf("TROUPE_FLEET_TTL: %v", err)
	}
	bin := buildTroupe(b)
	for _, h := range heads {
		for _, n := range sizes {
			b.Run(fmt.Sprintf("heads=%d/N=%d", h, n), func(b *testing.B) {
				for range b.N {
					run(b, bin, h, n, ttl)
				}
			})
		}
	}
}

// report reports a metric of the run, and logs it too: a later phase
// that fails keeps the benchmark from printing its metrics.
func report(b *testing.B, v float64, unit string) {
	b.Helper()
	b.ReportMetric(v, unit)
	b.Logf("%s %.1f", unit, v)
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

func envInts(b *testing.B, name, def string) []int {
	var out []int
	for s := range strings.SplitSeq(cmpOr(os.Getenv(name), def), ",") {
		v, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || v < 1 {
			b.Fatalf("%s: bad value %q", name, s)
		}
		out = append(out, v)
	}
	return out
}

// fleet is one simulation's processes.
type fleet struct {
	bin, etcdURL, pipeline string
	n                      int
	ttl                    time.Duration
	etcd                   *proc
	heads                  []*head
	stay, leave            []*replicas
}

type head struct {
	*proc
	base string // http://host:port of its API
}

// replicas is one replica child and the ids of its records.
type replicas struct {
	*proc
	first uint32
	count int
}

func (r *replicas) ids() []uint32 {
	out := make([]uint32, r.count)
	for i := range out {
		out[i] = r.first + uint32(i)
	}
	return out
}

func runFleet(b *testing.B, bin string, nHeads, n int, ttl time.Duration) {
	if n < 8 {
		b.Fatalf("fleet: N=%d: at least 8 replicas", n)
	}
	limit := 2*time.Minute + time.Duration(n)*40*time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), 4*limit)
	defer cancel()
	b.ReportMetric(loadAvg(), "loadavg-start")
	f := &fleet{bin: bin, n: n, ttl: ttl}
	f.startEtcd(b, ctx)
	f.pipeline = filepath.Join(b.TempDir(), "pipeline.yaml")
	if err := os.WriteFile(f.pipeline, []byte("model: "+model+"\nstages:\n  - name: thinker\n"), 0o600); err != nil {
		b.Fatal(err)
	}
	for i := range nHeads {
		f.heads = append(f.heads, f.startHead(b, ctx, fmt.Sprintf("h%d", i)))
	}
	f.startChildren(b, ctx)
	b.ResetTimer()
	before := f.headMemory(b, ctx)
	f.joinStorm(b, ctx, limit)
	after := f.headMemory(b, ctx)
	var rss, heap, live float64
	for i := range after {
		rss = max(rss, float64(after[i].rss-before[i].rss)/float64(n)/1024)
		heap = max(heap, float64(after[i].heap-before[i].heap)/float64(n)/1024)
		live = max(live, float64(after[i].live-before[i].live)/float64(n)/1024)
	}
	report(b, rss, "head-rss-KiB-per-replica")
	report(b, heap, "head-heap-KiB-per-replica")
	report(b, live, "head-live-KiB-per-replica")
	report(b, float64(after[0].rss)/(1<<20), "head-rss-MiB")
	f.etcdLoad(b, ctx, max(10*time.Second, ttl))
	f.headRestart(b, ctx, limit)
	if os.Getenv("TROUPE_FLEET_SKIP_LEAVE") == "" {
		f.leaveStorm(b, ctx, limit)
		f.freeze(b, ctx, limit+ttl)
	}
	b.StopTimer()
	b.ReportMetric(loadAvg(), "loadavg-end")
}

func (f *fleet) startEtcd(b *testing.B, ctx context.Context) {
	port := freePort(b)
	f.etcdURL = fmt.Sprintf("http://127.0.0.1:%d", port)
	f.etcd = startProc(b, "etcd", nil, f.bin, "etcd", "--data-dir", filepath.Join(b.TempDir(), "etcd"), "--listen-client-urls", f.etcdURL)
	if _, _, err := f.etcd.out.wait(ctx, 0, "troupe etcd: serving clients"); err != nil {
		b.Fatal(err)
	}
}

func (f *fleet) startHead(b *testing.B, ctx context.Context, id string) *head {
	var env []string
	if lim := os.Getenv("TROUPE_FLEET_HEAD_GOMEMLIMIT"); lim != "" {
		env = []string{"GOMEMLIMIT=" + lim}
	}
	p := startProc(b, "head "+id, env, f.bin, "head", "--etcd-endpoints", f.etcdURL, "--http", "127.0.0.1:0",
		"--pipeline", f.pipeline, "--log-stats=false", "--head-id", id, "--log-level", "warn")
	line, _, err := p.out.wait(ctx, 0, "troupe head: id")
	if err != nil {
		b.Fatalf("%v\n%s", err, p.stderr.tail(20))
	}
	_, addr, ok := strings.Cut(line, "API on ")
	if !ok {
		b.Fatalf("fleet: head line %q", line)
	}
	return &head{proc: p, base: strings.TrimSpace(addr)}
}

// startChildren splits replicas 1..N/2 and N/2+1..N each over enough
// children of at most perChild records, and waits until all serve.
func (f *fleet) startChildren(b *testing.B, ctx context.Context) {
	half := func(first uint32, count int) []*replicas {
		k := max(2, (count+perChild-1)/perChild)
		var out []*replicas
		for i := range k {
			c := count/k + btoi(i < count%k)
			env := []string{childEnv + "=1", "TROUPE_FLEET_CHILD_ETCD=" + f.etcdURL,
				fmt.Sprintf("TROUPE_FLEET_CHILD_FIRST=%d", first), fmt.Sprintf("TROUPE_FLEET_CHILD_COUNT=%d", c),
				fmt.Sprintf("TROUPE_FLEET_CHILD_SERVERS=%d", serversPerChild), "TROUPE_FLEET_CHILD_TTL=" + f.ttl.String()}
			p := startProc(b, fmt.Sprintf("replicas %d..%d", first, first+uint32(c)-1), env, os.Args[0], "-test.run=^$")
			out = append(out, &replicas{proc: p, first: first, count: c})
			first += uint32(c)
		}
		return out
	}
	f.stay = half(1, f.n/2)
	f.leave = half(uint32(f.n/2+1), f.n-f.n/2)
	for _, c := range f.children() {
		if _, err := c.waitLine(ctx, "ready"); err != nil {
			b.Fatalf("%s: %v\n%s", c.name, err, c.stderr.tail(20))
		}
	}
}

func btoi(v bool) int {
	if v {
		return 1
	}
	return 0
}

func (f *fleet) children() []*replicas { return append(slices.Clone(f.stay), f.leave...) }

// watchAll runs watchHead on every head at once and returns the longest
// time; first, when not nil, gets each head's first-seen times.
func (f *fleet) watchAll(ctx context.Context, start time.Time, first []map[uint32]time.Time, cond func(map[uint32]bool) bool) (time.Duration, error) {
	var g errgroup.Group
	took := make([]time.Duration, len(f.heads))
	for i, h := range f.heads {
		g.Go(func() error {
			var fs map[uint32]time.Time
			if first != nil {
				fs = first[i]
			}
			var err error
			took[i], err = watchHead(ctx, h.base, f.n, start, fs, cond)
			return err
		})
	}
	err := g.Wait()
	return slices.Max(took), err
}

func (f *fleet) joinStorm(b *testing.B, ctx context.Context, limit time.Duration) {
	wctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	first := make([]map[uint32]time.Time, len(f.heads))
	for i := range first {
		first[i] = map[uint32]time.Time{}
	}
	all := func(att map[uint32]bool) bool { return len(att) == f.n }
	start := time.Now()
	routed := make(chan error, 1)
	var took time.Duration
	go func() {
		var err error
		took, err = f.watchAll(wctx, start, first, all)
		routed <- err
	}()
	for _, c := range f.children() {
		c.send(b, "join")
	}
	committed := map[uint32]time.Time{}
	var registered time.Duration
	retries := 0
	for _, c := range f.children() {
		line, err := c.waitLine(wctx, "joined-all")
		if err != nil {
			b.Fatalf("%s: %v\n%s", c.name, err, c.stderr.tail(20))
		}
		var n int
		_, _ = fmt.Sscanf(line, "joined-all %d", &n)
		retries += n
		for _, line := range c.out.snapshot() {
			var id uint32
			var ns int64
			if _, err := fmt.Sscanf(line, "joined %d %d", &id, &ns); err == nil {
				committed[id] = time.Unix(0, ns)
				registered = max(registered, time.Unix(0, ns).Sub(start))
			}
		}
	}
	if err := <-routed; err != nil {
		b.Fatal(err)
	}
	if len(committed) != f.n {
		b.Fatalf("fleet: %d of %d registrations reported", len(committed), f.n)
	}
	lat := make([]time.Duration, 0, f.n)
	for id, t := range committed {
		lat = append(lat, first[0][id].Sub(t))
	}
	report(b, registered.Seconds()*1000, "join-register-all-ms")
	report(b, float64(retries), "join-register-retries")
	report(b, took.Seconds()*1000, "join-all-routable-ms")
	report(b, pct(lat, 0.5), "join-to-routable-p50-ms")
	report(b, pct(lat, 0.99), "join-to-routable-p99-ms")
	report(b, pct(lat, 1), "join-to-routable-max-ms")
}

// pct is the q-quantile of d (nearest rank), in milliseconds.
func pct(d []time.Duration, q float64) float64 {
	s := slices.Clone(d)
	slices.Sort(s)
	i := min(len(s)-1, max(0, int(q*float64(len(s))+0.5)-1))
	return s[i].Seconds() * 1000
}

// headMem is a head's memory: its RSS and Go heap in use as they are,
// then what is live after a collection (heap and goroutine stacks in use,
// what a soft memory limit must leave room for).
type headMem struct{ rss, heap, live int64 }

func (f *fleet) headMemory(b *testing.B, ctx context.Context) []headMem {
	out := make([]headMem, len(f.heads))
	for i, h := range f.heads {
		st, err := readProc(h.pid())
		if err != nil {
			b.Fatal(err)
		}
		m, err := scrape(ctx, h.base+"/metrics")
		if err != nil {
			b.Fatal(err)
		}
		out[i] = headMem{rss: st.rss, heap: int64(sum(m, "go_memstats_heap_inuse_bytes"))}
		if err := collect(ctx, h.base); err != nil {
			b.Fatal(err)
		}
		if m, err = scrape(ctx, h.base+"/metrics"); err != nil {
			b.Fatal(err)
		}
		out[i].live = int64(sum(m, "go_memstats_heap_inuse_bytes") + sum(m, "go_memstats_stack_inuse_bytes"))
	}
	return out
}

// collect makes the head at base run a garbage collection: its heap
// profile with gc=1 collects first.
func collect(ctx context.Context, base string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/debug/pprof/heap?gc=1", nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("fleet: collect: %w", err)
	}
	defer func() { _ = resp.Body.Close() }()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		return fmt.Errorf("fleet: collect: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("fleet: collect: %s", resp.Status)
	}
	return nil
}

// etcdLoad measures etcd at rest (the fleet joined, no requests) over
// window: its request rates by kind, its CPU and memory (etcdAtRest), and
// the busiest head's CPU.
func (f *fleet) etcdLoad(b *testing.B, ctx context.Context, window time.Duration) {
	headCPU := func() []time.Duration {
		out := make([]time.Duration, len(f.heads))
		for i, h := range f.heads {
			st, err := readProc(h.pid())
			if err != nil {
				b.Fatal(err)
			}
			out[i] = st.cpu
		}
		return out
	}
	before := headCPU()
	t0 := time.Now()
	f.etcdAtRest(b, ctx, window, "")
	secs := time.Since(t0).Seconds()
	var busiest time.Duration
	for i, cpu := range headCPU() {
		busiest = max(busiest, cpu-before[i])
	}
	report(b, 100*busiest.Seconds()/secs, "head-idle-cpu-%")
}

// headRestart stops head 0 and starts a new head process in its place.
func (f *fleet) headRestart(b *testing.B, ctx context.Context, limit time.Duration) {
	old := f.heads[0]
	if err := old.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		b.Fatal(err)
	}
	select {
	case <-old.exited:
	case <-ctx.Done():
		b.Fatal("fleet: head 0 did not stop")
	}
	wctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	children := f.childrenCPU(b)
	start := time.Now()
	h := f.startHead(b, wctx, "h0-restarted")
	f.heads[0] = h
	ready, err := waitReady(wctx, h.base, start)
	if err != nil {
		b.Fatal(err)
	}
	all, err := watchHead(wctx, h.base, f.n, start, nil, func(att map[uint32]bool) bool { return len(att) == f.n })
	if err != nil {
		b.Fatal(err)
	}
	report(b, ready.Seconds()*1000, "restart-ready-ms")
	report(b, all.Seconds()*1000, "restart-all-routable-ms")
	// What the restart cost in CPU, per replica: the new head's (its
	// whole life so far, the benchmark's polls of /v1/replicas included)
	// and the replica children's (accepting the connection, answering
	// Health, and the other heads' keepalives meanwhile). With the
	// machine's cores shared by all of them, these say what a head on
	// cores of its own would take.
	st, err := readProc(h.pid())
	if err != nil {
		b.Fatal(err)
	}
	report(b, float64(st.cpu.Microseconds())/1000/float64(f.n), "restart-head-cpu-ms-per-replica")
	report(b, float64((f.childrenCPU(b)-children).Microseconds())/1000/float64(f.n), "restart-replicas-cpu-ms-per-replica")
}

// childrenCPU is the CPU time the replica children have used so far.
func (f *fleet) childrenCPU(b *testing.B) time.Duration {
	var sum time.Duration
	for _, r := range append(slices.Clone(f.stay), f.leave...) {
		st, err := readProc(r.pid())
		if err != nil {
			b.Fatal(err)
		}
		sum += st.cpu
	}
	return sum
}

// noneOf holds when none of ids is attached.
func noneOf(ids []uint32) func(map[uint32]bool) bool {
	return func(att map[uint32]bool) bool {
		for _, id := range ids {
			if att[id] {
				return false
			}
		}
		return true
	}
}

func (f *fleet) leaveStorm(b *testing.B, ctx context.Context, limit time.Duration) {
	wctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	var leaving []uint32
	for _, c := range f.leave {
		leaving = append(leaving, c.ids()...)
	}
	load := startLoad(wctx, f.heads, 4)
	if err := load.waitOK(wctx, 20); err != nil {
		b.Fatal(err)
	}
	start := time.Now()
	for _, c := range f.leave {
		c.send(b, "leave")
	}
	took, err := f.watchAll(wctx, start, nil, noneOf(leaving))
	if err != nil {
		b.Fatal(err)
	}
	unrevoked := 0
	for _, c := range f.leave {
		line, err := c.waitLine(wctx, "left")
		if err != nil {
			b.Fatalf("%s: %v\n%s", c.name, err, c.stderr.tail(20))
		}
		var n int
		_, _ = fmt.Sscanf(line, "left %d", &n)
		unrevoked += n
	}
	report(b, float64(unrevoked), "leave-revokes-timed-out")
	ok, failed, kinds, firstErr := load.stop()
	report(b, took.Seconds()*1000, "leave-none-picked-ms")
	report(b, float64(ok), "leave-requests-ok")
	report(b, float64(failed), "leave-requests-failed")
	if failed > 0 {
		// A measurement, not a verdict: the figures of every phase still
		// come out. The head's warnings say which replicas refused.
		b.Logf("fleet: %d of %d requests failed during the leave storm; first: %v; by error: %v", failed, ok+failed, firstErr, kinds)
	}
}

func (f *fleet) freeze(b *testing.B, ctx context.Context, limit time.Duration) {
	wctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	c := f.stay[0]
	start := time.Now()
	if err := c.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		b.Fatal(err)
	}
	took, err := f.watchAll(wctx, start, nil, noneOf(c.ids()))
	if err != nil {
		b.Fatal(err)
	}
	report(b, took.Seconds()*1000, "freeze-none-picked-ms")
}

// load is chat completions sent by a few clients through the heads, in
// turn, until stopped.
type load struct {
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	mu      sync.Mutex
	ok, bad int
	first   error
	kinds   map[string]int // failures by error text
	changed chan struct{}
}

func startLoad(ctx context.Context, heads []*head, clients int) *load {
	ctx, cancel := context.WithCancel(ctx)
	l := &load{cancel: cancel, changed: make(chan struct{})}
	for c := range clients {
		cli := openai.NewClient(option.WithBaseURL(heads[c%len(heads)].base+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
		l.wg.Go(func() {
			for ctx.Err() == nil {
				_, err := cli.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
					Model: model, Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hello fleet")},
					MaxTokens: openai.Int(8),
				})
				l.record(ctx, err)
			}
		})
	}
	return l
}

func (l *load) record(ctx context.Context, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case err == nil:
		l.ok++
	case ctx.Err() != nil:
		return // stopped: not a failure of the fleet
	default:
		l.bad++
		if l.first == nil {
			l.first = err
		}
		if l.kinds == nil {
			l.kinds = map[string]int{}
		}
		l.kinds[err.Error()]++
	}
	close(l.changed)
	l.changed = make(chan struct{})
}

// waitOK waits until n requests have succeeded.
func (l *load) waitOK(ctx context.Context, n int) error {
	for {
		l.mu.Lock()
		ok, bad, first, changed := l.ok, l.bad, l.first, l.changed
		l.mu.Unlock()
		if ok >= n {
			return nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return fmt.Errorf("fleet: %d requests ok, %d failed (first: %v): %w", ok, bad, first, ctx.Err())
		}
	}
}

func (l *load) stop() (ok, bad int, kinds map[string]int, first error) {
	l.cancel()
	l.wg.Wait()
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.ok, l.bad, l.kinds, l.first
}
