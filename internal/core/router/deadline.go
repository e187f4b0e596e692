package router

import (
	"math"
	"sync/atomic"
	"time"
)

// PolicyDeadline routes on predicted time to first output (docs/routing.md,
// Deadline-aware routing).
const PolicyDeadline = "deadline"

// DefaultDeadlineCapacity is how many requests a replica is assumed to run
// at once without slowing each other's first output, when the pipeline's
// `deadline.capacity` does not say.
const DefaultDeadlineCapacity = 8

// deadlineAlpha is the weight of a new observation in the per-replica
// moving averages.
const deadlineAlpha = 0.3

// DeadlineOptions configure the deadline policy (pipeline `deadline:`).
type DeadlineOptions struct {
	// Capacity scales the prediction with load: a replica with score s
	// (engine-reported running+waiting plus this head's in flight) is
	// predicted to answer in unit × (1 + s/Capacity). 0: the default.
	Capacity int
	// Margin is how many mean deviations the in-time check adds to the
	// prediction (0: DeadlineMargin).
	Margin float64
	// Admission refuses a stage attempt that no replica is predicted to
	// answer in time (Decision.Reason ReasonDeadlineShed) instead of
	// routing it to the least loaded replica.
	Admission bool
}

// deadlineStats are what the head learned of one replica's timing: moving
// averages kept in atomics, written by the attempts that end on it and
// read by picks. Both are float64 bits; 0 means no observation yet.
type deadlineStats struct {
	unit atomic.Uint64 // first-output seconds of an attempt, divided by its load factor at the pick
	dev  atomic.Uint64 // the mean absolute deviation of unit's observations from it
	rtf  atomic.Uint64 // audio seconds made per wall second, after the first output
	// seen is when the replica last got an attempt or an observation
	// while shedding (unix nanoseconds): see DeadlineProbeAfter.
	seen atomic.Int64
}

// DeadlineProbeAfter: under admission, a stage whose replicas are all
// predicted late sheds every request, so nothing new is learned and a
// prediction spoiled by a burst would shed forever. When the replica
// predicted soonest has had no attempt for this long, one request goes to
// it instead of being shed (a probe, as a circuit breaker's half-open
// state), and its outcome updates the prediction.
const DeadlineProbeAfter = time.Second

// DeadlineMargin is how many mean deviations the in-time check adds to a
// replica's predicted unit, as TCP's retransmission timer adds four to
// the mean round trip (RFC 6298): a replica whose first outputs vary is
// trusted with a target only with room to spare.
const DeadlineMargin = 2

// Deadline routes each stage attempt to a replica predicted to give its
// first output before Request.Deadline, and to keep Request.MinRTF, the
// least loaded of those (scorer's load). The prediction per replica is
// unit × (1 + score/Capacity), where unit is the moving average of its
// observed time to first output divided by the same load factor at the
// time of each pick (so one formula learns both a slow replica and a busy
// one), and a replica not yet observed takes the mean unit of those that
// were (0 when none was: it is tried). The real-time check compares the
// replica's moving average of audio seconds per wall second with
// Request.MinRTF; a replica not yet observed passes it.
//
// When no replica is predicted in time with the margin, Pick returns the
// one predicted soonest (ties: the least loaded) with ReasonLoadFallback:
// not the least loaded, which on a fleet of unequal replicas is often the
// slow one that least_loaded keeps idle. With Admission the reason is
// ReasonDeadlineShed instead and the caller refuses the request (the head
// answers 429 deadline_unmeetable): admission refuses what is not
// predicted in time with the margin, rather than serve it late. A request without targets is routed as
// least_loaded (ReasonLoad).
//
// Pick is O(replicas) and allocates nothing; the averages are updated
// lock-free by Observe and ObserveRate.
type Deadline struct {
	MaxAge   time.Duration
	Affinity Affinity
	Options  DeadlineOptions
}

// Name implements Policy.
func (*Deadline) Name() string { return PolicyDeadline }

// Reasons implements Policy.
func (p *Deadline) Reasons() []Reason {
	if p.Options.Admission {
		return []Reason{ReasonLoad, ReasonDeadline, ReasonDeadlineShed, ReasonLoadFallback}
	}
	return []Reason{ReasonLoad, ReasonDeadline, ReasonLoadFallback}
}

func (p *Deadline) capacity() float64 {
	if p.Options.Capacity <= 0 {
		return DefaultDeadlineCapacity
	}
	return float64(p.Options.Capacity)
}

func (p *Deadline) margin() float64 {
	if p.Options.Margin <= 0 {
		return DeadlineMargin
	}
	return p.Options.Margin
}

// factor is the load factor of a replica whose score is s.
func (p *Deadline) factor(s int64) float64 { return 1 + float64(max(s, 0))/p.capacity() }

func loadFloat(a *atomic.Uint64) float64 { return math.Float64frombits(a.Load()) }

// predict is the predicted time to first output on r for a new attempt,
// given its load score and the unit to assume when r has none; 0 when
// nothing is known. bound is what the in-time check compares with the
// target: the prediction plus DeadlineMargin mean deviations.
func (p *Deadline) predict(r *Replica, score int64, prior float64) (pred, bound float64) {
	u := loadFloat(&r.deadline.unit)
	dev := loadFloat(&r.deadline.dev)
	if u == 0 {
		u = prior
	}
	f := p.factor(score)
	return u * f, (u + p.margin()*dev) * f
}

// Pick implements Policy.
func (p *Deadline) Pick(req *Request, c []*Replica) Decision {
	sc := newScorer(c, p.MaxAge)
	var sum float64
	var known int
	for _, r := range c {
		if u := loadFloat(&r.deadline.unit); u > 0 {
			sum += u
			known++
		}
	}
	prior := 0.0
	if known > 0 {
		prior = sum / float64(known)
	}
	budget := math.Inf(1)
	if !req.Deadline.IsZero() {
		budget = float64(req.Deadline.UnixNano()-sc.now) / float64(time.Second)
	}
	var best, least, soonest *Replica
	var bestScore, leastScore, soonestScore int64
	var bestPred, leastPred, soonestPred float64
	for _, r := range c {
		s := sc.score(r)
		pred, bound := p.predict(r, s, prior)
		if least == nil || s < leastScore {
			least, leastScore, leastPred = r, s, pred
		}
		if soonest == nil || pred < soonestPred || (pred == soonestPred && s < soonestScore) {
			soonest, soonestScore, soonestPred = r, s, pred
		}
		if bound > budget || !keepsRate(r, req.MinRTF) {
			continue
		}
		if best == nil || s < bestScore || (s == bestScore && pred < bestPred) {
			best, bestScore, bestPred = r, s, pred
		}
	}
	d := Decision{Policy: PolicyDeadline, Reason: ReasonDeadline, Replica: best, Score: bestScore, Predicted: seconds(bestPred)}
	switch {
	case req.Deadline.IsZero() && req.MinRTF == 0:
		d = Decision{Policy: PolicyDeadline, Reason: ReasonLoad, Replica: least, Score: leastScore, Predicted: seconds(leastPred)}
	case best == nil:
		d = Decision{Policy: PolicyDeadline, Reason: ReasonLoadFallback, Replica: soonest, Score: soonestScore, Predicted: seconds(soonestPred)}
		if p.Options.Admission && !probe(soonest, sc.now) {
			d.Reason = ReasonDeadlineShed
		}
	}
	return d
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// probe reports whether r is due a probe (see DeadlineProbeAfter) and, if
// so, claims it: of concurrent picks one gets it.
func probe(r *Replica, now int64) bool {
	seen := r.deadline.seen.Load()
	return now-seen >= int64(DeadlineProbeAfter) && r.deadline.seen.CompareAndSwap(seen, now)
}

// keepsRate reports whether r is known to keep min audio seconds per wall
// second, or not known not to.
func keepsRate(r *Replica, min float64) bool {
	if min <= 0 {
		return true
	}
	rtf := loadFloat(&r.deadline.rtf)
	return rtf == 0 || rtf >= min
}

// Observe records that an attempt routed to r by d gave its first output
// after ttft. Safe for concurrent use, lock-free.
func (p *Deadline) Observe(r *Replica, d Decision, ttft time.Duration) {
	r.deadline.seen.Store(time.Now().UnixNano())
	x := ttft.Seconds() / p.factor(d.Score)
	if u := loadFloat(&r.deadline.unit); u > 0 {
		ewmaZero(&r.deadline.dev, math.Abs(x-u))
	}
	ewma(&r.deadline.unit, x)
}

// ObserveRate records the audio seconds per wall second an attempt on r
// made after its first output. Safe for concurrent use, lock-free.
func (p *Deadline) ObserveRate(r *Replica, rtf float64) {
	if rtf > 0 && !math.IsInf(rtf, 0) {
		ewma(&r.deadline.rtf, rtf)
	}
}

// ewma moves the average in a toward x; the first observation sets it.
func ewma(a *atomic.Uint64, x float64) {
	if x <= 0 || math.IsNaN(x) {
		return
	}
	update(a, x, true)
}

// ewmaZero moves the average in a, which starts at zero, toward x.
func ewmaZero(a *atomic.Uint64, x float64) {
	if !math.IsNaN(x) {
		update(a, x, false)
	}
}

func update(a *atomic.Uint64, x float64, setFirst bool) {
	for {
		old := a.Load()
		o := math.Float64frombits(old)
		v := o + deadlineAlpha*(x-o)
		if old == 0 && setFirst {
			v = x
		}
		if a.CompareAndSwap(old, math.Float64bits(v)) {
			return
		}
	}
}

// PredictedFirstOutput is the deadline policy's current prediction for a
// new attempt on r (for /v1/replicas and tests); ok is false when r's
// stage does not route by deadline.
func (rt *Router) PredictedFirstOutput(r *Replica) (time.Duration, bool) {
	p, ok := rt.stages[r.Key.Stage].Policy.(*Deadline)
	if !ok {
		return 0, false
	}
	pred, _ := p.predict(r, newScorer([]*Replica{r}, p.MaxAge).score(r), 0)
	return seconds(pred), true
}

// ObserveFirstOutput hands an attempt's time to first output to its
// stage's policy, when that policy learns from it (deadline). Safe for
// concurrent use.
func (rt *Router) ObserveFirstOutput(d Decision, ttft time.Duration) {
	if p, ok := rt.stages[d.Replica.Key.Stage].Policy.(*Deadline); ok && ttft > 0 {
		p.Observe(d.Replica, d, ttft)
	}
}

// ObserveRate hands an attempt's audio rate (audio seconds per wall second
// after its first output) to its stage's policy, when that policy learns
// from it. Safe for concurrent use.
func (rt *Router) ObserveRate(r *Replica, rtf float64) {
	if p, ok := rt.stages[r.Key.Stage].Policy.(*Deadline); ok {
		p.ObserveRate(r, rtf)
	}
}

// ObservedRate is the moving average of r's audio seconds per wall second
// that the deadline policy keeps; 0 when none was observed or r's stage
// routes otherwise.
func (rt *Router) ObservedRate(r *Replica) float64 {
	if _, ok := rt.stages[r.Key.Stage].Policy.(*Deadline); !ok {
		return 0
	}
	return loadFloat(&r.deadline.rtf)
}
