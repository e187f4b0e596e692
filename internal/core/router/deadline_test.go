package router

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// observe feeds p the first-output times measured on c (one per replica),
// each of an attempt that started with none ahead of it.
func observe(p *Deadline, c []*Replica, ttft ...time.Duration) {
	for i, r := range c {
		p.Observe(r, nil, ttft[i])
	}
}

// A replica three times slower than the others is predicted so and left
// out when its prediction misses the target, even while it is the least
// loaded; the others share the load.
func TestDeadlineAvoidsTheSlowReplica(t *testing.T) {
	p := &Deadline{Options: DeadlineOptions{Capacity: 4}}
	c := replicas(4)
	observe(p, c, 40*time.Millisecond, 40*time.Millisecond, 40*time.Millisecond, 120*time.Millisecond)
	served := map[uint32]int{}
	var running []*Replica
	for range 300 {
		d := p.Pick(&Request{Deadline: time.Now().Add(100 * time.Millisecond)}, c)
		require.NotNil(t, d.Replica)
		served[d.Replica.Key.Replica]++
		assert.Equal(t, ReasonDeadline, d.Reason)
		assert.LessOrEqual(t, d.Predicted, 100*time.Millisecond, "a chosen replica is predicted in time")
		d.Replica.Acquire()
		running = append(running, d.Replica)
		if len(running) > 6 {
			running[0].Release()
			running = running[1:]
		}
	}
	assert.Zero(t, served[3], "the slow replica is never predicted in time")
	for id := range uint32(3) {
		assert.GreaterOrEqual(t, served[id], 60, "the fast replicas share the load: %v", served)
	}
	for _, r := range running {
		r.Release()
	}

	// With the fast replicas busier, least_loaded takes the slow one; the
	// deadline policy still does not while a fast one is in time.
	for _, r := range c[:3] {
		r.Acquire()
		defer r.Release()
	}
	assert.Equal(t, c[3], LeastLoaded{}.Pick(&Request{}, c).Replica)
	assert.NotEqual(t, c[3], p.Pick(&Request{Deadline: time.Now().Add(100 * time.Millisecond)}, c).Replica)
}

// The prediction counts the attempts waiting for their first output on a
// replica: unit × (pending + 1), the unit learned from each observation
// divided by the attempts that were waiting when it started, itself
// included; so a replica with two prefills queued loses a tight target to
// a busier one with none, which least_loaded would not do.
func TestDeadlinePredictionCountsPendingFirstOutputs(t *testing.T) {
	p := &Deadline{Options: DeadlineOptions{Capacity: 8}}
	rt := New([]StageRouting{{Policy: p}}, nil, nil)
	c := replicas(2)
	first := rt.StartFirstOutput(c[0])
	second := rt.StartFirstOutput(c[0])
	assert.Equal(t, int64(1), second.ahead, "one attempt waiting ahead of the second")
	first.Done()
	rt.ObserveFirstOutput(first, 20*time.Millisecond)
	second.Done()
	second.Done() // only the first Done counts
	rt.ObserveFirstOutput(second, 40*time.Millisecond)
	assert.Equal(t, int64(0), c[0].deadline.pending.Load())
	assert.InDelta(t, 0.020, loadFloat(&c[0].deadline.unit), 1e-9, "40 ms with one ahead: a unit of 20 ms")
	assert.Zero(t, loadFloat(&c[0].deadline.dev), "both observations agree")
	got, ok := rt.PredictedFirstOutput(c[0])
	require.True(t, ok)
	assert.InDelta(t, float64(20*time.Millisecond), float64(got), float64(time.Microsecond), "none waiting: one unit")

	queued := []*Pending{rt.StartFirstOutput(c[0]), rt.StartFirstOutput(c[0])}
	got, _ = rt.PredictedFirstOutput(c[0])
	assert.InDelta(t, float64(60*time.Millisecond), float64(got), float64(time.Microsecond), "two waiting: three units")
	for range 3 {
		c[1].Acquire()
		defer c[1].Release()
	}
	assert.Equal(t, c[0], LeastLoaded{}.Pick(&Request{}, c).Replica)
	d := p.Pick(&Request{Deadline: time.Now().Add(50 * time.Millisecond)}, c)
	assert.Equal(t, c[1], d.Replica, "busier, but decoding: its first output comes in time (the mean unit, 20 ms)")
	assert.Equal(t, ReasonDeadline, d.Reason)
	assert.InDelta(t, float64(20*time.Millisecond), float64(d.Predicted), float64(time.Microsecond))
	d = p.Pick(&Request{Deadline: time.Now().Add(time.Second)}, c)
	assert.Equal(t, c[1], d.Replica, "both in time: the one with fewer first outputs pending")
	for i := range queued {
		queued[i].Done()
	}
	assert.Equal(t, int64(0), c[0].deadline.pending.Load())
	d = p.Pick(&Request{Deadline: time.Now().Add(time.Second)}, c)
	assert.Equal(t, c[0], d.Replica, "none pending anywhere: the least loaded")

	// Later observations move the average by deadlineAlpha, and the
	// deviation from 0; the in-time check adds the margin to the unit.
	p.Observe(c[0], nil, 35*time.Millisecond)
	u := 0.020 + deadlineAlpha*(0.035-0.020)
	assert.InDelta(t, u, loadFloat(&c[0].deadline.unit), 1e-9)
	dev := deadlineAlpha * 0.015
	assert.InDelta(t, dev, loadFloat(&c[0].deadline.dev), 1e-9)
	c[0].deadline.pending.Add(1)
	sc := newScorer(c, 0)
	pred, bound := p.predict(c[0], &sc, 0)
	c[0].deadline.pending.Add(-1)
	assert.InDelta(t, u*2, pred, 1e-9)
	assert.InDelta(t, (u+DeadlineMargin*dev)*2, bound, 1e-9)

	// One stalled observation counts as deadlineMaxJump units at most.
	p.Observe(c[0], nil, time.Second)
	assert.InDelta(t, u+deadlineAlpha*(deadlineMaxJump*u-u), loadFloat(&c[0].deadline.unit), 1e-9, "a stall of 1 s does not spoil the unit")

	// A stage routed otherwise counts nothing; the zero Pending's Done is
	// harmless.
	other := New([]StageRouting{{Policy: LeastLoaded{}}}, nil, nil)
	w := other.StartFirstOutput(c[0])
	w.Done()
	assert.Equal(t, int64(0), c[0].deadline.pending.Load())
}

// A replica running Capacity requests or more adds the wait for a slot:
// (occupancy − capacity + 1) × hold / capacity, hold being how long an
// attempt holds one; an observation made behind that wait learns the unit
// without it.
func TestDeadlinePredictionWaitsForASlot(t *testing.T) {
	p := &Deadline{Options: DeadlineOptions{Capacity: 2}}
	rt := New([]StageRouting{{Policy: p}}, nil, nil)
	c := replicas(1)
	p.Observe(c[0], nil, 30*time.Millisecond)
	rt.ObserveHold(c[0], 100*time.Millisecond)
	c[0].Acquire()
	got, _ := rt.PredictedFirstOutput(c[0])
	assert.InDelta(t, float64(30*time.Millisecond), float64(got), float64(time.Microsecond), "a slot free")
	for range 2 {
		c[0].Acquire()
	}
	c[0].SetLoad(1) // the engine reports less than this head's in flight: the larger counts
	got, _ = rt.PredictedFirstOutput(c[0])
	assert.InDelta(t, float64(130*time.Millisecond), float64(got), float64(time.Microsecond), "3 running at capacity 2: 2 × 100 ms / 2 to wait")
	w := rt.StartFirstOutput(c[0])
	assert.InDelta(t, 0.100, w.slot, 1e-9)
	for range 3 {
		c[0].Release()
	}
	w.Done()
	rt.ObserveFirstOutput(w, 130*time.Millisecond)
	assert.InDelta(t, 0.030, loadFloat(&c[0].deadline.unit), 1e-9, "the slot wait is not the unit's")
}

// A replica whose first outputs vary is trusted with a tight target only
// with room for its deviation: of two replicas with the same mean, the
// steady one takes a target near that mean, the erratic one does not.
func TestDeadlineMarginForVariance(t *testing.T) {
	p := &Deadline{}
	c := replicas(2)
	for i := range 40 {
		p.Observe(c[0], nil, 30*time.Millisecond)
		jitter := 20 * time.Millisecond
		if i%2 == 0 {
			jitter = -jitter
		}
		p.Observe(c[1], nil, 30*time.Millisecond+jitter)
	}
	c[0].Acquire()
	defer c[0].Release()
	d := p.Pick(&Request{Deadline: time.Now().Add(45 * time.Millisecond)}, c)
	assert.Equal(t, c[0], d.Replica, "the steady replica, although busier")
	assert.Equal(t, ReasonDeadline, d.Reason)
	d = p.Pick(&Request{Deadline: time.Now().Add(500 * time.Millisecond)}, c)
	assert.Equal(t, c[1], d.Replica, "with room, the less loaded")
}

// When no replica is predicted in time the least loaded one is returned,
// as a fallback, or for the caller to refuse under admission.
func TestDeadlineUnmeetable(t *testing.T) {
	c := replicas(3)
	for _, admission := range []bool{false, true} {
		p := &Deadline{Options: DeadlineOptions{Admission: admission}}
		observe(p, c, 200*time.Millisecond, 150*time.Millisecond, 300*time.Millisecond)
		c[1].Acquire()
		d := p.Pick(&Request{Deadline: time.Now().Add(50 * time.Millisecond)}, c)
		c[1].Release()
		assert.Equal(t, c[1], d.Replica, "the one predicted soonest, although busier")
		want := ReasonLoadFallback
		if admission {
			want = ReasonDeadlineShed
		}
		assert.Equal(t, want, d.Reason)
		assert.Contains(t, p.Reasons(), want)

		// A deadline already past is unmeetable too.
		d = p.Pick(&Request{Deadline: time.Now().Add(-time.Millisecond)}, c)
		assert.Equal(t, want, d.Reason)
		// No target: least_loaded.
		d = p.Pick(&Request{}, c)
		assert.Equal(t, ReasonLoad, d.Reason)
	}
}

// The real-time check: a replica whose audio rate is below the target is
// left out; one not yet observed is tried.
func TestDeadlineKeepsRealTime(t *testing.T) {
	p := &Deadline{}
	c := replicas(3)
	p.ObserveRate(c[0], 0.6)
	p.ObserveRate(c[1], 2.5)
	c[1].Acquire()
	c[1].Acquire()
	c[2].Acquire()
	defer c[1].Release()
	defer c[1].Release()
	defer c[2].Release()
	d := p.Pick(&Request{MinRTF: 1}, c)
	assert.Equal(t, c[2], d.Replica, "the unobserved replica passes; the slow one does not although idle")
	assert.Equal(t, ReasonDeadline, d.Reason)
	p.ObserveRate(c[2], 0.9)
	d = p.Pick(&Request{MinRTF: 1}, c)
	assert.Equal(t, c[1], d.Replica)
}

// The policy is chosen by name and its picks allocate nothing.
func TestDeadlinePolicyByName(t *testing.T) {
	p, err := NewPolicy(PolicyDeadline, PolicyOptions{Deadline: DeadlineOptions{Capacity: 3, Admission: true}})
	require.NoError(t, err)
	dp := p.(*Deadline)
	assert.Equal(t, 3.0, dp.capacity())
	c := replicas(16)
	observe(dp, c, make16(30*time.Millisecond)...)
	req := &Request{Deadline: time.Now().Add(time.Second)}
	allocs := testing.AllocsPerRun(100, func() { _ = p.Pick(req, c) })
	assert.Zero(t, allocs)
	assert.Equal(t, "deadline_shed", ReasonDeadlineShed.String())
	assert.Equal(t, "deadline", ReasonDeadline.String())
}

func make16(d time.Duration) []time.Duration {
	out := make([]time.Duration, 16)
	for i := range out {
		out[i] = d
	}
	return out
}

// Under admission a stage whose replicas are all predicted late still
// sends one request per DeadlineProbeAfter to the replica predicted
// soonest, so a prediction spoiled by a burst is corrected.
func TestDeadlineProbesWhileShedding(t *testing.T) {
	p := &Deadline{Options: DeadlineOptions{Admission: true}}
	c := replicas(2)
	observe(p, c, 200*time.Millisecond, 100*time.Millisecond)
	late := &Request{Deadline: time.Now().Add(50 * time.Millisecond)}
	assert.Equal(t, ReasonDeadlineShed, p.Pick(late, c).Reason, "just observed: shed")

	c[1].deadline.seen.Store(time.Now().Add(-2 * DeadlineProbeAfter).UnixNano())
	d := p.Pick(late, c)
	assert.Equal(t, ReasonLoadFallback, d.Reason, "a probe goes through")
	assert.True(t, d.Probe)
	assert.Equal(t, c[1], d.Replica, "to the replica predicted soonest")
	assert.Equal(t, ReasonDeadlineShed, p.Pick(late, c).Reason, "one probe per interval")

	// A probe that taught nothing (another stage shed its request before
	// its input came) is given back: the next request probes.
	rt := New([]StageRouting{{Policy: p}}, nil, nil)
	rt.ReleaseProbe(c[1])
	d = p.Pick(late, c)
	assert.True(t, d.Probe, "due again")
	assert.Equal(t, c[1], d.Replica)
	assert.False(t, p.Pick(late, c).Probe)

	// The probe's outcome, fast again, reopens the replica to targets.
	for range 10 {
		p.Observe(c[1], nil, 10*time.Millisecond)
	}
	d = p.Pick(late, c)
	assert.Equal(t, ReasonDeadline, d.Reason)
	assert.Equal(t, c[1], d.Replica)
}

// The load model (deadline.model: load) predicts unit × (1 + score/capacity)
// whatever waits for a first output, its unit learned over the same factor
// at the attempt's start.
func TestDeadlineLoadModel(t *testing.T) {
	p := &Deadline{Options: DeadlineOptions{Capacity: 2, Model: DeadlineModelLoad}}
	rt := New([]StageRouting{{Policy: p}}, nil, nil)
	c := replicas(1)
	for range 2 {
		c[0].Acquire()
		defer c[0].Release()
	}
	w := rt.StartFirstOutput(c[0])
	assert.Equal(t, int64(2), w.score)
	w.Done()
	rt.ObserveFirstOutput(w, 60*time.Millisecond)
	assert.InDelta(t, 0.030, loadFloat(&c[0].deadline.unit), 1e-9, "60 ms at load 2, capacity 2: a unit of 30 ms")
	queued := rt.StartFirstOutput(c[0])
	defer queued.Done()
	got, _ := rt.PredictedFirstOutput(c[0])
	assert.InDelta(t, float64(60*time.Millisecond), float64(got), float64(time.Microsecond), "blind to the queued first output")
	assert.NoError(t, CheckDeadlineModel(""))
	assert.NoError(t, CheckDeadlineModel(DeadlineModelLoad))
	assert.Error(t, CheckDeadlineModel("psychic"))
}

// An attempt whose input does not exist yet (a streamed later stage)
// awaits it outside the replica's queue and slots; from its first input
// piece it queues, the time it waited is the stage's lead, and its first
// output is learned as the replica's own time, less the lead. A pick for
// such an attempt adds the lead, so a fast replica whose input comes late
// is predicted late for a target shorter than the wait, and in time for
// one that covers it. An attempt whose input never came teaches nothing.
func TestDeadlineLeadIsNotTheReplicas(t *testing.T) {
	p := &Deadline{Options: DeadlineOptions{Capacity: 1}}
	rt := New([]StageRouting{{Policy: p}}, nil, nil)
	c := replicas(1)
	rt.ObserveHold(c[0], 100*time.Millisecond)

	w := rt.AwaitInput(c[0])
	c[0].Acquire()
	assert.Equal(t, int64(1), c[0].deadline.awaiting.Load())
	assert.Equal(t, int64(0), c[0].deadline.pending.Load(), "not in the replica's queue before its input")
	sc := newScorer(c, 0)
	assert.Zero(t, p.slotWait(c[0], &sc), "nor holding one of its slots")
	w.start = w.start.Add(-80 * time.Millisecond) // it waited 80 ms for its input
	w.InputSent()
	w.InputSent() // only the first counts
	assert.Equal(t, int64(0), c[0].deadline.awaiting.Load())
	assert.Equal(t, int64(1), c[0].deadline.pending.Load())
	lead, ok := w.Lead()
	require.True(t, ok)
	assert.InDelta(t, 0.080, lead.Seconds(), 0.005)
	assert.InDelta(t, 0.080, loadFloat(&p.lead), 0.005, "the stage's lead")
	w.Done()
	rt.ObserveFirstOutput(w, lead+20*time.Millisecond)
	c[0].Release()
	assert.InDelta(t, 0.020, loadFloat(&c[0].deadline.unit), 1e-9, "the replica's own 20 ms, not the 100 ms since the attempt's start")

	d := p.Pick(&Request{Deadline: time.Now().Add(50 * time.Millisecond)}, c)
	assert.Equal(t, ReasonDeadline, d.Reason, "its input there, the replica is in time")
	d = p.Pick(&Request{Deadline: time.Now().Add(50 * time.Millisecond), AwaitsInput: true}, c)
	assert.Equal(t, ReasonLoadFallback, d.Reason, "20 ms of its own after 80 ms of wait: late for 50 ms")
	assert.InDelta(t, 0.100, d.Predicted.Seconds(), 0.005)
	d = p.Pick(&Request{Deadline: time.Now().Add(150 * time.Millisecond), AwaitsInput: true}, c)
	assert.Equal(t, ReasonDeadline, d.Reason)

	// A fed stage's first output is its first segment's decode, batched:
	// first outputs pending do not multiply it.
	queued := []*Pending{rt.StartFirstOutput(c[0]), rt.StartFirstOutput(c[0])}
	got, _ := rt.PredictedFirstOutput(c[0])
	assert.InDelta(t, 0.020, got.Seconds(), 1e-9)
	for _, q := range queued {
		q.Done()
	}

	// Ended before its input came (the stage before failed or was late):
	// nothing learned of the replica, nothing held.
	w = rt.AwaitInput(c[0])
	w.Done()
	w.InputSent()
	_, ok = w.Lead()
	assert.False(t, ok)
	rt.ObserveFirstOutput(w, time.Second)
	assert.InDelta(t, 0.020, loadFloat(&c[0].deadline.unit), 1e-9)
	assert.Equal(t, int64(0), c[0].deadline.awaiting.Load())
	assert.Equal(t, int64(0), c[0].deadline.pending.Load())

	// A stage routed otherwise counts nothing; a nil Pending is harmless.
	other := New([]StageRouting{{Policy: LeastLoaded{}}}, nil, nil)
	none := other.AwaitInput(c[0])
	assert.Nil(t, none)
	none.InputSent()
	none.Done()
	other.ObserveFirstOutput(none, time.Second)
}
