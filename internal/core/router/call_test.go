package router

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// TestCallOutcomePath: a pick's call holds the replica's slot and lets
// Abort cancel it until Done; Done feeds the breaker with the outcome,
// once, and gives the slot back.
func TestCallOutcomePath(t *testing.T) {
	addr, _ := serve(t)
	r := NewWithBreaker(stages(t, 1, PolicyRoundRobin), insecureDial, slog.New(slog.DiscardHandler),
		Breaker{Failures: 2, Backoff: time.Hour})
	defer r.Close()
	var reps []*Replica
	for id := range uint32(2) {
		rep, err := r.Dial(ReplicaSpec{Key: Key{Stage: 0, Replica: id}, StageName: "s", Addr: addr})
		require.NoError(t, err)
		require.NoError(t, r.Add(rep))
		reps = append(reps, rep)
	}
	begin := func() (*Call, *Replica, context.Context) {
		d, err := r.Pick(0, &Request{}, nil)
		require.NoError(t, err)
		ctx, cancel := context.WithCancelCause(context.Background())
		t.Cleanup(func() { cancel(nil) })
		return r.Begin(d, false, cancel), d.Replica, ctx
	}

	c, rep, ctx := begin()
	assert.EqualValues(t, 1, rep.InFlight(), "the call holds a slot")
	cause := errors.New("replica froze")
	assert.Equal(t, 1, rep.Abort(cause), "the call is tracked")
	assert.ErrorIs(t, context.Cause(ctx), cause)
	report := c.Done(Outcome{Err: cause, Fault: true})
	assert.Equal(t, 1, report.Failures)
	assert.False(t, report.Ejected)
	assert.EqualValues(t, 0, rep.InFlight(), "Done gives the slot back")
	assert.Equal(t, 0, rep.Abort(cause), "and untracks the call")

	// A failure that is not the replica's leaves its breaker alone.
	c2, rep2, _ := begin()
	require.Same(t, reps[1], rep2)
	assert.Zero(t, c2.Done(Outcome{Err: errors.New("client left")}).Failures)

	// The second fault in a row ejects; a success after the back-off is
	// reported as a recovery.
	c, rep, _ = begin()
	require.Same(t, reps[0], rep)
	assert.True(t, c.Done(Outcome{Err: cause, Fault: true}).Ejected)
	assert.False(t, rep.Routable())
	rep.ejectedUntil.Store(time.Now().Add(-time.Second).UnixNano())
	c = r.Begin(Decision{Replica: rep}, false, func(error) {})
	c.Chunk(&stagepb.GenerateChunk{Stats: &stagepb.EngineStats{NumRequestsRunning: 3, NumRequestsWaitingCapacity: 2}})
	assert.EqualValues(t, 5, rep.Load(), "a chunk's stats set the replica's load")
	assert.True(t, c.Done(Outcome{}).Recovered)
	assert.True(t, rep.Routable())

	// A draining refusal marks the replica: no request routes to it again.
	c = r.Begin(Decision{Replica: rep}, false, func(error) {})
	report = c.Done(Outcome{Err: errors.New("draining"), Draining: true})
	assert.Zero(t, report.Failures, "a refusal is not a failure")
	assert.True(t, rep.Draining())
	d, err := r.Pick(0, &Request{}, nil)
	require.NoError(t, err)
	assert.NotSame(t, rep, d.Replica)
}
