package router

import (
	"math/rand/v2"
	"slices"
)

// sampler is a policy that picks from a stage's whole replica slice,
// checking only the replicas it reads for eligibility (routable, not
// excluded), instead of from candidates Pick filtered out of every
// replica: O(1) reads a pick rather than O(N). ok is false when it found
// nothing eligible where it looked; Pick then filters and asks the
// policy's Pick. A sampled decision is one the policy's Pick could have
// made from the filtered candidates.
type sampler interface {
	pickSampled(req *Request, all *Replicas, exclude []*Replica) (d Decision, ok bool)
}

// eligible reports whether rep may take this attempt.
func eligible(rep *Replica, exclude []*Replica) bool {
	return rep.Routable() && !slices.Contains(exclude, rep)
}

// pickSampled takes the replica at the rotation's next position of the
// whole stage. When that one is not eligible it filters, as Pick would,
// and takes the same position of the candidates, so each pick advances
// the rotation once, as Pick does.
func (p *RoundRobin) pickSampled(_ *Request, all *Replicas, exclude []*Replica) (Decision, bool) {
	if all.Len() == 0 {
		return Decision{}, false
	}
	n := p.next.Add(1) - 1
	d := Decision{Replica: all.At(int(n % uint64(all.Len()))), Policy: PolicyRoundRobin, Reason: ReasonRotation}
	if eligible(d.Replica, exclude) {
		return d, true
	}
	c := make([]*Replica, 0, all.Len())
	for rep := range all.All() {
		if eligible(rep, exclude) {
			c = append(c, rep)
		}
	}
	if len(c) == 0 {
		return Decision{}, false
	}
	d.Replica = c[n%uint64(len(c))]
	return d, true
}

// powerOfTwoTries is how many pairs pickSampled draws before it leaves
// the pick to the filtered path (a stage where most replicas are out).
const powerOfTwoTries = 4

// pickSampled draws two distinct replicas of the whole stage until both
// are eligible (a uniform pair of the candidates, as Pick draws) and
// takes the less loaded. Their scores need only each other: a stale
// report scores above every fresh one either way (see scorer), so the
// pair's own maximum decides as the stage's does.
func (p PowerOfTwo) pickSampled(_ *Request, all *Replicas, exclude []*Replica) (Decision, bool) {
	if all.Len() < 2 {
		return Decision{}, false
	}
	for range powerOfTwoTries {
		i := rand.IntN(all.Len())
		j := rand.IntN(all.Len() - 1)
		if j >= i {
			j++
		}
		a, b := all.At(i), all.At(j)
		if !eligible(a, exclude) || !eligible(b, exclude) {
			continue
		}
		d := Decision{Replica: a, Policy: PolicyPowerOfTwo, Reason: ReasonLoad}
		pair := [2]*Replica{a, b}
		sc := newScorer(pair[:], p.MaxAge)
		if sc.score(b) < sc.score(a) {
			d.Replica = b
		}
		return d, true
	}
	return Decision{}, false
}
