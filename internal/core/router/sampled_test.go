package router

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestSampledPickSkipsIneligible: the sampled picks of round_robin and
// power_of_two never return a replica that is not routable or that the
// attempt excludes, however few of the stage are left, and fail with the
// usual error when none is.
func TestSampledPickSkipsIneligible(t *testing.T) {
	for _, p := range []Policy{&RoundRobin{}, PowerOfTwo{}} {
		t.Run(p.Name(), func(t *testing.T) {
			r, reps := benchRouter(100, StageRouting{Policy: p}, EngineInfo{})
			reps[17].SetLoad(0) // equally loaded: power_of_two takes either
			reps[63].SetLoad(0)
			for i, rep := range reps {
				if i != 17 && i != 63 {
					rep.healthy.Store(false)
				}
			}
			seen := map[uint32]int{}
			for range 400 {
				d, err := r.Pick(0, &Request{}, nil)
				require.NoError(t, err)
				seen[d.Replica.Key.Replica]++
			}
			assert.Len(t, seen, 2, "only the two routable replicas: %v", seen)
			assert.Positive(t, seen[17])
			assert.Positive(t, seen[63])
			for range 50 {
				d, err := r.Pick(0, &Request{}, []*Replica{reps[17]})
				require.NoError(t, err)
				assert.Equal(t, uint32(63), d.Replica.Key.Replica)
			}
			_, err := r.Pick(0, &Request{}, []*Replica{reps[17], reps[63]})
			assert.ErrorIs(t, err, ErrNoReplica)
		})
	}
}

// TestSampledRoundRobinAdvancesOncePerPick: with one replica out, a
// rotation still gives every routable replica its turn, none twice before
// the others.
func TestSampledRoundRobinAdvancesOncePerPick(t *testing.T) {
	r, reps := benchRouter(5, StageRouting{Policy: &RoundRobin{}}, EngineInfo{})
	reps[2].healthy.Store(false)
	counts := map[uint32]int{}
	for range 400 {
		d, err := r.Pick(0, &Request{}, nil)
		require.NoError(t, err)
		counts[d.Replica.Key.Replica]++
	}
	assert.NotContains(t, counts, reps[2].Key.Replica)
	for id, n := range counts {
		assert.InDelta(t, 100, n, 20, "replica %d", id)
	}
}

// TestSampledPowerOfTwoTakesTheLessLoaded: of two routable replicas, the
// sampled pick takes the less loaded every time.
func TestSampledPowerOfTwoTakesTheLessLoaded(t *testing.T) {
	r, reps := benchRouter(2, StageRouting{Policy: PowerOfTwo{}}, EngineInfo{})
	reps[0].SetLoad(9)
	reps[1].SetLoad(1)
	for range 100 {
		d, err := r.Pick(0, &Request{}, nil)
		require.NoError(t, err)
		assert.Equal(t, reps[1], d.Replica)
	}
}
