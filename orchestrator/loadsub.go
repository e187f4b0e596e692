package orchestrator

import (
	"context"
	"fmt"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// subscribeLoad runs one load subscription of rep (SubscribeLoad): every
// report it brings sets rep's load signal, dated now, and its gauges, as
// a chunk's stats do, so every head reads every replica's load as the
// engine reports it, also of a replica this head sends nothing (live once
// the first report arrived).
func (f *fleet) subscribeLoad(ctx context.Context, rep *router.Replica) (live bool, _ error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := rep.Client.SubscribeLoad(ctx, &stagepb.SubscribeLoadRequest{}, callOptions(f.cfg)...)
	if err != nil {
		return false, fmt.Errorf("orchestrator: subscribe to load: %w", err)
	}
	for {
		s, err := stream.Recv()
		if err != nil {
			return live, fmt.Errorf("orchestrator: load reports: %w", err)
		}
		live = true
		rep.SetLoadFrom(s)
		if err := f.stats.Record(rep.EngineIndex, s); err != nil {
			f.log.Debug("orchestrator: record load", "err", err)
		}
	}
}
