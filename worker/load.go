package worker

import (
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// DefaultLoadInterval is the least time between two load reports of a
// SubscribeLoad stream: a change waits at most this long, and a replica
// costs each subscribed head at most 1/DefaultLoadInterval messages a
// second however busy it is.
const DefaultLoadInterval = 20 * time.Millisecond

// LoadHeartbeat is how long a SubscribeLoad stream stays silent when the
// load does not change: the current load is sent again then, so a head's
// report of an idle replica never ages past its signal bound
// (--signal-max-age, 10 s by default) unless the engine's own measurement
// does (gauges_age_ms: an engine whose metrics stopped answering).
const LoadHeartbeat = time.Second

// loadOf is the load part of the engine's gauges (Health): running,
// waiting and KV cache usage, as the chunks' stats carry them, and how old
// the engine's measurement of them is.
func loadOf(g *stagepb.EngineStats) *stagepb.EngineStats {
	return &stagepb.EngineStats{
		NumRequestsRunning:         g.GetNumRequestsRunning(),
		NumRequestsWaitingCapacity: g.GetNumRequestsWaitingCapacity(),
		NumRequestsWaitingDeferred: g.GetNumRequestsWaitingDeferred(),
		KvCacheUsagePerc:           g.GetKvCacheUsagePerc(),
		GaugesAgeMs:                g.GetGaugesAgeMs(),
	}
}

// sameLoad reports whether two loads are equal but for their age: an
// aging load is sent again only with the heartbeat.
func sameLoad(a, b *stagepb.EngineStats) bool {
	return a.GetNumRequestsRunning() == b.GetNumRequestsRunning() &&
		a.GetNumRequestsWaitingCapacity() == b.GetNumRequestsWaitingCapacity() &&
		a.GetNumRequestsWaitingDeferred() == b.GetNumRequestsWaitingDeferred() &&
		a.GetKvCacheUsagePerc() == b.GetKvCacheUsagePerc()
}

// SubscribeLoad implements StageService: the engine's load now, then each
// change, sampled from the engine's Health every LoadInterval, and the
// same load again after LoadHeartbeat without change; until the
// subscriber leaves or the worker stops (Unavailable, once nothing else
// is in flight, as SubscribeCache).
func (svc *service) SubscribeLoad(_ *stagepb.SubscribeLoadRequest, stream grpc.ServerStreamingServer[stagepb.EngineStats]) error {
	s := svc.s
	ctx := stream.Context()
	every := s.cfg.LoadInterval
	if every <= 0 {
		every = DefaultLoadInterval
	}
	last := loadOf(s.cfg.Engine.Health().GetGauges())
	if err := stream.Send(last); err != nil {
		return err
	}
	sent := time.Now()
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case now := <-tick.C:
			cur := loadOf(s.cfg.Engine.Health().GetGauges())
			if sameLoad(cur, last) && now.Sub(sent) < LoadHeartbeat {
				continue
			}
			if err := stream.Send(cur); err != nil {
				return err
			}
			last, sent = cur, now
		case <-s.idle:
			return status.Error(codes.Unavailable, "worker: stopping")
		case <-ctx.Done():
			return toStatus(ctx.Err())
		}
	}
}
