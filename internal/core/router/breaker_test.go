package router

import (
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestBreakerBacksOffExponentially: three failures in a row eject a
// replica for the back-off, doubling per ejection in a row up to the
// maximum; a success closes the breaker and resets the back-off. The last
// routable replica of a stage is never ejected.
func TestBreakerBacksOffExponentially(t *testing.T) {
	addr, _ := serve(t)
	r := NewWithBreaker(stages(t, 1, PolicyRoundRobin), insecureDial, slog.New(slog.DiscardHandler),
		Breaker{Failures: 3, Backoff: time.Hour, MaxBackoff: 3 * time.Hour})
	defer r.Close()
	add := func(id uint32) *Replica {
		rep, err := r.Dial(ReplicaSpec{Key: Key{Stage: 0, Replica: id}, StageName: "s", Addr: addr})
		require.NoError(t, err)
		require.NoError(t, r.Add(rep))
		return rep
	}
	a, b := add(0), add(1)

	for range 2 {
		assert.False(t, r.RecordFailure(a).Ejected)
	}
	e := r.RecordFailure(a)
	require.True(t, e.Ejected)
	assert.Equal(t, time.Hour, e.Backoff)
	assert.True(t, a.Ejected())
	assert.False(t, a.Routable())
	assert.False(t, r.RecordFailure(a).Ejected, "a failure while ejected does not extend it")

	// The last routable replica is spared.
	for range 3 {
		e = r.RecordFailure(b)
	}
	assert.True(t, e.Spared)
	assert.False(t, e.Ejected)
	assert.True(t, b.Routable())
	assert.False(t, r.RecordSuccess(b), "b was never ejected")

	// Half-open: the back-off ran out; the next failure ejects for twice
	// as long, then the maximum caps it.
	for _, want := range []time.Duration{2 * time.Hour, 3 * time.Hour, 3 * time.Hour} {
		a.ejectedUntil.Store(time.Now().Add(-time.Second).UnixNano())
		require.True(t, a.Routable(), "routed again once the back-off ran out")
		e = r.RecordFailure(a)
		require.True(t, e.Ejected)
		assert.Equal(t, want, e.Backoff)
	}
	_, err := r.Pick(0, &Request{}, nil)
	require.NoError(t, err)
	d, _ := r.Pick(0, &Request{}, nil)
	assert.Same(t, b, d.Replica, "an ejected replica is never picked")

	assert.True(t, r.RecordSuccess(a), "a success closes the breaker")
	assert.True(t, a.Routable())
	for range 2 {
		r.RecordFailure(a)
	}
	e = r.RecordFailure(a)
	assert.Equal(t, time.Hour, e.Backoff, "the back-off starts over after a success")
}

// TestBreakerConcurrentFailuresEjectOnce: a replica that fails all its
// in-flight attempts at once is ejected once, for the first back-off.
func TestBreakerConcurrentFailuresEjectOnce(t *testing.T) {
	addr, _ := serve(t)
	r := NewWithBreaker(stages(t, 1, PolicyRoundRobin), insecureDial, slog.New(slog.DiscardHandler),
		Breaker{Failures: 3, Backoff: time.Hour})
	defer r.Close()
	var reps []*Replica
	for id := range uint32(2) {
		rep, err := r.Dial(ReplicaSpec{Key: Key{Stage: 0, Replica: id}, StageName: "s", Addr: addr})
		require.NoError(t, err)
		require.NoError(t, r.Add(rep))
		reps = append(reps, rep)
	}
	results := make(chan Ejection, 64)
	var wg sync.WaitGroup
	for range 64 {
		wg.Add(1)
		go func() { defer wg.Done(); results <- r.RecordFailure(reps[0]) }()
	}
	wg.Wait()
	close(results)
	ejected := 0
	for e := range results {
		if e.Ejected {
			ejected++
			assert.Equal(t, time.Hour, e.Backoff)
		}
	}
	assert.Equal(t, 1, ejected)
	assert.Equal(t, int32(1), reps[0].ejections.Load())
}

// TestBreakerSchedule: the k-th ejection in a row lasts Backoff·2^(k-1),
// capped at MaxBackoff, however long the run of ejections.
func TestBreakerSchedule(t *testing.T) {
	b := Breaker{}.withDefaults()
	for i, want := range []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 16 * time.Second, 30 * time.Second, 30 * time.Second} {
		assert.Equal(t, want, b.ejection(i+1), "ejection %d", i+1)
	}
	assert.Equal(t, 30*time.Second, b.ejection(1_000_000))
	odd := Breaker{Failures: 1, Backoff: 3 * time.Millisecond, MaxBackoff: 10 * time.Millisecond}
	assert.Equal(t, []time.Duration{3 * time.Millisecond, 6 * time.Millisecond, 10 * time.Millisecond}, []time.Duration{odd.ejection(1), odd.ejection(2), odd.ejection(3)})
}
