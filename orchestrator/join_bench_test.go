package orchestrator_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/sim"
)

// BenchmarkJoinToRoutable measures the time from a replica's registration
// transaction (committed, as Register returns) to the moment the head
// routes to it: the watch event, the engine index, the Health probe over a
// new connection, the series bound and the router snapshot published. One
// worker process serves every record, so nothing but the join is timed.
//
//	go test -run '^$' -bench JoinToRoutable -benchtime 200x ./orchestrator/
func BenchmarkJoinToRoutable(b *testing.B) {
	c := orchestratortest.Start(b, orchestratortest.Options{Pipeline: thinkerOnly, ReplicasPerStage: -1})
	eng := sim.New(sim.Config{Role: sim.RoleText, Logger: slog.New(slog.DiscardHandler)})
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
	b.ResetTimer()
	for i := range b.N {
		id := uint32(i + 1)
		start := time.Now()
		reg, err := membership.Register(ctx, c.Client, membership.RegisterConfig{
			Member: membership.Member{Stage: "thinker", ReplicaID: id, Addr: srv.Advertise(), Engine: "sim", Version: "bench"},
			TTL:    time.Minute, Logger: slog.New(slog.DiscardHandler),
		})
		if err != nil {
			b.Fatal(err)
		}
		committed := time.Now()
		deadline := committed.Add(10 * time.Second)
		for !routed(c.Head, id) {
			if time.Now().After(deadline) {
				b.Fatalf("replica %d not routed within 10s", id)
			}
		}
		now := time.Now()
		lat = append(lat, now.Sub(committed))
		full = append(full, now.Sub(start))
		// Closed at the end, not per join: a leave would be measured too.
		defer reg.Close(context.Background())
	}
	b.StopTimer()
	b.ReportMetric(pct(lat, 0.5), "txn-to-routable-p50-ms")
	b.ReportMetric(pct(lat, 0.99), "txn-to-routable-p99-ms")
	b.ReportMetric(pct(full, 0.5), "register-to-routable-p50-ms")
	b.ReportMetric(pct(full, 0.99), "register-to-routable-p99-ms")
}

func routed(h *orchestrator.Head, id uint32) bool {
	for _, r := range h.Replicas() {
		if r.Replica == id {
			return r.State == orchestrator.StateAttached
		}
	}
	return false
}
