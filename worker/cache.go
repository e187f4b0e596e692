package worker

import (
	"context"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// CacheReporter is implemented by engines that report their prefix cache
// (Health's cache_config.kv_events) to subscribers as well as on chunks.
// The Server serves SubscribeCache with it, and says so in Health
// (cache_subscription).
type CacheReporter interface {
	// WatchCache calls fn with a snapshot of the cached blocks (a
	// KvEvents with Snapshot and Cleared set, Seq that of the last report
	// it includes), then with every report in seq order, until stop is
	// called. fn must not block and must not modify the reports.
	WatchCache(ctx context.Context, fn func(*stagepb.KvEvents)) (stop func(), err error)
}

// CacheSubscriberBuffer is how many reports a SubscribeCache stream may
// have waiting to be sent; one more and the subscriber is dropped (it
// subscribes again for a fresh snapshot), so a slow head never holds up
// the engine.
const CacheSubscriberBuffer = 256

// cacheReporter returns the engine's CacheReporter when the engine reports
// its cache.
func (s *Server) cacheReporter(h *stagepb.HealthResponse) (CacheReporter, bool) {
	r, ok := s.cfg.Engine.(CacheReporter)
	return r, ok && h.GetCacheConfig().GetKvEvents()
}

// cacheSub is one subscriber's bounded queue. push runs on the engine's
// goroutine and never blocks: a full queue drops the subscriber.
type cacheSub struct {
	ch      chan *stagepb.KvEvents
	dropped chan struct{}
	once    sync.Once
}

func newCacheSub(n int) *cacheSub {
	return &cacheSub{ch: make(chan *stagepb.KvEvents, n), dropped: make(chan struct{})}
}

func (c *cacheSub) push(ev *stagepb.KvEvents) {
	select {
	case c.ch <- ev:
	default:
		c.once.Do(func() { close(c.dropped) })
	}
}

// SubscribeCache implements StageService: the engine's snapshot, then its
// reports (or, with req.routed, the blocks heads routed here: routed.go),
// until the subscriber leaves, falls behind (ResourceExhausted) or the
// worker stops (Unavailable, once nothing else is in flight, so a graceful
// stop does not wait for subscribers).
func (svc *service) SubscribeCache(req *stagepb.SubscribeCacheRequest, stream grpc.ServerStreamingServer[stagepb.KvEvents]) error {
	s := svc.s
	ctx := stream.Context()
	sub := newCacheSub(CacheSubscriberBuffer)
	if req.GetRouted() {
		defer s.routed.watch(sub)()
	} else {
		rep, ok := s.cacheReporter(s.cfg.Engine.Health())
		if !ok {
			return status.Error(codes.Unimplemented, "worker: the engine does not report its cache")
		}
		stop, err := rep.WatchCache(ctx, sub.push)
		if err != nil {
			return toStatus(err)
		}
		defer stop()
	}
	for {
		select {
		case ev := <-sub.ch:
			if err := stream.Send(ev); err != nil {
				return err
			}
		case <-sub.dropped:
			return status.Error(codes.ResourceExhausted, "worker: cache subscriber fell behind; subscribe again")
		case <-s.idle:
			return status.Error(codes.Unavailable, "worker: stopping")
		case <-ctx.Done():
			return toStatus(ctx.Err())
		}
	}
}
