package membership

import (
	"context"
	"time"

	"github.com/cenkalti/backoff/v5"
)

// newBackoff is membership's retry schedule: steps doubling from initial
// up to maxDelay, each delay drawn uniformly from [step/2, step] so
// replicas that lost etcd together do not retry together. The library
// draws from c·[1-r, 1+r]; c = 3/4 of the step and r = 1/3 give that
// range.
func newBackoff(initial, maxDelay time.Duration) *backoff.ExponentialBackOff {
	b := &backoff.ExponentialBackOff{
		InitialInterval:     initial * 3 / 4,
		RandomizationFactor: 1.0 / 3,
		Multiplier:          2,
		MaxInterval:         maxDelay * 3 / 4,
	}
	b.Reset()
	return b
}

// sleep waits b's next delay; false when ctx ended first.
func sleep(ctx context.Context, b backoff.BackOff) bool {
	t := time.NewTimer(b.NextBackOff())
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
