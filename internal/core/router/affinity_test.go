package router

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const numSessions = 2000

// placement maps every session to its replica id among c, at zero load.
func placement(c []*Replica) map[string]uint32 {
	out := make(map[string]uint32, numSessions)
	for i := range numSessions {
		s := fmt.Sprint("session-", i)
		r, first := Affinity{}.Pick(s, c)
		if !first {
			panic("no replica is loaded: every session gets its first choice")
		}
		out[s] = r.Key.Replica
	}
	return out
}

func TestAffinityIsStableAndSpreadsEvenly(t *testing.T) {
	c := replicas(4)
	before := placement(c)
	assert.Equal(t, before, placement(c), "a pure function of the keys")
	perReplica := map[uint32]int{}
	for _, id := range before {
		perReplica[id]++
	}
	for id, n := range perReplica {
		assert.InDelta(t, numSessions/4, n, numSessions/4*0.2, "replica %d's share", id)
	}

	// The order of the candidates does not matter.
	reversed := []*Replica{c[3], c[2], c[1], c[0]}
	assert.Equal(t, before, placement(reversed))
}

func TestAffinityJoinMovesOnlyAFairShare(t *testing.T) {
	c := replicas(4)
	before := placement(c)
	joined := append(replicas(4), &Replica{Key: key(7)})
	after := placement(joined)
	moved := 0
	for s, id := range before {
		if after[s] != id {
			moved++
			assert.Equal(t, uint32(7), after[s], "a session only ever moves to the replica that joined")
		}
	}
	assert.InDelta(t, numSessions/5, moved, numSessions/5*0.25, "about 1/5 of the sessions move to the 5th replica")

	// A replica leaving gives up its own sessions and nothing else.
	left := []*Replica{c[0], c[1], c[3]}
	after = placement(left)
	for s, id := range before {
		if id != 2 {
			assert.Equal(t, id, after[s], "session %s was not on the replica that left", s)
		}
	}
}

func TestAffinityUnrelatedJoinsMoveNothing(t *testing.T) {
	addr, _ := serve(t)
	r := New([]StageRouting{{SessionAffinity: true}, {SessionAffinity: true}}, insecureDial, nil)
	defer r.Close()
	for id := range uint32(3) {
		addReplica(t, r, 0, id, addr)
	}
	place := func() map[string]uint32 {
		out := map[string]uint32{}
		for i := range 300 {
			s := fmt.Sprint("user-", i)
			d, err := r.Pick(0, &Request{SessionKey: s}, nil)
			require.NoError(t, err)
			require.Equal(t, ReasonAffinity, d.Reason)
			require.Equal(t, "round_robin", d.Policy, "the stage's policy names the decision")
			out[s] = d.Replica.Key.Replica
		}
		return out
	}
	before := place()
	// Joins and leaves on another stage, and the same replica rejoining
	// (a new process under the same id), change nothing on this stage.
	for id := range uint32(4) {
		addReplica(t, r, 1, id, addr)
	}
	r.Remove(Key{Stage: 1, Replica: 2})
	addReplica(t, r, 0, 1, addr)
	assert.Equal(t, before, place())
}

func TestAffinityBoundsLoad(t *testing.T) {
	c := replicas(4)
	session := "heavy-user"
	ranked := Rank(session, c)
	home := ranked[0]
	r, first := Affinity{}.Pick(session, c)
	require.True(t, first)
	require.Same(t, home, r)

	// The home replica is above 1.25x the average (with the new request):
	// the session's next replica in rank order takes it.
	home.SetLoad(6)
	r, first = Affinity{}.Pick(session, c)
	assert.False(t, first)
	assert.Same(t, ranked[1], r)

	// Within the bound it stays home: the others hold 3 each, so the
	// average with the new request is (2+9+1)/4 = 3 and the bound
	// ceil(1.25*3) = 4 leaves room for home's third.
	home.SetLoad(2)
	for _, x := range ranked[1:] {
		x.SetLoad(3)
	}
	r, first = Affinity{}.Pick(session, c)
	assert.True(t, first)
	assert.Same(t, home, r)
}

func TestRouterAffinityReasons(t *testing.T) {
	addr, _ := serve(t)
	p, err := NewPolicy(PolicyPowerOfTwo, PolicyOptions{})
	require.NoError(t, err)
	r := New([]StageRouting{{Policy: p, SessionAffinity: true}}, insecureDial, nil)
	defer r.Close()
	for id := range uint32(3) {
		addReplica(t, r, 0, id, addr)
	}
	d, err := r.Pick(0, &Request{SessionKey: "abc"}, nil)
	require.NoError(t, err)
	assert.Equal(t, ReasonAffinity, d.Reason)
	assert.Equal(t, PolicyPowerOfTwo, d.Policy)
	home := d.Replica
	home.SetLoad(50)
	d, err = r.Pick(0, &Request{SessionKey: "abc"}, nil)
	require.NoError(t, err)
	assert.Equal(t, ReasonLoadFallback, d.Reason)
	assert.NotSame(t, home, d.Replica)
	d, err = r.Pick(0, &Request{}, nil)
	require.NoError(t, err)
	assert.Equal(t, ReasonLoad, d.Reason, "without a session key the policy decides")

	// A stage without affinity ignores session keys.
	r2 := New([]StageRouting{{Policy: p}}, insecureDial, nil)
	defer r2.Close()
	addReplica(t, r2, 0, 0, addr)
	d, err = r2.Pick(0, &Request{SessionKey: "abc"}, nil)
	require.NoError(t, err)
	assert.Equal(t, ReasonLoad, d.Reason)
}
