package router

import (
	"fmt"
	"math/rand/v2"
	"sync/atomic"
)

// Policy picks one replica among candidates that are all routable. A
// policy instance serves one stage. Pick runs concurrently on the request
// path and must not block; candidates is never empty and must not be
// modified.
type Policy interface {
	// Name is the policy's name, as --policy and the pipeline file spell it.
	Name() string
	// Reasons lists the reasons Pick may give.
	Reasons() []Reason
	Pick(req *Request, candidates []*Replica) Decision
}

// Policy names (docs/contracts.md, Routing).
const (
	PolicyRoundRobin  = "round_robin"
	PolicyLeastLoaded = "least_loaded"
	PolicyPowerOfTwo  = "power_of_two"
	PolicyPrefixAware = "prefix_aware"
)

// PolicyNames lists the valid --policy and pipeline `policy:` values.
var PolicyNames = []string{PolicyRoundRobin, PolicyLeastLoaded, PolicyPowerOfTwo, PolicyPrefixAware}

// Where prefix_aware learns what a replica caches (pipeline `prefix_source:`).
const (
	// PrefixSourceAuto uses what the engine reports (KvEvents) where the
	// engine reports its cache and the head has its tokenizer, and the
	// head's own record of what it sent elsewhere.
	PrefixSourceAuto = "auto"
	// PrefixSourceHead always uses the head's own record (approximate).
	PrefixSourceHead = "head"
)

// PrefixSources lists the valid `prefix_source:` values.
var PrefixSources = []string{PrefixSourceAuto, PrefixSourceHead}

// Tokenizer turns a stage's input text into the engine's token ids, so the
// head can name blocks as the engine does (stagepb.BlockHashes).
type Tokenizer func(text string) []uint32

// PolicyOptions configure NewPolicy. The zero value is usable.
type PolicyOptions struct {
	// PrefixSource is PrefixSourceAuto (default, "") or PrefixSourceHead.
	PrefixSource string
	// Tokenizers by engine name (as Health reports it): engines listed here
	// that report KvEvents get the engine-reported mode under auto.
	Tokenizers map[string]Tokenizer
	// IndexCapacity bounds the prefix index in blocks (default
	// DefaultIndexCapacity).
	IndexCapacity int
}

// NewPolicy returns a new instance of the named policy for one stage; ""
// is round_robin.
func NewPolicy(name string, opts PolicyOptions) (Policy, error) {
	if opts.PrefixSource != "" && opts.PrefixSource != PrefixSourceAuto && opts.PrefixSource != PrefixSourceHead {
		return nil, fmt.Errorf("router: unknown prefix source %q (want one of %v)", opts.PrefixSource, PrefixSources)
	}
	switch name {
	case PolicyRoundRobin, "":
		return &RoundRobin{}, nil
	case PolicyLeastLoaded:
		return LeastLoaded{}, nil
	case PolicyPowerOfTwo:
		return PowerOfTwo{}, nil
	case PolicyPrefixAware:
		return NewPrefixAware(opts), nil
	}
	return nil, fmt.Errorf("router: unknown policy %q (want one of %v)", name, PolicyNames)
}

// CheckPolicy reports whether name is a valid policy name ("" included).
func CheckPolicy(name string) error {
	_, err := NewPolicy(name, PolicyOptions{IndexCapacity: 1})
	return err
}

// Reason says why a replica was chosen: the `reason` label of
// troupe_router_decisions_total and the troupe.route.reason span attribute.
type Reason uint8

// The reasons, in label order.
const (
	// ReasonRotation: round robin's turn.
	ReasonRotation Reason = iota
	// ReasonLoad: load decided (least_loaded, power_of_two, or prefix_aware
	// with no cached match anywhere).
	ReasonLoad
	// ReasonPrefixMatch: prefix_aware sent it to the longest cached match.
	ReasonPrefixMatch
	// ReasonAffinity: the session's own replica.
	ReasonAffinity
	// ReasonLoadFallback: the preferred replica (longest match, or the
	// session's) was overloaded relative to the others, so load decided.
	ReasonLoadFallback
	// ReasonPrefixReplicated: prefix_aware found the longest match's replica
	// above its share of the load (a hot prefix), so the request went to
	// another replica that holds, or now gets, a copy of the prefix.
	ReasonPrefixReplicated
)

// Reasons lists every reason in label order (the value is the index).
var Reasons = [...]Reason{ReasonRotation, ReasonLoad, ReasonPrefixMatch, ReasonAffinity, ReasonLoadFallback, ReasonPrefixReplicated}

// String is the reason's label value.
func (r Reason) String() string {
	switch r {
	case ReasonRotation:
		return "rotation"
	case ReasonLoad:
		return "load"
	case ReasonPrefixMatch:
		return "prefix_match"
	case ReasonAffinity:
		return "affinity"
	case ReasonLoadFallback:
		return "load_fallback"
	case ReasonPrefixReplicated:
		return "prefix_replicated"
	}
	return "unknown"
}

// Decision is one pick and why.
type Decision struct {
	Replica *Replica
	Policy  string // the stage's policy name
	Reason  Reason
	// Prefix-aware picks only: how many leading blocks of the input the
	// chosen replica holds, out of how many, and who said so (PrefixEngine
	// or PrefixHead). PrefixSource is "" for other picks.
	MatchBlocks, InputBlocks int
	PrefixSource             string
}

// Values of Decision.PrefixSource (the troupe.route.prefix_source attribute).
const (
	PrefixEngine = "engine" // the engine's KvEvents
	PrefixHead   = "head"   // the head's record of what it sent
)

// Request is what a policy may look at to place one stage attempt. It is
// used by one goroutine at a time and caches the block hashes it computes,
// so a retry does not hash the input again.
type Request struct {
	// Text is the stage's input text as the engine reads it (a chat
	// rendered as the engine renders it); empty when the input is not text.
	Text string
	// Tokens is the stage's input as token ids, when the client sent ids
	// instead of text (Text is then empty).
	Tokens []uint32
	// SessionKey, when not empty, asks for session affinity.
	SessionKey string

	hashes []schemeHashes
}

// RoundRobin cycles through a stage's routable replicas.
type RoundRobin struct {
	next atomic.Uint64
}

// Name implements Policy.
func (*RoundRobin) Name() string { return PolicyRoundRobin }

// Reasons implements Policy.
func (*RoundRobin) Reasons() []Reason { return []Reason{ReasonRotation} }

// Pick implements Policy.
func (p *RoundRobin) Pick(_ *Request, c []*Replica) Decision {
	n := p.next.Add(1) - 1
	return Decision{Replica: c[n%uint64(len(c))], Policy: PolicyRoundRobin, Reason: ReasonRotation}
}

// score is the load a policy compares: what the replica reported plus what
// this head has sent it since, so a burst does not all land on one replica
// between two stats updates.
func score(r *Replica) int64 { return r.Load() + r.InFlight() }

// LeastLoaded takes the replica with the least running+waiting work; ties go
// to the lowest replica id.
type LeastLoaded struct{}

// Name implements Policy.
func (LeastLoaded) Name() string { return PolicyLeastLoaded }

// Reasons implements Policy.
func (LeastLoaded) Reasons() []Reason { return []Reason{ReasonLoad} }

// Pick implements Policy.
func (LeastLoaded) Pick(_ *Request, c []*Replica) Decision {
	return Decision{Replica: leastLoaded(c), Policy: PolicyLeastLoaded, Reason: ReasonLoad}
}

func leastLoaded(c []*Replica) *Replica {
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

// Name implements Policy.
func (PowerOfTwo) Name() string { return PolicyPowerOfTwo }

// Reasons implements Policy.
func (PowerOfTwo) Reasons() []Reason { return []Reason{ReasonLoad} }

// Pick implements Policy.
func (PowerOfTwo) Pick(_ *Request, c []*Replica) Decision {
	d := Decision{Replica: c[0], Policy: PolicyPowerOfTwo, Reason: ReasonLoad}
	if len(c) == 1 {
		return d
	}
	i := rand.IntN(len(c))
	j := rand.IntN(len(c) - 1)
	if j >= i {
		j++
	}
	d.Replica = c[i]
	if score(c[j]) < score(c[i]) {
		d.Replica = c[j]
	}
	return d
}
