package orchestrator_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"

	"github.com/troupe-serving/troupe/internal/front/httpapi"
	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/sim"
)

// fleetListeners is how many worker servers each half of the simulated
// fleet shares: every replica record points at one of them.
const fleetListeners = 4

// BenchmarkFleet simulates a fleet of N replicas of one stage against a
// real embedded etcd and real in-process heads, and reports the three
// storms of issue #30:
//
//   - join storm: N replicas register real leases (membership.Register,
//     64 at a time) as fast as etcd takes them, or spread evenly over
//     TROUPE_FLEET_STORM (a duration: "1s" is the storm, N
//     registrations within one second); the time from the first
//     registration until the head routes to all N, and each replica's
//     txn→routable (its Register return to the head's own routed stamp).
//   - head restart: a second head starts against the N live replicas; the
//     time until it is ready and until it routes to all of them.
//   - leave storm: half the replicas drain (Health says DRAINING, as a
//     worker on SIGTERM) and their leases are revoked at once; the time
//     until no head picks any of them (none routable in its snapshot).
//
// The replicas are records, not processes: 2×4 worker.Servers (sim
// engine, no etcd client of their own) serve every record's address, so
// the head dials, probes (Health) and routes to each record as to a real
// worker, one connection per replica. A server without a record of its
// own answers Health through anonymousHealth, as a worker that predates
// instance ids, so the head's identity check (one process, one record)
// passes; see docs/benchmarks.md. One process holds etcd, the heads and the servers:
// each replica costs the process two descriptors per head, so N is
// bounded by the descriptor limit (20,000 here: N ≤ ~4,000 with two heads).
//
// Sizes come from TROUPE_FLEET_N (default "10,100,1000"). Run it once per
// size:
//
//	go test -run '^$' -bench Fleet -benchtime 1x -timeout 20m ./orchestrator/
func BenchmarkFleet(b *testing.B) {
	sizes := os.Getenv("TROUPE_FLEET_N")
	if sizes == "" {
		sizes = "10,100,1000"
	}
	var storm time.Duration
	if v := os.Getenv("TROUPE_FLEET_STORM"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 0 {
			b.Fatalf("TROUPE_FLEET_STORM: bad duration %q", v)
		}
		storm = d
	}
	for _, s := range strings.Split(sizes, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 2 {
			b.Fatalf("TROUPE_FLEET_N: bad size %q", s)
		}
		if need, limit := fleetDescriptors(n), descriptorLimit(b); need > limit {
			// Past it, dials and accepts fail deep in etcd and grpc-go,
			// and the process exits without a word.
			b.Fatalf("fleet: N=%d needs about %d descriptors (4 a replica: two heads' connections, both ends in this process), the limit is %d: "+
				"raise ulimit -n, or run test/fleet BenchmarkFleetProcs, whose replicas live in other processes", n, need, limit)
		}
		b.Run(fmt.Sprintf("N=%d", n), func(b *testing.B) {
			for range b.N {
				runFleet(b, n, storm)
			}
		})
	}
}

// fleetDescriptors is about how many descriptors runFleet needs for n
// replicas: both ends of two heads' connections to each, and room for
// etcd, its clients and the API.
func fleetDescriptors(n int) uint64 { return uint64(4*n + 2000) }

// descriptorLimit is the process's RLIMIT_NOFILE (Go raises the soft
// limit to the hard one at start).
func descriptorLimit(b *testing.B) uint64 {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		b.Fatal(err)
	}
	return lim.Cur
}

// fleetServers starts k worker servers of the thinker stage sharing one
// sim engine, until cleanup.
func fleetServers(b *testing.B, k int) []*worker.Server {
	b.Helper()
	eng := sim.New(sim.Config{Role: stagepb.RoleText, Logger: slog.New(slog.DiscardHandler)})
	b.Cleanup(func() { _ = eng.Close() })
	out := make([]*worker.Server, k)
	for i := range out {
		srv, err := worker.New(worker.Config{Stage: "thinker", AutoID: true, Engine: eng, Logger: slog.New(slog.DiscardHandler),
			ServerOptions: []grpc.ServerOption{grpc.ChainUnaryInterceptor(anonymousHealth)}})
		if err != nil {
			b.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- srv.Run(ctx) }()
		b.Cleanup(func() { cancel(); <-done })
		<-srv.Registered()
		out[i] = srv
	}
	return out
}

// anonymousHealth answers Health as a worker that predates instance ids
// (no replica id, no instance id): one server stands for many records,
// and the head's identity check, which still walks its records on every
// join, finds nothing to refuse.
func anonymousHealth(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	resp, err := handler(ctx, req)
	if h, ok := resp.(*stagepb.HealthResponse); ok {
		h.ReplicaId, h.InstanceId = 0, ""
	}
	return resp, err
}

// runFleet runs the three storms over n replicas; storm > 0 spreads the
// join storm's registrations evenly over it (the i-th starts at
// i·storm/n), 0 registers as fast as etcd takes them.
func runFleet(b *testing.B, n int, storm time.Duration) {
	c := orchestratortest.Start(b, orchestratortest.Options{Pipeline: thinkerOnly, ReplicasPerStage: -1, DisableStats: true})
	stay, leave := fleetServers(b, fleetListeners), fleetServers(b, fleetListeners)
	addr := func(id uint32) string {
		if int(id) <= n/2 {
			return stay[int(id)%len(stay)].Advertise()
		}
		return leave[int(id)%len(leave)].Advertise()
	}
	heapBefore := heapInUse()

	// Join storm.
	regs := make([]*membership.Registration, n+1)
	committed := make([]time.Time, n+1)
	ctx := context.Background()
	// The front door's view of the storm: each replica's first row that
	// shows it attached, as a client of the head's HTTP API on loopback
	// receives it: from GET /v1/replicas?watch=true, or, with
	// TROUPE_FLEET_FRONT=poll, from GET /v1/replicas every frontDoorPoll
	// (an upper bound of when a client could see it routable).
	api := httptest.NewServer(httpapi.New(c.Head, httpapi.Config{Logger: slog.New(slog.DiscardHandler)}).Handler())
	defer api.Close()
	listed := make([]time.Time, n+1)
	pollCtx, stopPolls := context.WithCancel(context.Background())
	var polls sync.WaitGroup
	if os.Getenv("TROUPE_FLEET_FRONT") == "poll" {
		polls.Go(func() { pollAttached(pollCtx, api.URL, listed) })
	} else {
		synced := make(chan struct{})
		polls.Go(func() { watchAttached(pollCtx, api.URL, listed, synced) })
		select {
		case <-synced:
		case <-time.After(10 * time.Second):
			b.Fatal("fleet: GET /v1/replicas?watch=true did not sync within 10 s")
		}
	}
	start := time.Now()
	var g errgroup.Group
	g.SetLimit(64)
	pace := time.NewTimer(0)
	defer pace.Stop()
	for id := uint32(1); id <= uint32(n); id++ {
		if storm > 0 {
			pace.Reset(time.Until(start.Add(storm * time.Duration(id-1) / time.Duration(n))))
			<-pace.C
		}
		g.Go(func() error {
			reg, err := membership.Register(ctx, c.Client, membership.RegisterConfig{
				Member: membership.Member{Stage: "thinker", ReplicaID: id, Addr: addr(id), Engine: "sim", Version: "fleet"},
				TTL:    time.Minute, Logger: slog.New(slog.DiscardHandler),
			})
			if err != nil {
				return err
			}
			regs[id], committed[id] = reg, time.Now()
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		b.Fatal(err)
	}
	registered := time.Since(start)
	b.Cleanup(func() {
		var wg sync.WaitGroup
		for _, r := range regs {
			if r != nil {
				wg.Go(func() { _ = r.Close(context.Background()) })
			}
		}
		wg.Wait()
	})
	allRouted := waitFleet(b, c.Head, 20*time.Second, func(reps *orchestrator.ReplicasRef) bool { return reps.Len() == n }, start)
	pollsDone := make(chan struct{})
	go func() { polls.Wait(); close(pollsDone) }()
	select {
	case <-pollsDone:
	case <-time.After(10 * time.Second):
		stopPolls()
		<-pollsDone
		b.Fatal("fleet: the front door did not show every replica attached within 10 s of the head routing them")
	}
	stopPolls()
	lat, toEvent := make([]time.Duration, 0, n), make([]time.Duration, 0, n)
	for id := uint32(1); id <= uint32(n); id++ {
		jt, ok := orchestrator.JoinTimes(c.Head, 0, id)
		if !ok || jt.Routed.IsZero() {
			b.Fatalf("replica %d: no routed stamp", id)
		}
		lat = append(lat, jt.Routed.Sub(committed[id]))
		toEvent = append(toEvent, jt.Event.Sub(committed[id]))
	}
	heapPer := float64(heapInUse()-heapBefore) / float64(n) / 1024
	b.ReportMetric(registered.Seconds()*1000, "join-register-all-ms")
	b.ReportMetric(allRouted.Seconds()*1000, "join-all-routed-ms")
	b.ReportMetric(pct(lat, 0.5), "join-txn-to-routed-p50-ms")
	b.ReportMetric(pct(lat, 0.99), "join-txn-to-routed-p99-ms")
	b.ReportMetric(pct(lat, 1), "join-txn-to-routed-max-ms")
	b.ReportMetric(pct(toEvent, 0.99), "join-txn-to-event-p99-ms")
	viaAPI := make([]time.Duration, 0, n)
	for id := 1; id <= n; id++ {
		viaAPI = append(viaAPI, listed[id].Sub(committed[id]))
	}
	b.ReportMetric(pct(viaAPI, 0.5), "join-txn-to-listed-p50-ms")
	b.ReportMetric(pct(viaAPI, 0.99), "join-txn-to-listed-p99-ms")
	b.ReportMetric(heapPer, "heap-KiB-per-replica")
	reportJoinSteps(b, c.Head, n, start, "join")
	// What a read of the fleet costs a client: the whole list, and the
	// list of the rows in one state (none unhealthy now).
	b.ReportMetric(timeGet(b, api.URL+"/v1/replicas"), "api-list-all-ms")
	b.ReportMetric(timeGet(b, api.URL+"/v1/replicas?state=unhealthy"), "api-list-unhealthy-ms")
	// A watch's start reads every row.
	starts := make([]time.Duration, 0, 5)
	for range 5 {
		t0 := time.Now()
		_, rows := c.Head.WatchReplicas(-1)
		starts = append(starts, time.Since(t0))
		if len(rows) != n {
			b.Fatalf("a watch starts with %d rows, want %d", len(rows), n)
		}
	}
	b.ReportMetric(pct(starts, 0.5), "watch-start-ms")

	// Head restart: a new head against the live fleet.
	start = time.Now()
	h2, _ := c.AddHead(b)
	ready := waitFleet(b, h2, time.Minute, func(*orchestrator.ReplicasRef) bool { ok, _ := h2.Ready(); return ok }, start)
	restartAll := waitFleet(b, h2, 20*time.Second, func(reps *orchestrator.ReplicasRef) bool { return reps.Len() == n }, start)
	b.ReportMetric(ready.Seconds()*1000, "restart-ready-ms")
	b.ReportMetric(restartAll.Seconds()*1000, "restart-all-routed-ms")
	reportJoinSteps(b, h2, n, start, "restart")

	// Leave storm: the upper half drains and revokes its leases at once.
	start = time.Now()
	for _, s := range leave {
		s.Drain()
	}
	var revoke errgroup.Group
	revoke.SetLimit(64)
	for id := n/2 + 1; id <= n; id++ {
		revoke.Go(func() error {
			r := regs[id]
			regs[id] = nil
			return r.Close(ctx)
		})
	}
	revoked := make(chan time.Duration, 1)
	go func() {
		_ = revoke.Wait()
		revoked <- time.Since(start)
	}()
	noneLeaving := func(reps *orchestrator.ReplicasRef) bool {
		for r := range reps.All() {
			if int(r.Key.Replica) > n/2 && r.Routable() {
				return false
			}
		}
		return true
	}
	gone := func(reps *orchestrator.ReplicasRef) bool { return reps.Len() == n/2 }
	var unpicked, removed [2]time.Duration
	for i, h := range []*orchestrator.Head{c.Head, h2} {
		unpicked[i] = waitFleet(b, h, time.Minute, noneLeaving, start)
	}
	for i, h := range []*orchestrator.Head{c.Head, h2} {
		removed[i] = waitFleet(b, h, time.Minute, gone, start)
	}
	b.ReportMetric((<-revoked).Seconds()*1000, "leave-revoke-all-ms")
	b.ReportMetric(max(unpicked[0], unpicked[1]).Seconds()*1000, "leave-none-picked-ms")
	b.ReportMetric(max(removed[0], removed[1]).Seconds()*1000, "leave-all-removed-ms")
}

// frontDoorPoll is how often pollAttached asks GET /v1/replicas.
const frontDoorPoll = 20 * time.Millisecond

// pollAttached asks GET /v1/replicas at base every frontDoorPoll until
// every replica id 1..len(listed)-1 is listed attached or ctx ends,
// stamping each one's listed[id] with the arrival of the first answer that
// lists it attached.
func pollAttached(ctx context.Context, base string, listed []time.Time) {
	tick := time.NewTicker(frontDoorPoll)
	defer tick.Stop()
	left := len(listed) - 1
	for left > 0 {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/v1/replicas", nil)
		if err != nil {
			return
		}
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			var list struct {
				Data []struct {
					Replica uint32 `json:"replica"`
					State   string `json:"state"`
				} `json:"data"`
			}
			err = json.NewDecoder(resp.Body).Decode(&list)
			_ = resp.Body.Close()
			now := time.Now()
			for _, r := range list.Data {
				if err == nil && r.State == "attached" && int(r.Replica) < len(listed) && listed[r.Replica].IsZero() {
					listed[r.Replica] = now
					left--
				}
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// timeGet is the median time of five GETs of url, body read, in ms.
func timeGet(b *testing.B, url string) float64 {
	times := make([]time.Duration, 0, 5)
	for range 5 {
		start := time.Now()
		resp, err := http.Get(url)
		if err != nil {
			b.Fatal(err)
		}
		_, err = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusOK {
			b.Fatalf("GET %s: %d %v", url, resp.StatusCode, err)
		}
		times = append(times, time.Since(start))
	}
	return pct(times, 0.5)
}

// watchAttached follows GET /v1/replicas?watch=true at base until every
// replica id 1..len(listed)-1 has come attached or ctx ends, stamping
// each one's listed[id] with the arrival of its first row that shows it
// attached. It closes synced once the watch has synced.
func watchAttached(ctx context.Context, base string, listed []time.Time, synced chan<- struct{}) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/v1/replicas?watch=true", nil)
	if err != nil {
		return
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return
	}
	defer resp.Body.Close()
	dec := json.NewDecoder(resp.Body)
	left := len(listed) - 1
	for left > 0 {
		var ev struct {
			Type    string `json:"type"`
			Replica struct {
				Replica uint32 `json:"replica"`
				State   string `json:"state"`
			} `json:"replica"`
		}
		if err := dec.Decode(&ev); err != nil {
			return
		}
		r := ev.Replica
		switch {
		case ev.Type == "synced":
			close(synced)
		case ev.Type == "replica" && r.State == "attached" && int(r.Replica) < len(listed) && listed[r.Replica].IsZero():
			listed[r.Replica] = time.Now()
			left--
		}
	}
}

// waitFleet waits until cond holds for the replicas h routes to, waking on
// the head's publishes and every 5 ms (a connection's state changes
// without a publish), and returns the time since start.
func waitFleet(b *testing.B, h *orchestrator.Head, limit time.Duration, cond func(*orchestrator.ReplicasRef) bool, start time.Time) time.Duration {
	b.Helper()
	deadline := time.NewTimer(limit)
	defer deadline.Stop()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for {
		changed := orchestrator.Changed(h)
		if cond(orchestrator.RoutedReplicas(h, 0)) {
			return time.Since(start)
		}
		select {
		case <-changed:
		case <-tick.C:
		case <-deadline.C:
			reps := h.Replicas()
			b.Fatalf("fleet: condition not reached within %v (%d routed; %d known, first: %+v)", limit, orchestrator.RoutedReplicas(h, 0).Len(), len(reps), reps[:min(1, len(reps))])
		}
	}
}

// reportJoinSteps reports, as p99s over the N replicas of h's latest
// joins, where a join's time goes: from start to its event reaching the
// loop (the watch, or a restart's list), the event to its Health answer
// (dial and probe), the answer to the loop taking it (the loop's queue),
// and the loop taking it to the snapshot that routes to it (bind, route,
// publish).
func reportJoinSteps(b *testing.B, h *orchestrator.Head, n int, start time.Time, phase string) {
	b.Helper()
	var event, probe, queue, publish []time.Duration
	for id := uint32(1); id <= uint32(n); id++ {
		jt, ok := orchestrator.JoinTimes(h, 0, id)
		if !ok || jt.Routed.IsZero() {
			b.Fatalf("replica %d: no routed stamp", id)
		}
		event = append(event, jt.Event.Sub(start))
		probe = append(probe, jt.Answered.Sub(jt.Event))
		queue = append(queue, jt.Attach.Sub(jt.Answered))
		publish = append(publish, jt.Routed.Sub(jt.Attach))
	}
	b.ReportMetric(pct(event, 0.99), phase+"-event-p99-ms")
	b.ReportMetric(pct(probe, 0.99), phase+"-probe-p99-ms")
	b.ReportMetric(pct(queue, 0.99), phase+"-loop-queue-p99-ms")
	b.ReportMetric(pct(publish, 0.99), phase+"-attach-to-routed-p99-ms")
}

func heapInUse() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapInuse
}
