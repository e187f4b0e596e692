package orchestrator_test

import (
	"context"
	"log/slog"
	"os"
	"runtime/debug"
	"testing"
	"time"

	"github.com/troupe-serving/troupe/internal/core/fdtable"
	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/sim"
)

// BenchmarkJoinToRoutable measures the time from a replica's registration
// transaction (committed, as Register returns) to the moment the head
// routes to it: the watch event, the engine index, the Health probe over a
// new connection, the series bound and the router snapshot published. One
// worker process serves every record, so nothing but the join is timed.
//
// The end of each join is the head's own timestamp, taken on its loop
// right after the router snapshot that routes to the replica is published;
// the benchmark sleeps on the head's change notification meanwhile, so it
// neither competes with the head for the CPUs nor adds its wake-up to the
// figure. Besides the txn→routed and Register→routed percentiles it
// reports the join's phases (see docs/benchmarks.md).
//
// It runs under the head binary's process settings, which this process
// (head, etcd and worker in one) would otherwise not have: GOGC 400
// unless GOGC is set (headGCPercent in cmd/troupe; GOGC=100 gives Go's
// default), and the descriptor table reserved at start (internal/core/fdtable;
// TROUPE_BENCH_FDTABLE=0 leaves it to grow on demand).
//
//	go test -run '^$' -bench JoinToRoutable -benchtime 200x ./orchestrator/
func BenchmarkJoinToRoutable(b *testing.B) {
	if _, ok := os.LookupEnv("GOGC"); !ok {
		defer debug.SetGCPercent(debug.SetGCPercent(400))
	}
	if os.Getenv("TROUPE_BENCH_FDTABLE") != "0" {
		if err := fdtable.Reserve(fdtable.DefaultReserve); err != nil {
			b.Fatal(err)
		}
	}
	c := orchestratortest.Start(b, orchestratortest.Options{Pipeline: thinkerOnly, ReplicasPerStage: -1})
	eng := sim.New(sim.Config{Role: stagepb.RoleText, Logger: slog.New(slog.DiscardHandler)})
	defer eng.Close()
	srv, err := worker.New(worker.Config{Stage: "thinker", Engine: eng, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	defer func() { cancel(); <-done }()
	<-srv.Registered() // serving; no etcd client, so no record of its own

	lat := make([]time.Duration, 0, b.N)
	full := make([]time.Duration, 0, b.N)
	// The phases of each join, laid end to end: txn committed → the event
	// on the head's loop (etcd's watch delivery, the watcher, the hop to
	// the loop); → Health answered (the probe: dial, connect, handshake,
	// the call); → the answer taken by the loop; → series bound; → router
	// snapshot published.
	phaseNames := [...]string{"event", "probe", "to-loop", "bind", "route"}
	var phases [len(phaseNames)][]time.Duration
	join := func(id uint32) (start, committed time.Time, jt orchestrator.JoinTiming) {
		start = time.Now()
		reg, err := membership.Register(ctx, c.Client, membership.RegisterConfig{
			Member: membership.Member{Stage: "thinker", ReplicaID: id, Addr: srv.Advertise(), Engine: "sim", Version: "bench"},
			TTL:    time.Minute, Logger: slog.New(slog.DiscardHandler),
		})
		if err != nil {
			b.Fatal(err)
		}
		// Closed at the end, not per join: a leave would be measured too.
		b.Cleanup(func() { _ = reg.Close(context.Background()) })
		committed = time.Now()
		return start, committed, waitRouted(b, c.Head, id, committed.Add(10*time.Second))
	}
	// Warm-up joins, not timed: the head has just started, and a record
	// written before its watch is registered with etcd is delivered by
	// etcd's resync of unsynced watchers (every 100 ms): seen as a 35-60
	// ms first join in some runs. That is a head-start cost, not a join's.
	const warmup = 3
	for id := range uint32(warmup) {
		join(id + 1)
	}
	b.ResetTimer()
	for i := range b.N {
		start, committed, jt := join(uint32(warmup + i + 1))
		lat = append(lat, jt.Routed.Sub(committed))
		full = append(full, jt.Routed.Sub(start))
		for p, d := range [...]time.Duration{
			jt.Event.Sub(committed), jt.Answered.Sub(jt.Event), jt.Attach.Sub(jt.Answered),
			jt.Bound.Sub(jt.Attach), jt.Routed.Sub(jt.Bound),
		} {
			phases[p] = append(phases[p], d)
		}
	}
	b.StopTimer()
	b.ReportMetric(pct(lat, 0.5), "txn-to-routable-p50-ms")
	b.ReportMetric(pct(lat, 0.99), "txn-to-routable-p99-ms")
	b.ReportMetric(pct(lat, 1), "txn-to-routable-max-ms")
	b.ReportMetric(pct(full, 0.5), "register-to-routable-p50-ms")
	b.ReportMetric(pct(full, 0.99), "register-to-routable-p99-ms")
	for p, name := range phaseNames {
		b.ReportMetric(pct(phases[p], 0.5), "phase-"+name+"-p50-ms")
		b.ReportMetric(pct(phases[p], 0.99), "phase-"+name+"-p99-ms")
	}
}

// waitRouted waits, without spinning, until the head has published the
// replica as routed, and returns the head's times of its join.
func waitRouted(b *testing.B, h *orchestrator.Head, id uint32, deadline time.Time) orchestrator.JoinTiming {
	b.Helper()
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	for {
		changed := orchestrator.Changed(h) // before the check: no publish is missed
		if jt, ok := orchestrator.JoinTimes(h, 0, id); ok && !jt.Routed.IsZero() {
			if !routed(h, id) {
				b.Fatalf("replica %d: join times say routed, Replicas says otherwise", id)
			}
			return jt
		}
		select {
		case <-changed:
		case <-timer.C:
			b.Fatalf("replica %d not routed within 10s", id)
		}
	}
}

func routed(h *orchestrator.Head, id uint32) bool {
	for _, r := range h.Replicas() {
		if r.Replica == id {
			return r.State == orchestrator.StateAttached
		}
	}
	return false
}
