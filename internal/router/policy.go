package router

import (
	"fmt"
	"math/rand/v2"
	"sync/atomic"
)

// Policy picks one replica among candidates that are all routable. Pick
// runs concurrently on the request path and must not block.
type Policy interface {
	Pick(stage int, candidates []*Replica) *Replica
}

// PolicyNames lists the valid --policy values.
var PolicyNames = []string{"round_robin", "least_loaded", "power_of_two"}

// NewPolicy returns the policy with the given name.
func NewPolicy(name string, numStages int) (Policy, error) {
	switch name {
	case "round_robin", "":
		return &RoundRobin{next: make([]atomic.Uint64, numStages)}, nil
	case "least_loaded":
		return LeastLoaded{}, nil
	case "power_of_two":
		return PowerOfTwo{}, nil
	}
	return nil, fmt.Errorf("router: unknown policy %q (want one of %v)", name, PolicyNames)
}

// RoundRobin cycles through a stage's routable replicas.
type RoundRobin struct {
	next []atomic.Uint64
}

// Pick implements Policy.
func (p *RoundRobin) Pick(stage int, c []*Replica) *Replica {
	if len(c) == 0 {
		return nil
	}
	if stage < 0 || stage >= len(p.next) {
		return c[0]
	}
	n := p.next[stage].Add(1) - 1
	return c[n%uint64(len(c))]
}

// score is the load a policy compares: what the replica reported plus what
// this head has sent it since, so a burst does not all land on one replica
// between two stats updates.
func score(r *Replica) int64 { return r.Load() + r.InFlight() }

// LeastLoaded takes the replica with the least running+waiting work; ties go
// to the lowest replica id.
type LeastLoaded struct{}

// Pick implements Policy.
func (LeastLoaded) Pick(_ int, c []*Replica) *Replica {
	var best *Replica
	var bestScore int64
	for _, r := range c {
		if s := score(r); best == nil || s < bestScore {
			best, bestScore = r, s
		}
	}
	return best
}

// PowerOfTwo samples two replicas at random and takes the less loaded one.
type PowerOfTwo struct{}

// Pick implements Policy.
func (PowerOfTwo) Pick(_ int, c []*Replica) *Replica {
	switch len(c) {
	case 0:
		return nil
	case 1:
		return c[0]
	}
	i := rand.IntN(len(c))
	j := rand.IntN(len(c) - 1)
	if j >= i {
		j++
	}
	if score(c[j]) < score(c[i]) {
		return c[j]
	}
	return c[i]
}

// Pick chooses a routable replica of stage from the snapshot, skipping the
// keys in exclude (replicas that already failed this request).
func (s *Snapshot) Pick(p Policy, stage int, exclude []*Replica) (*Replica, error) {
	all := s.Stage(stage)
	candidates := make([]*Replica, 0, len(all))
	for _, r := range all {
		if r.Routable() && !contains(exclude, r) {
			candidates = append(candidates, r)
		}
	}
	if rep := p.Pick(stage, candidates); rep != nil {
		return rep, nil
	}
	return nil, s.noReplica(stage)
}

// CheckRoutable returns nil when a stage has a replica that may take new work,
// and otherwise the error Pick would return.
func (s *Snapshot) CheckRoutable(stage int) error {
	for _, r := range s.Stage(stage) {
		if r.Routable() {
			return nil
		}
	}
	return s.noReplica(stage)
}

func (s *Snapshot) noReplica(stage int) error {
	return fmt.Errorf("%w for stage %d (%d attached)", ErrNoReplica, stage, len(s.Stage(stage)))
}

func contains(list []*Replica, r *Replica) bool {
	for _, x := range list {
		if x == r {
			return true
		}
	}
	return false
}
