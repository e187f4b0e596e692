package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v5"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// cacheSub is the head's subscriptions to one replica's reports: its
// cache (SubscribeCache), which a goroutine applies, snapshot then every
// report, to the stage's index, and its load (SubscribeLoad, see
// loadsub.go), which another applies to the replica's load signal; so
// every head sees every report, not only those riding on its own chunks
// (see docs/routing.md, "Several heads"). The loop starts them at attach
// and stops them (cancel, then wait) at detach, at a replacing attach and
// when Run ends.
type cacheSub struct {
	rep    *router.Replica
	load   bool // it follows the load reports (counted in Head.loadSubs)
	cancel context.CancelFunc
	done   chan struct{}
}

// maxLoadSubs bounds the load subscriptions a head holds per stage: each
// costs the head up to 50 messages a second while the replica's load
// changes, so a head follows at most this many replicas of a stage (the
// first routed) and learns the others' loads from its own chunks. Past
// router.LargeStage a pick reads a sample of the stage anyway (routing.md,
// Large stages), and the bound keeps a stage of 10,000 replicas from
// costing each head 500,000 messages a second.
const maxLoadSubs = router.LargeStage

// cacheResubscribe paces the subscriptions that ended: a worker that is
// restarting or refuses is asked again at most every few seconds.
func cacheResubscribe() *backoff.ExponentialBackOff {
	return &backoff.ExponentialBackOff{InitialInterval: 50 * time.Millisecond, Multiplier: 2, MaxInterval: 5 * time.Second, RandomizationFactor: 0.2}
}

// startCacheSub subscribes to rep's cache reports when its Health declares
// the subscription and its stage policy reads them, to the blocks heads
// route to it when its Health declares that and its stage policy keeps a
// head-side index of it, and to its load
// reports when Health declares those and its stage routes by load; any
// older subscription of the key is stopped first. Loop goroutine only.
func (f *fleet) startCacheSub(rep *router.Replica, health *stagepb.HealthResponse) {
	f.stopCacheSub(rep.Key)
	cache := health.GetCacheSubscription() && f.router.UsesKVEvents(rep)
	routed := health.GetRoutedSubscription() && f.router.UsesRoutedBlocks(rep)
	load := health.GetLoadSubscription() && f.router.ReadsLoad(rep) && f.loadSubs[rep.Key.Stage] < maxLoadSubs
	if !cache && !routed && !load {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &cacheSub{rep: rep, load: load, cancel: cancel, done: make(chan struct{})}
	f.subs[rep.Key] = s
	if load {
		f.loadSubs[rep.Key.Stage]++
	}
	go func() {
		defer close(s.done)
		var wg sync.WaitGroup
		if cache {
			wg.Go(func() { f.follow(ctx, rep, "cache", f.subscribeCache) })
		}
		if routed {
			wg.Go(func() { f.follow(ctx, rep, "routed", f.subscribeRouted) })
		}
		if load {
			wg.Go(func() { f.follow(ctx, rep, "load", f.subscribeLoad) })
		}
		wg.Wait()
	}()
}

// stopCacheSub stops key's subscriptions, if any, and waits for them. Loop
// goroutine only.
func (f *fleet) stopCacheSub(key router.Key) {
	if s := f.subs[key]; s != nil {
		s.cancel()
		<-s.done
		delete(f.subs, key)
		if s.load {
			f.loadSubs[key.Stage]--
		}
	}
}

// stopCacheSubs stops every subscription (Run ends).
func (f *fleet) stopCacheSubs() {
	for key := range f.subs {
		f.stopCacheSub(key)
	}
}

// follow runs subscribe (one subscription of rep's reports of kind what)
// until ctx ends, subscribing again, with backoff, whenever it ends.
func (f *fleet) follow(ctx context.Context, rep *router.Replica, what string, subscribe func(context.Context, *router.Replica) (bool, error)) {
	wait := cacheResubscribe()
	for {
		live, err := subscribe(ctx, rep)
		if ctx.Err() != nil {
			return
		}
		if live {
			wait.Reset() // it worked: the next try starts from the shortest wait
		}
		f.log.Debug("orchestrator: subscription ended; subscribing again", "reports", what, "stage", rep.StageName, "replica", rep.Key.Replica, "err", err)
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

// subscribeCache runs one subscription to rep's engine reports (see
// subscribeTo).
func (f *fleet) subscribeCache(ctx context.Context, rep *router.Replica) (bool, error) {
	return f.subscribeTo(ctx, rep, false)
}

// subscribeRouted runs one subscription to the head-side blocks heads
// route to rep (routed-block reports, see subscribeTo), which feed the
// stage's head-side index as this head's own picks do.
func (f *fleet) subscribeRouted(ctx context.Context, rep *router.Replica) (bool, error) {
	return f.subscribeTo(ctx, rep, true)
}

// subscribeTo runs one subscription: it applies the snapshot (live from
// then on), then every report while their seq follows on.
func (f *fleet) subscribeTo(ctx context.Context, rep *router.Replica, routed bool) (live bool, _ error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := rep.Client.SubscribeCache(ctx, &stagepb.SubscribeCacheRequest{Routed: routed}, callOptions(f.cfg)...)
	if err != nil {
		return false, fmt.Errorf("orchestrator: subscribe to cache: %w", err)
	}
	snap, err := stream.Recv()
	if err != nil {
		return false, fmt.Errorf("orchestrator: cache snapshot: %w", err)
	}
	if !snap.GetSnapshot() || snap.GetRouted() != routed {
		return false, errors.New("orchestrator: cache subscription did not start with a snapshot of its kind")
	}
	apply := f.router.ApplyKVEvents
	if routed {
		apply = f.router.ApplyRoutedBlocks
		apply(rep, snap)
	} else {
		f.router.ApplyCacheSnapshot(rep, snap)
	}
	f.m.cacheSnapshots.Inc()
	for seq := snap.GetSeq(); ; seq++ {
		ev, err := stream.Recv()
		if err != nil {
			return true, fmt.Errorf("orchestrator: cache reports: %w", err)
		}
		if ev.GetSeq() != seq+1 {
			return true, fmt.Errorf("%w: %d after %d", errCacheGap, ev.GetSeq(), seq)
		}
		apply(rep, ev)
	}
}
