package router

import (
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"time"
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
var PolicyNames = []string{PolicyRoundRobin, PolicyLeastLoaded, PolicyPowerOfTwo, PolicyPrefixAware, PolicyDeadline}

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
	// SignalMaxAge is how old a load report may be before it counts as
	// unknown (default DefaultSignalMaxAge).
	SignalMaxAge time.Duration
	// Balance are the balance constants; zero fields take the defaults.
	Balance Balance
	// Deadline configures the deadline policy.
	Deadline DeadlineOptions
}

// Balance are the constants that trade cache hits for balance (pipeline
// `balance:`, docs/routing.md). A zero field means its default.
type Balance struct {
	// prefix_aware leaves a replica for load when its load is at least Abs
	// above the least loaded replica's and more than Rel times it.
	Abs int64
	Rel float64
	// prefix_aware's bound: max(ReplicateFactor × average load, average +
	// ReplicateSlack); above it a replica's prefix is served from a copy
	// when that loses at most ReplicateMaxBlocks blocks of match.
	ReplicateFactor    float64
	ReplicateSlack     int64
	ReplicateMaxBlocks int
	// RootBlocks is how many leading head blocks name a prefix for the
	// rendezvous order.
	RootBlocks int
	// AffinityLoadFactor bounds session affinity: no replica takes a
	// session's request while above this times the average load.
	AffinityLoadFactor float64
}

// WithDefaults fills zero fields with the defaults.
func (b Balance) WithDefaults() Balance {
	if b.Abs == 0 {
		b.Abs = DefaultBalanceAbs
	}
	if b.Rel == 0 {
		b.Rel = DefaultBalanceRel
	}
	if b.ReplicateFactor == 0 {
		b.ReplicateFactor = DefaultReplicateFactor
	}
	if b.ReplicateSlack == 0 {
		b.ReplicateSlack = DefaultReplicateSlack
	}
	if b.ReplicateMaxBlocks == 0 {
		b.ReplicateMaxBlocks = DefaultReplicateMaxBlocks
	}
	if b.RootBlocks == 0 {
		b.RootBlocks = DefaultRootBlocks
	}
	if b.AffinityLoadFactor == 0 {
		b.AffinityLoadFactor = AffinityLoadFactor
	}
	return b
}

// Check reports a constant out of range: negative, or a factor below 1
// (which would refuse every replica).
func (b Balance) Check() error {
	switch {
	case b.Abs < 0, b.ReplicateSlack < 0, b.ReplicateMaxBlocks < 0, b.RootBlocks < 0:
		return fmt.Errorf("router: balance: counts must not be negative: %+v", b)
	case b.Rel != 0 && b.Rel < 1, b.ReplicateFactor != 0 && b.ReplicateFactor < 1, b.AffinityLoadFactor != 0 && b.AffinityLoadFactor < 1:
		return fmt.Errorf("router: balance: factors must be at least 1: %+v", b)
	}
	return nil
}

// NewPolicy returns a new instance of the named policy for one stage; ""
// is round_robin.
func NewPolicy(name string, opts PolicyOptions) (Policy, error) {
	if err := opts.Balance.Check(); err != nil {
		return nil, err
	}
	if opts.PrefixSource != "" && opts.PrefixSource != PrefixSourceAuto && opts.PrefixSource != PrefixSourceHead {
		return nil, fmt.Errorf("router: unknown prefix source %q (want one of %v)", opts.PrefixSource, PrefixSources)
	}
	aff := Affinity{MaxAge: opts.SignalMaxAge, LoadFactor: opts.Balance.AffinityLoadFactor}
	switch name {
	case PolicyRoundRobin, "":
		return &RoundRobin{Affinity: aff}, nil
	case PolicyLeastLoaded:
		return LeastLoaded{MaxAge: opts.SignalMaxAge, Affinity: aff}, nil
	case PolicyPowerOfTwo:
		return PowerOfTwo{MaxAge: opts.SignalMaxAge, Affinity: aff}, nil
	case PolicyPrefixAware:
		return NewPrefixAware(opts), nil
	case PolicyDeadline:
		return &Deadline{MaxAge: opts.SignalMaxAge, Affinity: aff, Options: opts.Deadline}, nil
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
	// ReasonDeadline: the deadline policy found replicas predicted to meet
	// the request's target and took the least loaded of them.
	ReasonDeadline
	// ReasonDeadlineShed: no replica is predicted to meet the target and
	// the stage admits to deadlines: the request is refused (429
	// deadline_unmeetable).
	ReasonDeadlineShed
	// ReasonRTFMigrate: not a pick but the head's decision to move an
	// audio stream whose replica fell behind the real-time target to
	// another replica (orchestrator; docs/routing.md).
	ReasonRTFMigrate
	// ReasonDeadlineMissed: not a pick but the head's decision to stop a
	// request whose first output had not come by its target on a stage
	// that admits to deadlines (503 deadline_missed).
	ReasonDeadlineMissed
)

// Reasons lists every reason in label order (the value is the index).
var Reasons = [...]Reason{ReasonRotation, ReasonLoad, ReasonPrefixMatch, ReasonAffinity, ReasonLoadFallback, ReasonPrefixReplicated, ReasonDeadline, ReasonDeadlineShed, ReasonRTFMigrate, ReasonDeadlineMissed}

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
	case ReasonDeadline:
		return "deadline"
	case ReasonDeadlineShed:
		return "deadline_shed"
	case ReasonRTFMigrate:
		return "rtf_migrate"
	case ReasonDeadlineMissed:
		return "deadline_missed"
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
	// RoutedBlocks: a head-side prefix-aware pick's input blocks, which
	// the head recorded as held by Replica; the head sends them with the
	// request to a worker that publishes them to every head
	// (EngineInfo.RoutedSubscription). Nil otherwise. Not to be modified.
	RoutedBlocks []uint64
	// Deadline picks only: the chosen replica's load score at the pick and
	// its predicted time to first output (0: nothing known).
	Score     int64
	Predicted time.Duration
	// Probe: a deadline pick under admission that sends the request to
	// the replica predicted soonest instead of shedding it (see
	// DeadlineProbeAfter); Router.ReleaseProbe gives the probe back when
	// the attempt taught nothing.
	Probe bool
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
	// Deadline, when not zero, is when the stage's first output is due
	// (the deadline policy); MinRTF, when above 0, is the audio seconds per
	// wall second the stage must keep.
	Deadline time.Time
	MinRTF   float64
	// AwaitsInput: the stage's input does not exist yet when it is routed
	// (a later stage of a streamed pipeline, fed by the stage before): the
	// deadline policy adds the stage's learned wait for it (its lead, with
	// Margin mean deviations in the in-time check) to each replica's own
	// predicted time to first output.
	AwaitsInput bool

	hashes []schemeHashes
	// order is a large stage's rendezvous order during one pick (nil:
	// flat rendezvous); set by Router.Pick around the policy's Pick.
	order *order
}

// RoundRobin cycles through a stage's routable replicas.
type RoundRobin struct {
	// Affinity is session affinity on top of it, when the stage has it.
	Affinity Affinity
	next     atomic.Uint64
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

// DefaultSignalMaxAge is how old an engine's load report may be before a
// policy counts it as unknown (--signal-max-age).
const DefaultSignalMaxAge = 10 * time.Second

// scorer gives the load a policy compares at one pick: what the replica
// reported plus what this head has sent it since, so a burst does not all
// land on one replica between two stats updates. A report older than
// maxAge is unknown (stale): such a replica counts as loaded as the busiest replica
// with a fresh report, plus one, plus what this head has in flight on it,
// so it is never ranked best on the strength of a stale report, yet an
// idle one still gets a request (whose chunks bring a fresh report) when
// every other replica is busier than that.
type scorer struct {
	now      int64 // unix nanoseconds
	maxAge   int64
	maxFresh int64
}

func newScorer(c []*Replica, maxAge time.Duration) scorer {
	if maxAge <= 0 {
		maxAge = DefaultSignalMaxAge
	}
	s := scorer{now: time.Now().UnixNano(), maxAge: int64(maxAge)}
	for _, r := range c {
		if s.fresh(r) {
			s.maxFresh = max(s.maxFresh, r.Load())
		}
	}
	return s
}

// affinityOf is session affinity as configured with a stage's policy.
func affinityOf(p Policy) Affinity {
	switch p := p.(type) {
	case LeastLoaded:
		return p.Affinity
	case PowerOfTwo:
		return p.Affinity
	case *PrefixAware:
		return p.Affinity
	case *RoundRobin:
		return p.Affinity
	case *Deadline:
		return p.Affinity
	}
	return Affinity{}
}

// fresh reports whether r's load report is recent enough to use. A replica
// that never reported (an engine without stats) has no report to age: its
// reported load counts as 0 and this head's in-flight count is all that is
// known, as for every replica of such an engine.
func (s scorer) fresh(r *Replica) bool {
	at := r.loadAt.Load()
	return at == 0 || s.now-at <= s.maxAge
}

func (s scorer) score(r *Replica) int64 {
	if s.fresh(r) {
		return r.Load() + r.InFlight()
	}
	return s.maxFresh + 1 + r.InFlight()
}

// scoreSinceReport is score counting, on top of a fresh report, only this
// head's requests started since that report (at most those still in
// flight): the report already holds the earlier ones, and prefix_aware's
// balance thresholds would see a head that counts them twice as twice as
// imbalanced as several heads sharing the load. A report already old when
// it arrived (a scraped engine's, gauges_age_ms) may miss any of them, so
// it counts all in flight, as score does: better twice than not at all.
func (s scorer) scoreSinceReport(r *Replica) int64 {
	at := r.sentAtLoad.Load()
	if r.loadAt.Load() == 0 || at < 0 || !s.fresh(r) {
		return s.score(r) // no report known to hold this head's requests
	}
	return r.Load() + max(0, min(r.InFlight(), r.sent.Load()-at))
}

// LeastLoaded takes the replica with the least running+waiting work; ties go
// to the lowest replica id. Reports older than MaxAge are unknown (see
// scorer; 0: DefaultSignalMaxAge).
type LeastLoaded struct {
	MaxAge   time.Duration
	Affinity Affinity // session affinity on top of it
}

// Name implements Policy.
func (LeastLoaded) Name() string { return PolicyLeastLoaded }

// Reasons implements Policy.
func (LeastLoaded) Reasons() []Reason { return []Reason{ReasonLoad} }

// Pick implements Policy.
func (p LeastLoaded) Pick(_ *Request, c []*Replica) Decision {
	return Decision{Replica: leastLoaded(c, newScorer(c, p.MaxAge)), Policy: PolicyLeastLoaded, Reason: ReasonLoad}
}

func leastLoaded(c []*Replica, sc scorer) *Replica {
	var best *Replica
	var bestScore int64
	for _, r := range c {
		if s := sc.score(r); best == nil || s < bestScore {
			best, bestScore = r, s
		}
	}
	return best
}

// PowerOfTwo samples two replicas at random and takes the less loaded one.
// Reports older than MaxAge are unknown (see scorer).
type PowerOfTwo struct {
	MaxAge   time.Duration
	Affinity Affinity // session affinity on top of it
}

// Name implements Policy.
func (PowerOfTwo) Name() string { return PolicyPowerOfTwo }

// Reasons implements Policy.
func (PowerOfTwo) Reasons() []Reason { return []Reason{ReasonLoad} }

// Pick implements Policy.
func (p PowerOfTwo) Pick(_ *Request, c []*Replica) Decision {
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
	sc := newScorer(c, p.MaxAge)
	if sc.score(c[j]) < sc.score(c[i]) {
		d.Replica = c[j]
	}
	return d
}
