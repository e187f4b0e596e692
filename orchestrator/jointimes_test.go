package orchestrator

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/membership/membershiptest"
)

// TestJoinTimesFollowTheJoin: the head stamps a join's steps as they
// happen, in order: the probe's answer when Health answers (not when the
// record arrived), routed only once the router routes to it; a new join
// starts over, and a refused replica is never stamped routed.
func TestJoinTimesFollowTheJoin(t *testing.T) {
	e := membershiptest.Start(t)
	cli := e.Client(t)
	h := startHead(t, cli, Pipeline{Model: "m", Stages: []Stage{{Name: "thinker"}}})
	key := router.Key{Stage: 0, Replica: 1}
	times := func() joinTimes {
		tr, ok := h.fleet.lookup(key)
		require.True(t, ok)
		return tr.times
	}

	slow := &probeServer{gate: make(chan struct{})}
	r := register(t, cli, "thinker", 1, startProbeServer(t, slow))
	waitFor(t, "join applied, probe held", func() bool {
		_, ok := h.fleet.lookup(key)
		return ok && slow.probes.Load() > 0
	})
	held := times()
	assert.False(t, held.event.IsZero())
	assert.True(t, held.answered.IsZero() && held.attach.IsZero() && held.bound.IsZero() && held.routed.IsZero(),
		"nothing after the event is stamped while Health is held: %+v", held)

	released := time.Now()
	close(slow.gate)
	waitFor(t, "routed", func() bool { _, ok := h.router.Snapshot().Lookup(key); return ok })
	waitFor(t, "routed published", func() bool { return !times().routed.IsZero() })
	first := times()
	assert.Equal(t, held.event, first.event)
	assert.False(t, first.answered.Before(released), "answered is stamped when Health answers")
	assert.False(t, first.attach.Before(first.answered))
	assert.False(t, first.bound.Before(first.attach))
	assert.False(t, first.routed.Before(first.bound))

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, r.Close(ctx))

	// The same replica id comes back as another process, a worker of
	// another stage: the new join is stamped afresh, answered but refused,
	// never routed.
	wrong := &probeServer{stage: "talker", gate: make(chan struct{})}
	register(t, cli, "thinker", 1, startProbeServer(t, wrong))
	waitFor(t, "rejoin applied, probe held", func() bool { return wrong.probes.Load() > 0 && times().event.After(first.routed) })
	rejoin := times()
	assert.True(t, rejoin.answered.IsZero() && rejoin.routed.IsZero(), "the first join's stamps are not kept: %+v", rejoin)
	close(wrong.gate)
	waitFor(t, "refused", func() bool { tr, _ := h.fleet.lookup(key); return tr.refused != "" })
	refused := times()
	assert.False(t, refused.answered.IsZero())
	assert.True(t, refused.bound.IsZero() && refused.routed.IsZero(), "a refused replica is not bound or routed: %+v", refused)
}
