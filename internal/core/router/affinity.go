package router

import (
	"hash/fnv"
	"math"
	"slices"
	"time"
)

// AffinityLoadFactor is c of consistent hashing with bounded loads: no
// replica takes a session's request while its load is above c times the
// stage's average (counting the new request).
const AffinityLoadFactor = 1.25

// Affinity places sessions by rendezvous (highest random weight) hashing
// with bounded loads (Mirrokni, Thorup, Zadimoghaddam, 2018). Every replica
// gets a weight from the session key and its own key; the session's replica
// is the heaviest that is not above the load bound, so a session stays put
// while its replica is routable and not overloaded, a replica that joins
// takes only the sessions that now weigh most on it (a fair share), and a
// replica that leaves gives up only its own. Weights depend on nothing but
// the two keys: every head agrees, and a restart changes nothing.
// Affinity is stateless and safe for concurrent use. Load reports older
// than MaxAge are unknown (see scorer; 0: DefaultSignalMaxAge).
type Affinity struct {
	MaxAge     time.Duration
	LoadFactor float64 // 0: AffinityLoadFactor
}

// Pick returns the session's replica among candidates (not empty), and
// whether it is the session's first choice (false: the first choice was
// over the load bound).
func (a Affinity) Pick(session string, c []*Replica) (*Replica, bool) {
	return a.pick(session, c, nil)
}

// pick is Pick with the rendezvous weights of ord (nil: flat).
func (a Affinity) pick(session string, c []*Replica, ord *order) (*Replica, bool) {
	return a.pickKey(sessionHash(session), c, ord)
}

// pickKey is pick for the session's hash sk.
func (a Affinity) pickKey(sk uint64, c []*Replica, ord *order) (*Replica, bool) {
	sc := newScorer(c, a.MaxAge)
	var total int64
	for _, r := range c {
		total += sc.score(r)
	}
	factor := a.LoadFactor
	if factor == 0 {
		factor = AffinityLoadFactor
	}
	bound := int64(math.Ceil(factor * float64(total+1) / float64(len(c))))
	// The heaviest replica within the bound is the first of Rank's order
	// within it: no sort (distinct keys have distinct weights).
	// It is the first choice unless one above the bound weighs more (or
	// as much and comes first): each candidate is weighed in one of the
	// two passes only.
	keyOf := func(i int) Key { return c[i].Key }
	within := func(i int) bool { return sc.score(c[i])+1 <= bound }
	chosen := ord.argmax(sk, len(c), keyOf, within)
	over := ord.argmax(sk, len(c), keyOf, func(i int) bool { return !within(i) })
	if chosen < 0 {
		return c[over], true // unreachable: the least loaded is never above the average
	}
	if over < 0 {
		return c[chosen], true
	}
	wc, wo := ord.weight(sk, c[chosen].Key), ord.weight(sk, c[over].Key)
	return c[chosen], wc > wo || wc == wo && chosen < over
}

func sessionHash(session string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(session))
	return h.Sum64()
}

// Rank orders candidates by their weight for session, heaviest first.
func Rank(session string, c []*Replica) []*Replica {
	sk := sessionHash(session)
	type weighted struct {
		r *Replica
		w uint64
	}
	ws := make([]weighted, len(c))
	for i, r := range c {
		ws[i] = weighted{r, weight(sk, r.Key)}
	}
	slices.SortFunc(ws, func(a, b weighted) int {
		switch {
		case a.w > b.w:
			return -1
		case a.w < b.w:
			return 1
		}
		return 0
	})
	out := make([]*Replica, len(c))
	for i, w := range ws {
		out[i] = w.r
	}
	return out
}

// weight is the rendezvous weight of a replica for a session.
func weight(session uint64, k Key) uint64 {
	return mix64(session ^ mix64(keyHash(k)))
}

// mix64 is the splitmix64 finalizer.
func mix64(z uint64) uint64 {
	z += 0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}
