package membership

import (
	"context"
	"io"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/troupe-serving/troupe/membership/membershiptest"
)

// Reproduce (see docs/membership.md):
//
//	go test -run '^$' -bench . -benchtime 2000x ./membership/
//
// Both benchmarks run against an embedded etcd with fsync ON, as in
// production; the registration txn pays the WAL fsync.

// BenchmarkRegisterTxn measures the create-if-absent txn that registers a
// replica (a lease is granted once, outside the loop).
func BenchmarkRegisterTxn(b *testing.B) {
	e := membershiptest.StartWith(b, membershiptest.Options{Fsync: true})
	cli := e.Client(b)
	ctx := context.Background()
	grant, err := cli.Grant(ctx, 600)
	if err != nil {
		b.Fatal(err)
	}
	r := &Registration{leased: &leased{cli: cli}, member: benchMember()}
	durs := make([]time.Duration, 0, max(b.N, 1))
	id := uint32(0)
	for b.Loop() {
		if err := r.setID(DefaultCluster, id); err != nil {
			b.Fatal(err)
		}
		id++
		start := time.Now()
		ok, _, err := r.create(ctx, grant.ID)
		durs = append(durs, time.Since(start))
		if err != nil || !ok {
			b.Fatalf("create %s: ok=%v err=%v", r.key, ok, err)
		}
	}
	reportPercentiles(b, durs, "")
}

// BenchmarkJoinLatency measures the time from the registration txn's
// response (at the worker) to the head's watcher delivering the Join on an
// unbuffered channel, as the head reads it (p50-ms, p99-ms), and from the
// txn's start to the Join (e2e-p50-ms, e2e-p99-ms). The watch event often
// arrives before the txn response, so the first can be tiny.
func BenchmarkJoinLatency(b *testing.B) {
	e := membershiptest.StartWith(b, membershiptest.Options{Fsync: true})
	workerCli := e.Client(b)
	headCli := e.Client(b)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w := NewWatcher(headCli, WatchConfig{ReconcileInterval: time.Hour, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	events := make(chan Event)
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx, events) }()
	defer func() {
		cancel()
		<-done
	}()

	grant, err := workerCli.Grant(ctx, 600)
	if err != nil {
		b.Fatal(err)
	}
	r := &Registration{leased: &leased{cli: workerCli}, member: benchMember()}
	durs := make([]time.Duration, 0, max(b.N, 1))
	e2e := make([]time.Duration, 0, max(b.N, 1))
	id := uint32(0)
	for b.Loop() {
		if err := r.setID(DefaultCluster, id); err != nil {
			b.Fatal(err)
		}
		id++
		sent := time.Now()
		ok, _, err := r.create(ctx, grant.ID)
		if err != nil || !ok {
			b.Fatalf("create %s: ok=%v err=%v", r.key, ok, err)
		}
		answered := time.Now()
		for ev := range events {
			if ev.Type == Join && ev.Key == r.key {
				break
			}
		}
		durs = append(durs, time.Since(answered))
		e2e = append(e2e, time.Since(sent))
	}
	reportPercentiles(b, durs, "")
	reportPercentiles(b, e2e, "e2e-")
}

func benchMember() Member {
	return Member{Stage: "thinker", Addr: "127.0.0.1:7000", Engine: "sim", Version: "bench", StartedAt: time.Now().UTC()}
}

// reportPercentiles reports p50, p99 and max of per-iteration durations.
func reportPercentiles(b *testing.B, durs []time.Duration, prefix string) {
	b.Helper()
	if len(durs) == 0 {
		return
	}
	slices.Sort(durs)
	at := func(q float64) time.Duration {
		i := int(q*float64(len(durs))+0.5) - 1
		return durs[min(max(i, 0), len(durs)-1)]
	}
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	b.ReportMetric(ms(at(0.50)), prefix+"p50-ms")
	b.ReportMetric(ms(at(0.99)), prefix+"p99-ms")
	b.ReportMetric(ms(durs[len(durs)-1]), prefix+"max-ms")
	b.Logf("%sn=%d p50=%v p99=%v max=%v", prefix, len(durs), at(0.50), at(0.99), durs[len(durs)-1])
}
