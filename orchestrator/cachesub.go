package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/cenkalti/backoff/v5"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// cacheSub is the head's subscription to one replica's cache reports
// (SubscribeCache): a goroutine that applies the replica's snapshot, then
// every report, to the stage's index, so every head sees every report, not
// only those riding on its own chunks (see docs/routing.md, "Several
// heads"). The loop starts it at attach and stops it (cancel, then wait)
// at detach, at a replacing attach and when Run ends.
type cacheSub struct {
	rep    *router.Replica
	cancel context.CancelFunc
	done   chan struct{}
}

// cacheResubscribe paces the subscriptions that ended: a worker that is
// restarting or refuses is asked again at most every few seconds.
func cacheResubscribe() *backoff.ExponentialBackOff {
	return &backoff.ExponentialBackOff{InitialInterval: 50 * time.Millisecond, Multiplier: 2, MaxInterval: 5 * time.Second, RandomizationFactor: 0.2}
}

// startCacheSub subscribes to rep's cache reports when its Health declares
// the subscription and its stage policy reads them; any older subscription
// of the key is stopped first. Loop goroutine only.
func (h *Head) startCacheSub(rep *router.Replica, health *stagepb.HealthResponse) {
	h.stopCacheSub(rep.Key)
	if !health.GetCacheSubscription() || !h.router.UsesKVEvents(rep) {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &cacheSub{rep: rep, cancel: cancel, done: make(chan struct{})}
	h.subs[rep.Key] = s
	go func() {
		defer close(s.done)
		h.followCache(ctx, rep)
	}()
}

// stopCacheSub stops key's subscription, if any, and waits for it. Loop
// goroutine only.
func (h *Head) stopCacheSub(key router.Key) {
	if s := h.subs[key]; s != nil {
		s.cancel()
		<-s.done
		delete(h.subs, key)
	}
}

// stopCacheSubs stops every subscription (Run ends).
func (h *Head) stopCacheSubs() {
	for key := range h.subs {
		h.stopCacheSub(key)
	}
}

// followCache subscribes to rep's reports until ctx ends, subscribing
// again, with backoff, whenever a stream ends or skips a seq.
func (h *Head) followCache(ctx context.Context, rep *router.Replica) {
	wait := cacheResubscribe()
	for {
		live, err := h.subscribeCache(ctx, rep)
		if ctx.Err() != nil {
			return
		}
		if live {
			wait.Reset() // it worked: the next try starts from the shortest wait
		}
		h.log.Debug("orchestrator: cache subscription ended; subscribing again", "stage", rep.StageName, "replica", rep.Key.Replica, "err", err)
		timer := time.NewTimer(wait.NextBackOff())
		select {
		case <-ctx.Done():
			timer.Stop()
			return
		case <-timer.C:
		}
	}
}

// errCacheGap ends a subscription whose reports skipped a seq: the next
// one starts from a fresh snapshot.
var errCacheGap = errors.New("orchestrator: cache reports skipped a seq")

// subscribeCache runs one subscription: it applies the snapshot (live
// from then on), then every report while their seq follows on.
func (h *Head) subscribeCache(ctx context.Context, rep *router.Replica) (live bool, _ error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := rep.Client.SubscribeCache(ctx, &stagepb.SubscribeCacheRequest{}, h.calls...)
	if err != nil {
		return false, fmt.Errorf("orchestrator: subscribe to cache: %w", err)
	}
	snap, err := stream.Recv()
	if err != nil {
		return false, fmt.Errorf("orchestrator: cache snapshot: %w", err)
	}
	if !snap.GetSnapshot() {
		return false, errors.New("orchestrator: cache subscription did not start with a snapshot")
	}
	h.router.ApplyCacheSnapshot(rep, snap)
	h.cacheSnapshots.Inc()
	for seq := snap.GetSeq(); ; seq++ {
		ev, err := stream.Recv()
		if err != nil {
			return true, fmt.Errorf("orchestrator: cache reports: %w", err)
		}
		if ev.GetSeq() != seq+1 {
			return true, fmt.Errorf("%w: %d after %d", errCacheGap, ev.GetSeq(), seq)
		}
		h.router.ApplyKVEvents(rep, ev)
	}
}
