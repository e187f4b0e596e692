package membership

import (
	"context"
	"net"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// SetWatchTestHooks shortens the list timeout and reports every list's
// outcome, so tests wait on what happened instead of sleeping.
func SetWatchTestHooks(w *Watcher, listTimeout time.Duration, onResync func(rev int64, err error)) {
	w.listTimeout = listTimeout
	w.onResync = onResync
}

// SetDropWatchEvent makes the watcher lose the watch events drop selects,
// as a silent drift that only the periodic reconcile can repair.
func SetDropWatchEvent(w *Watcher, drop func(*clientv3.Event) bool) {
	w.dropEvent = drop
}

// NextBackoffs returns the first n delays of membership's retry schedule
// from initial up to maxDelay.
func NextBackoffs(initial, maxDelay time.Duration, n int) []time.Duration {
	b := newBackoff(initial, maxDelay)
	out := make([]time.Duration, n)
	for i := range out {
		out[i] = b.NextBackOff()
	}
	return out
}

// SetListPage sets how many records one request of a list reads.
func SetListPage(w *Watcher, n int64) { w.listPage = n }

// RegisterWithTakeOverHook is Register with beforeTakeOver run between
// reading a predecessor's record and the txn that takes it over, so a
// test can line two takers up on the same read.
func RegisterWithTakeOverHook(ctx context.Context, cli *clientv3.Client, cfg RegisterConfig, beforeTakeOver func()) (*Registration, error) {
	return register(ctx, cli, cfg, beforeTakeOver)
}

// ListensOn is listensOn.
func ListensOn(ctx context.Context, bound net.Addr, addr string) error {
	return listensOn(ctx, bound, addr)
}
