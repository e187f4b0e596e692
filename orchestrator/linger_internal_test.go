package orchestrator

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"

	"github.com/troupe-serving/troupe/membership"
)

// TestBurstBatchLingers: a batch that starts right after a costly flush
// (a burst: a restart's probe answers arriving one at a time at 10,000
// replicas, each flush an O(N) copy) waits for the inputs still to come,
// up to lingerFactor times that flush's duration and never past
// maxBatchAge, instead of publishing as soon as its queue is empty; a
// batch after a quiet spell does not wait.
func TestBurstBatchLingers(t *testing.T) {
	h, err := New(nil, Config{
		Pipeline: DefaultPipeline(),
		Metrics:  prometheus.NewRegistry(),
		Dial:     func(string) (*grpc.ClientConn, error) { return nil, errors.New("not dialled in this test") },
	})
	require.NoError(t, err)
	leaves := h.events.WithLabelValues(membership.Leave.String())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	// drainWhile runs one batch while leave events of untracked keys
	// arrive every 500 µs, and reports how many the batch took and how
	// long it ran.
	drainWhile := func() (taken float64, took time.Duration) {
		events := make(chan membership.Event)
		probes, departures := make(chan probeResult), make(chan departure)
		var probing sync.WaitGroup
		var senders sync.WaitGroup
		senders.Go(func() {
			for i := range 4 {
				time.Sleep(500 * time.Microsecond) // the inputs' spacing is what the test is about
				ev := membership.Event{Type: membership.Leave, Member: membership.Member{Stage: DefaultPipeline().Stages[0].Name, ReplicaID: uint32(100 + i)}}
				select {
				case events <- ev:
				case <-time.After(20 * time.Millisecond): // the batch ended; nobody takes it
					return
				}
			}
		})
		before := testutil.ToFloat64(leaves)
		start := time.Now()
		h.begin()
		h.drain(ctx, events, probes, departures, &probing)
		took = time.Since(start)
		h.flush()
		senders.Wait()
		probing.Wait()
		return testutil.ToFloat64(leaves) - before, took
	}

	// After a quiet spell: the batch ends with its empty queue.
	h.flushEnd, h.flushTook = time.Now().Add(-time.Second), time.Millisecond
	taken, took := drainWhile()
	assert.Zero(t, taken, "a batch after a quiet spell waited for inputs")
	assert.Less(t, took, maxBatchAge, "a batch after a quiet spell waited")

	// Right after a flush that took 1 ms: the batch waits up to
	// maxBatchAge (5 ms < 20 × 1 ms) and takes the inputs that came.
	h.flushEnd, h.flushTook = time.Now(), time.Millisecond
	taken, took = drainWhile()
	assert.GreaterOrEqual(t, taken, 1.0, "a batch within a burst did not wait for the inputs still to come")
	assert.GreaterOrEqual(t, took, maxBatchAge/2)
	assert.Less(t, took, maxBatchAge+50*time.Millisecond, "a batch waited past maxBatchAge (plus scheduling slack)")
}
