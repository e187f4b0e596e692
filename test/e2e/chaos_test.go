//go:build unix

package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// The chaos suite (scripts/chaos.sh, docs/reliability.md): each scenario
// runs a fresh cluster as processes on loopback (etcd, a head, two sim
// workers per stage of the default pipeline at 5 ms per step), puts it
// under a steady load, injects one fault and measures what the clients
// saw. It takes minutes, so it runs only with TROUPE_CHAOS=1, never in CI.

const (
	chaosClients  = 4
	chaosLeaseTTL = 2 * time.Second
	chaosStall    = 2 * time.Second
	// chaosSettle bounds the wait for the cluster to settle after a fault.
	chaosSettle = 45 * time.Second
)

// chaosCluster is one scenario's processes. Its fields are used by the
// scenario's goroutine only.
type chaosCluster struct {
	t        *testing.T
	etcd     *proc
	etcdURL  string
	etcdArgs []string
	head     *head
	headArgs []string
	workers  map[string][]*worker // by stage, replica id = index
	// violations are the scenario's own checks that failed (see violate).
	violations []string
}

// violate records that the scenario's promise did not hold; the row is
// then not met, and a strict scenario fails the test.
func (c *chaosCluster) violate(format string, args ...any) {
	c.violations = append(c.violations, fmt.Sprintf(format, args...))
	c.t.Logf("chaos: violated: "+format, args...)
}

var chaosStages = []string{"thinker", "talker", "vocoder"}

// startChaosCluster starts the scenario's cluster; headArgs are added to
// the head's flags.
func startChaosCluster(t *testing.T, headArgs ...string) *chaosCluster {
	t.Helper()
	c := &chaosCluster{t: t, workers: map[string][]*worker{}}
	client, peer := freePort(t), freePort(t)
	c.etcdURL = "http://127.0.0.1:" + client
	c.etcdArgs = []string{"etcd", "--data-dir", filepath.Join(t.TempDir(), "etcd"),
		"--listen-client-urls", c.etcdURL, "--listen-peer-urls", "http://127.0.0.1:" + peer, "--log-level", "error"}
	c.startEtcd()
	c.headArgs = []string{"head", "--etcd-endpoints", c.etcdURL, "--http", "127.0.0.1:" + freePort(t), "--log-level", "warn",
		"--stall-timeout", chaosStall.String(), "--lease-loss-grace", "20s"}
	c.headArgs = append(c.headArgs, headArgs...)
	c.startHead()
	for _, st := range chaosStages {
		for id := range 2 {
			c.workers[st] = append(c.workers[st], c.startWorker(st, fmt.Sprint(id)))
		}
	}
	ctx := testCtx(t)
	for _, st := range chaosStages {
		for id := range 2 {
			c.head.waitState(ctx, t, st, uint32(id), "attached")
		}
	}
	return c
}

func (c *chaosCluster) startEtcd() {
	c.etcd = startProc(c.t, "etcd", nil, c.etcdArgs...)
	c.etcd.waitLine(c.t, c.etcd.stdout, etcdServingRE)
}

func (c *chaosCluster) startHead() {
	p := startProc(c.t, "head", nil, c.headArgs...)
	base := p.waitLine(c.t, p.stdout, headAPIRE)[1]
	tr := &http.Transport{MaxIdleConnsPerHost: 64}
	c.t.Cleanup(tr.CloseIdleConnections)
	if c.head == nil {
		// The load and the monitor keep this head value across a
		// restart: same port, so base never changes.
		c.head = &head{client: &http.Client{Transport: tr}, base: base}
	}
	c.head.proc = p
}

func (c *chaosCluster) startWorker(stage, id string) *worker {
	return startWorker(c.t, c.etcdURL, stage, "--replica-id", id, "--lease-ttl", chaosLeaseTTL.String(),
		"--decode-latency", "5ms", "--drain-timeout", "10s")
}

// outcome is one request of the load.
type outcome struct {
	start, end time.Time
	err        error
}

// chaosLoad is chaosClients clients sending requests back to back, every
// other one asking for audio (through all three stages).
type chaosLoad struct {
	mu   sync.Mutex
	done []outcome
	stop chan struct{}
	wg   sync.WaitGroup
}

func startLoad(ctx context.Context, h *head) *chaosLoad {
	l := &chaosLoad{stop: make(chan struct{})}
	for g := range chaosClients {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			for i := 0; ; i++ {
				select {
				case <-l.stop:
					return
				case <-ctx.Done():
					return
				default:
				}
				body := map[string]any{"model": modelName, "max_tokens": 8, "seed": g*100000 + i,
					"messages": []chatMessage{{Role: "user", Content: fmt.Sprintf("client %d asks %d", g, i)}}}
				if i%2 == 1 {
					body["modalities"] = []string{"text", "audio"}
					body["audio"] = map[string]string{"voice": "alloy", "format": "wav"}
				}
				b, _ := json.Marshal(body)
				rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
				o := outcome{start: time.Now()}
				_, o.err = postChat(rctx, h.client, h.base, b)
				cancel()
				o.end = time.Now()
				l.mu.Lock()
				l.done = append(l.done, o)
				l.mu.Unlock()
				if o.err != nil {
					// A client backs off a little after a failure, as
					// clients do (and as Retry-After asks).
					select {
					case <-time.After(100 * time.Millisecond):
					case <-l.stop:
					}
				}
			}
		}()
	}
	return l
}

func (l *chaosLoad) finish() []outcome {
	close(l.stop)
	l.wg.Wait()
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.done
}

// monitor polls /v1/replicas and remembers when cond first held at or
// after a given time.
type monitor struct {
	scrape bool
	mu     sync.Mutex
	views  []view
	stop   chan struct{}
	done   chan struct{}
}

type view struct {
	at     time.Time
	rows   []replicaRow
	leaves float64 // troupe_membership_events_total{type="leave"}, when scraped
}

// startMonitor polls h; with scrape it also reads the head's leave count.
func startMonitor(ctx context.Context, h *head, scrape bool) *monitor {
	m := &monitor{stop: make(chan struct{}), done: make(chan struct{}), scrape: scrape}
	go func() {
		defer close(m.done)
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			qctx, cancel := context.WithTimeout(ctx, time.Second)
			// Metrics first: the rows are then at least as new as the
			// leave count.
			var leaves float64
			if m.scrape {
				if ms, serr := h.scrape(qctx); serr == nil {
					leaves = ms.sum("troupe_membership_events_total", map[string]string{"type": "leave"})
				}
			}
			rows, err := h.replicas(qctx)
			cancel()
			if err == nil {
				m.mu.Lock()
				m.views = append(m.views, view{at: time.Now(), rows: rows, leaves: leaves})
				m.mu.Unlock()
			}
			select {
			case <-tick.C:
			case <-m.stop:
				return
			case <-ctx.Done():
				return
			}
		}
	}()
	return m
}

// first is when cond first held at or after from; zero if never.
func (m *monitor) first(from time.Time, cond func([]replicaRow) bool) time.Time {
	return m.firstView(from, func(v view) bool { return cond(v.rows) })
}

func (m *monitor) firstView(from time.Time, cond func(view) bool) time.Time {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, v := range m.views {
		if !v.at.Before(from) && cond(v) {
			return v.at
		}
	}
	return time.Time{}
}

// leavesBefore is the leave count of the last view before t.
func (m *monitor) leavesBefore(t time.Time) float64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	var n float64
	for _, v := range m.views {
		if v.at.Before(t) {
			n = v.leaves
		}
	}
	return n
}

// waitFor waits, bounded, until cond holds in a view taken at or after
// from, and returns when; zero if it never did.
func (m *monitor) waitFor(ctx context.Context, from time.Time, bound time.Duration, cond func([]replicaRow) bool) time.Time {
	return m.waitForView(ctx, from, bound, func(v view) bool { return cond(v.rows) })
}

func (m *monitor) waitForView(ctx context.Context, from time.Time, bound time.Duration, cond func(view) bool) time.Time {
	deadline := time.Now().Add(bound)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		if at := m.firstView(from, cond); !at.IsZero() {
			return at
		}
		select {
		case <-time.After(50 * time.Millisecond):
		case <-ctx.Done():
		}
	}
	return time.Time{}
}

func (m *monitor) close() { close(m.stop); <-m.done }

// Conditions on a /v1/replicas view.
func rowOf(rows []replicaRow, stage string, id uint32) (replicaRow, bool) {
	for _, r := range rows {
		if r.StageName == stage && r.Replica == id {
			return r, true
		}
	}
	return replicaRow{}, false
}

// settled: the six original replicas attached with a record, nothing else
// attached or unhealthy.
func settled(rows []replicaRow) bool {
	attached := 0
	for _, r := range rows {
		switch {
		case r.Replica <= 1 && r.State == "attached" && r.LeaseLostUntil == nil:
			attached++
		case r.State != "detached":
			return false
		}
	}
	return attached == 6
}

func victimNot(state string) func([]replicaRow) bool {
	return func(rows []replicaRow) bool { r, ok := rowOf(rows, "thinker", 0); return ok && r.State != state }
}

func victimIs(state string) func([]replicaRow) bool {
	return func(rows []replicaRow) bool { r, ok := rowOf(rows, "thinker", 0); return ok && r.State == state }
}

// chaosScenario is one fault. inject starts it at the given time and
// returns when the fault is over (the process resumed, restarted or
// gone); detected and recovered are the head's view of it.
type chaosScenario struct {
	name     string
	goal     string // the promise, for the table
	inject   func(ctx context.Context, c *chaosCluster) (notes string)
	detected func([]replicaRow) bool // nil: not observable in /v1/replicas
	// leaves: detection is the head's first membership leave (an expired
	// lease), read from its metrics.
	leaves    bool
	recovered func([]replicaRow) bool
	// headArgs are extra flags of the scenario's head.
	headArgs []string
	// strict: a goal not met (failed requests, a violation) fails the test.
	strict bool
}

// chaosRow is one line of the table.
type chaosRow struct {
	name, goal                   string
	sent, failed                 int
	failedInFlight               int // failed requests that had started before the fault
	failedDuring                 int // failed requests started while the fault lasted
	window, detection, recovery  time.Duration
	slowest                      time.Duration // the longest successful request
	detectedOK, recoveredOK, met bool
	notes                        string
}

func sleepCtx(ctx context.Context, d time.Duration) {
	select {
	case <-time.After(d):
	case <-ctx.Done():
	}
}

var chaosScenarios = []chaosScenario{
	{
		name: "etcd frozen 5 s (lease TTL 2 s)", goal: "0 failed",
		inject: func(ctx context.Context, c *chaosCluster) string {
			c.etcd.signal(c.t, syscall.SIGSTOP)
			c.t.Cleanup(func() { _ = c.etcd.cmd.Process.Signal(syscall.SIGCONT) })
			sleepCtx(ctx, 5*time.Second)
			c.etcd.signal(c.t, syscall.SIGCONT)
			return "detection: the head's first leave (expired leases, after SIGCONT)"
		},
		leaves: true, recovered: settled,
	},
	{
		name: "etcd kill -9, restarted after 3 s", goal: "0 failed",
		inject: func(ctx context.Context, c *chaosCluster) string {
			c.etcd.kill(c.t)
			c.etcd.exitCode(c.t, wait)
			sleepCtx(ctx, 3*time.Second)
			c.startEtcd()
			return "same data dir and ports; detection: a leave, if leases expired"
		},
		leaves: true, recovered: settled,
	},
	{
		name: "worker kill -9 (thinker 0)", goal: "0 failed (non-streamed)",
		inject: func(_ context.Context, c *chaosCluster) string {
			c.workers["thinker"][0].kill(c.t)
			return "recovery: the dead replica detached"
		},
		detected: victimNot("attached"), recovered: victimIs("detached"),
	},
	{
		name: "worker SIGTERM (thinker 0)", goal: "0 failed",
		inject: func(_ context.Context, c *chaosCluster) string {
			w := c.workers["thinker"][0]
			w.signal(c.t, syscall.SIGTERM)
			w.exitCode(c.t, wait)
			return "recovery: drained and detached"
		},
		detected: victimNot("attached"), recovered: victimIs("detached"),
	},
	{
		name: "worker frozen 20 s (thinker 0, SIGSTOP)", goal: "0 failed",
		inject: func(ctx context.Context, c *chaosCluster) string {
			w := c.workers["thinker"][0]
			w.signal(c.t, syscall.SIGSTOP)
			c.t.Cleanup(func() { _ = w.cmd.Process.Signal(syscall.SIGCONT) })
			sleepCtx(ctx, 20*time.Second)
			w.signal(c.t, syscall.SIGCONT)
			return "recovery: re-registered and attached after SIGCONT"
		},
		detected: victimNot("attached"), recovered: settled,
	},
	{
		name: "head kill -9, restarted", goal: "only requests in flight on it fail",
		inject: func(_ context.Context, c *chaosCluster) string {
			c.head.kill(c.t)
			c.head.exitCode(c.t, wait)
			c.startHead()
			return "requests sent while it was down are refused connections"
		},
		recovered: settled,
	},
	{
		name: "churn: 30 thinker joins and leaves", goal: "0 failed",
		inject: func(ctx context.Context, c *chaosCluster) string {
			var wg sync.WaitGroup
			var attached atomic.Int32
			for lane := range 3 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := range 10 {
						id := fmt.Sprint(10 + lane*10 + i)
						p := launchWorker(c.t, c.etcdURL, "thinker", "--replica-id", id, "--lease-ttl", chaosLeaseTTL.String(), "--decode-latency", "5ms")
						if m := p.stdout.waitFor(ctx, workerReadyRE, wait); m == nil {
							return
						}
						qctx, cancel := context.WithTimeout(ctx, wait)
						for qctx.Err() == nil {
							if r, ok, _ := c.head.replica(qctx, "thinker", uint32(10+lane*10+i)); ok && r.State == "attached" {
								attached.Add(1)
								break
							}
							sleepCtx(qctx, 20*time.Millisecond)
						}
						cancel()
						_ = p.cmd.Process.Signal(syscall.SIGTERM)
						select {
						case <-p.exited:
						case <-time.After(wait):
						}
					}
				}()
			}
			wg.Wait()
			return fmt.Sprintf("3 lanes of 10 sequential start, attach, SIGTERM; %d of 30 attached", attached.Load())
		},
		recovered: settled,
	},
	{
		name: "bad membership records (5, for 5 s)", goal: "0 failed",
		inject: func(ctx context.Context, c *chaosCluster) string {
			cli, err := clientv3.New(clientv3.Config{Endpoints: []string{c.etcdURL}, DialTimeout: 5 * time.Second})
			if err != nil {
				return "etcd client: " + err.Error()
			}
			defer cli.Close()
			talker := c.workers["talker"][0].addr
			lease, err := cli.Grant(ctx, 60)
			if err != nil {
				return "grant: " + err.Error()
			}
			leased := clientv3.WithLease(lease.ID)
			bad := map[string]string{
				"/troupe/default/members/thinker/10": `{not json`,
				"/troupe/default/members/thinker/11": `{"stage":"thinker","replica_id":11,"addr":"unix:/tmp/x","engine":"sim"}`,
				"/troupe/default/members/thinker/12": `{"stage":"thinker","replica_id":12,"addr":"127.0.0.1:1","engine":"sim"}`,
				"/troupe/default/members/thinker/13": `{"stage":"thinker","replica_id":13,"addr":"` + talker + `","engine":"sim"}`,
				"/troupe/default/members/thinker/14": `{"stage":"thinker","replica_id":14,"addr":"127.0.0.1:2","engine":"sim"}`,
			}
			for k, v := range bad {
				opts := []clientv3.OpOption{leased}
				if strings.HasSuffix(k, "/14") {
					opts = nil // a record without a lease
				}
				if _, err := cli.Put(ctx, k, v, opts...); err != nil {
					return "put: " + err.Error()
				}
			}
			// What the head makes of them, polled while they exist.
			seen := map[uint32]map[string]bool{}
			end := time.Now().Add(5 * time.Second)
			for time.Now().Before(end) && ctx.Err() == nil {
				rows, _ := c.head.replicas(ctx)
				for _, r := range rows {
					if r.StageName == "thinker" && r.Replica >= 10 {
						if seen[r.Replica] == nil {
							seen[r.Replica] = map[string]bool{}
						}
						seen[r.Replica][r.State] = true
					}
				}
				sleepCtx(ctx, 50*time.Millisecond)
			}
			var states []string
			for id := range uint32(5) {
				var st []string
				for s := range seen[10+id] {
					st = append(st, s)
				}
				slices.Sort(st)
				if len(st) == 0 {
					st = []string{"not listed"}
				}
				states = append(states, fmt.Sprintf("%d: %s", 10+id, strings.Join(st, "/")))
			}
			for k := range bad {
				if _, err := cli.Delete(ctx, k); err != nil {
					return "delete: " + err.Error()
				}
			}
			return "10 bad JSON, 11 unix: addr, 12 dead addr, 13 the talker's addr as a thinker, 14 no lease; states seen " + strings.Join(states, ", ")
		},
		recovered: settled,
	},
	{
		name: "a client stops reading a stream for 10 s", goal: "0 failed (others)",
		inject: func(ctx context.Context, c *chaosCluster) string {
			body, _ := json.Marshal(map[string]any{"model": modelName, "max_tokens": 2000, "ignore_eos": true, "stream": true,
				"messages": []chatMessage{{Role: "user", Content: "talk a lot"}}, "modalities": []string{"text", "audio"},
				"audio": map[string]string{"voice": "alloy", "format": "pcm16"}})
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, c.head.base+"/v1/chat/completions", bytes.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			resp, err := (&http.Client{}).Do(req)
			if err != nil {
				return "stream: " + err.Error()
			}
			_, _ = io.ReadFull(resp.Body, make([]byte, 64))
			sleepCtx(ctx, 10*time.Second)
			resp.Body.Close()
			return "max_tokens 2000 with audio, never read after 64 bytes"
		},
		recovered: settled,
	},
}

// waitFor on a lineLog: the submatches of the first line matching re
// within bound, or nil.
func (l *lineLog) waitFor(ctx context.Context, re *regexp.Regexp, bound time.Duration) []string {
	deadline := time.NewTimer(bound)
	defer deadline.Stop()
	for {
		changed := l.changed()
		l.mu.Lock()
		for _, line := range l.lines {
			if m := re.FindStringSubmatch(line); m != nil {
				l.mu.Unlock()
				return m
			}
		}
		l.mu.Unlock()
		select {
		case <-changed:
		case <-deadline.C:
			return nil
		case <-ctx.Done():
			return nil
		}
	}
}

func runChaos(t *testing.T, sc chaosScenario) chaosRow {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c := startChaosCluster(t, sc.headArgs...)
	load := startLoad(ctx, c.head)
	mon := startMonitor(ctx, c.head, sc.leaves)
	sleepCtx(ctx, 2*time.Second) // steady state
	faultAt := time.Now()
	row := chaosRow{name: sc.name, goal: sc.goal}
	row.notes = sc.inject(ctx, c)
	over := time.Now()
	settleFrom := over
	if sc.leaves {
		// Expired leases reach the head as leaves once etcd runs again
		// (if they expired at all: keep-alives may win the race); the
		// cluster has recovered only after that.
		base := mon.leavesBefore(faultAt)
		leaveSeen := func(v view) bool { return v.leaves > base }
		if at := mon.waitForView(ctx, faultAt, 10*time.Second, leaveSeen); !at.IsZero() {
			row.detection, row.detectedOK = at.Sub(faultAt), true
			settleFrom = at
		}
	}
	if at := mon.waitFor(ctx, settleFrom, chaosSettle, sc.recovered); !at.IsZero() {
		row.recovery, row.recoveredOK = at.Sub(faultAt), true
	}
	if sc.detected != nil {
		if at := mon.first(faultAt, sc.detected); !at.IsZero() {
			row.detection, row.detectedOK = at.Sub(faultAt), true
		}
	}
	sleepCtx(ctx, time.Second)
	outs := load.finish()
	mon.close()
	var firstFail, lastFail time.Time
	servedDuring := 0
	for _, o := range outs {
		row.sent++
		if o.err == nil && !o.start.Before(faultAt) && o.start.Before(over) {
			servedDuring++
		}
		if o.err == nil {
			row.slowest = max(row.slowest, o.end.Sub(o.start))
			continue
		}
		row.failed++
		if o.start.Before(faultAt) {
			row.failedInFlight++
		} else if o.start.Before(over) {
			row.failedDuring++
		}
		if firstFail.IsZero() || o.end.Before(firstFail) {
			firstFail = o.end
		}
		if o.end.After(lastFail) {
			lastFail = o.end
		}
		t.Logf("failed request (%s after the fault): %v", o.end.Sub(faultAt).Round(time.Millisecond), o.err)
	}
	if row.failed > 0 {
		row.window = lastFail.Sub(firstFail)
	}
	switch {
	case strings.HasPrefix(sc.goal, "0 failed"):
		row.met = row.failed == 0
	case strings.HasPrefix(sc.goal, "only requests in flight"):
		// Requests sent while no head listens are refused connections:
		// they never reached a head.
		row.met = row.failed == row.failedInFlight+row.failedDuring
	}
	if sc.strict {
		row.notes += fmt.Sprintf("; %d load requests sent and served while the fault lasted", servedDuring)
	}
	if len(c.violations) > 0 {
		row.met = false
		row.notes += "; NOT HELD: " + strings.Join(c.violations, "; ")
	}
	if sc.strict && !row.met {
		t.Errorf("chaos: %s: goal %q not met: %d of %d failed, violations %q", sc.name, sc.goal, row.failed, row.sent, c.violations)
	}
	return row
}

func fmtDur(d time.Duration, ok bool) string {
	if !ok {
		return "-"
	}
	return d.Round(10 * time.Millisecond).String()
}

// TestChaos runs every scenario and prints the table (docs/reliability.md).
// TROUPE_CHAOS_RUN narrows it to the scenarios whose name contains it.
func TestChaos(t *testing.T) {
	if os.Getenv("TROUPE_CHAOS") != "1" {
		t.Skip("chaos suite: set TROUPE_CHAOS=1 (scripts/chaos.sh); minutes long, not part of CI")
	}
	requireBinary(t)
	var rows []chaosRow
	for _, sc := range slices.Concat(chaosScenarios, hostileScenarios) {
		if f := os.Getenv("TROUPE_CHAOS_RUN"); f != "" && !strings.Contains(sc.name, f) {
			continue
		}
		t.Run(strings.NewReplacer(" ", "_", ",", "").Replace(sc.name), func(t *testing.T) {
			start := time.Now()
			row := runChaos(t, sc)
			rows = append(rows, row)
			t.Logf("%s: %d sent, %d failed (%d in flight at the fault), window %s, detection %s, recovery %s (%s in all)",
				row.name, row.sent, row.failed, row.failedInFlight, fmtDur(row.window, row.failed > 0),
				fmtDur(row.detection, row.detectedOK), fmtDur(row.recovery, row.recoveredOK), time.Since(start).Round(time.Second))
		})
	}
	var b strings.Builder
	b.WriteString("| scenario | sent | failed | failure window | detection | recovery | slowest ok | goal | met | notes |\n")
	b.WriteString("|---|---:|---|---:|---:|---:|---:|---|---|---|\n")
	for _, r := range rows {
		failed := fmt.Sprint(r.failed)
		if r.failed > 0 {
			failed += fmt.Sprintf(" (%d in flight at the fault, %d sent during it)", r.failedInFlight, r.failedDuring)
		}
		met := "yes"
		if !r.met {
			met = "**no**"
		}
		fmt.Fprintf(&b, "| %s | %d | %s | %s | %s | %s | %s | %s | %s | %s |\n", r.name, r.sent, failed,
			fmtDur(r.window, r.failed > 0), fmtDur(r.detection, r.detectedOK), fmtDur(r.recovery, r.recoveredOK),
			fmtDur(r.slowest, true), r.goal, met, r.notes)
	}
	table := b.String()
	fmt.Println("\nchaos: figures (times from the fault's start)\n" + table)
	if out := os.Getenv("TROUPE_CHAOS_OUT"); out != "" {
		if err := os.WriteFile(out, []byte(table), 0o644); err != nil {
			t.Errorf("chaos: write %s: %v", out, err)
		}
	}
}
