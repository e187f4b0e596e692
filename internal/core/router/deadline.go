package router

import (
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"
)

// PolicyDeadline routes on predicted time to first output (docs/routing.md,
// Deadline-aware routing).
const PolicyDeadline = "deadline"

// DefaultDeadlineCapacity is how many requests a replica is assumed to run
// at once (its engine's max_num_seqs), when the pipeline's
// `deadline.capacity` does not say.
const DefaultDeadlineCapacity = 8

// deadlineAlpha is the weight of a new observation in the per-replica
// moving averages.
const deadlineAlpha = 0.3

// DeadlineOptions configure the deadline policy (pipeline `deadline:`).
type DeadlineOptions struct {
	// Capacity is how many requests a replica runs at once (its engine's
	// max_num_seqs; 0: the default). A request beyond it waits for a slot,
	// which the prediction adds (see Deadline).
	Capacity int
	// Margin is how many mean deviations the in-time check adds to the
	// prediction (0: DeadlineMargin).
	Margin float64
	// Admission refuses a stage attempt that no replica is predicted to
	// answer in time (Decision.Reason ReasonDeadlineShed) instead of
	// routing it to the least loaded replica.
	Admission bool
	// Model is how the first output is predicted: DeadlineModelQueue ("":
	// the default) or DeadlineModelLoad.
	Model string
}

// Values of DeadlineOptions.Model (pipeline `deadline.model`).
const (
	// DeadlineModelQueue predicts unit × (pending first outputs + 1) plus
	// the wait for a slot (see Deadline): the default.
	DeadlineModelQueue = "queue"
	// DeadlineModelLoad predicts unit × (1 + load/Capacity), load as
	// least_loaded's, unit learned as TTFT over the same factor at the
	// attempt's start: blind to which of the in-flight requests still wait
	// for their first output. Kept for comparison (BenchmarkDeadline).
	DeadlineModelLoad = "load"
)

// CheckDeadlineModel reports whether m is a known DeadlineOptions.Model.
func CheckDeadlineModel(m string) error {
	if m != "" && m != DeadlineModelQueue && m != DeadlineModelLoad {
		return fmt.Errorf("router: unknown deadline model %q (want %s or %s)", m, DeadlineModelQueue, DeadlineModelLoad)
	}
	return nil
}

// deadlineStats are what the head knows of one replica's timing: moving
// averages kept in atomics, written by the attempts that end on it and
// read by picks (float64 bits; 0 means no observation yet), and the count
// of attempts waiting for their first output.
type deadlineStats struct {
	unit atomic.Uint64 // one request's share of a first output: observed TTFT / (requests waiting for theirs at the start, itself included)
	dev  atomic.Uint64 // the mean absolute deviation of unit's observations from it
	hold atomic.Uint64 // seconds an attempt holds one of the replica's slots (its whole duration)
	rtf  atomic.Uint64 // audio seconds made per wall second, after the first output
	// pending counts this head's attempts on the replica whose input has
	// reached it and that have not yet given their first output (nor
	// ended): its queue of first outputs, see Pending.
	pending atomic.Int64
	// awaiting counts this head's attempts on the replica that have
	// started and whose input has not reached it yet (a fed stage's, see
	// Router.AwaitInput): they hold no slot of the engine's yet.
	awaiting atomic.Int64
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
// trusted with a target only with room to spare. One, not more: without
// admission a replica left out falls back to the one predicted soonest,
// whose queue then grows and teaches it late answers (BenchmarkDeadline
// compares margins with TROUPE_DEADLINE_MARGIN).
const DeadlineMargin = 1

// Deadline routes each stage attempt to a replica predicted to give its
// first output before Request.Deadline, and to keep Request.MinRTF: of
// those, the one with the fewest first outputs pending, then the least
// loaded (scorer's load), then the soonest.
//
// The prediction is queue-aware. An engine with chunked prefill (vLLM's,
// the sim's: every step takes the waiting requests' prompt tokens up to a
// token budget, and a step takes its prefill tokens at the engine's
// prefill rate plus one decode latency) gives a new request its first
// output after the prefills ahead of it and its own: so per replica
//
//	predicted = lead + unit × (pending + 1) + slot wait
//
// where pending is how many of this head's attempts on the replica have
// their input there and not yet their first output (Pending), unit is the
// moving average of observed first-output times, counted from when the
// attempt's input reached the replica, divided by (pending then + 1) (one
// request's prefill, plus the step overhead it shares), and slot wait is,
// when the replica already runs Capacity requests or more (this head's in
// flight whose input reached it, or the engine's reported running+waiting
// when larger), (occupancy − Capacity + 1) × hold / Capacity, hold being
// the moving average of how long an attempt holds a slot. lead is, for a
// request whose input does not exist yet (Request.AwaitsInput: a streamed
// later stage), the stage's moving average of how long such attempts
// waited for their first input piece (ObserveLead), else 0: the replica's
// own time is what the replicas differ in, the wait is the stage's. A
// replica not yet observed takes the mean unit of those that were (0 when
// none was: it is tried). The in-time check adds Margin mean deviations
// to unit and to lead. The real-time check compares the replica's
// moving average of audio seconds per wall second with Request.MinRTF; a
// replica not yet observed passes it.
//
// When no replica is predicted in time with the margin, Pick returns the
// one predicted soonest (ties: the least loaded) with ReasonLoadFallback:
// not the least loaded, which on a fleet of unequal replicas is often the
// slow one that least_loaded keeps idle. With Admission the reason is
// ReasonDeadlineShed instead and the caller refuses the request (the head
// answers 429 deadline_unmeetable): admission refuses what is not
// predicted in time with the margin, rather than serve it late. A request
// without targets is routed as least_loaded (ReasonLoad).
//
// Pick is O(replicas) and allocates nothing; the averages are updated
// lock-free by Observe, ObserveHold and ObserveRate.
type Deadline struct {
	MaxAge   time.Duration
	Affinity Affinity
	Options  DeadlineOptions

	// lead and leadDev are the stage's moving averages of how long an
	// attempt routed before its input existed waited for its first input
	// piece (a streamed later stage's: the stages before it), and their
	// mean deviation (float64 bits): see Request.AwaitsInput.
	lead, leadDev atomic.Uint64
	// fed: the stage's attempts are fed by the stage before (AwaitInput
	// was called). Their first output is the decode of their first
	// segment, batched with the others' (a talker's first chunk of codes,
	// a vocoder's first audio), not a queue of prefills: so unit is
	// not divided by, nor the prediction multiplied by, pending + 1.
	fed atomic.Bool
}

// Name implements Policy.
func (*Deadline) Name() string { return PolicyDeadline }

// Reasons implements Policy.
func (p *Deadline) Reasons() []Reason {
	if p.Options.Admission {
		return []Reason{ReasonLoad, ReasonDeadline, ReasonDeadlineShed, ReasonDeadlineMissed, ReasonLoadFallback, ReasonRTFMigrate}
	}
	return []Reason{ReasonLoad, ReasonDeadline, ReasonLoadFallback, ReasonRTFMigrate}
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

func loadFloat(a *atomic.Uint64) float64 { return math.Float64frombits(a.Load()) }

// factor is the load model's factor for a replica whose score is s.
func (p *Deadline) factor(s int64) float64 { return 1 + float64(max(s, 0))/p.capacity() }

// slotWait is the predicted wait for one of r's slots: 0 below Capacity,
// else (occupancy − Capacity + 1) × hold / Capacity, occupancy being this
// head's in flight whose input reached r, or the engine's fresh report
// when larger.
func (p *Deadline) slotWait(r *Replica, sc *scorer) float64 {
	occ := max(r.InFlight()-r.deadline.awaiting.Load(), 0)
	if sc.fresh(r) {
		occ = max(occ, r.Load())
	}
	over := float64(occ) - p.capacity() + 1
	if over <= 0 {
		return 0
	}
	return over * loadFloat(&r.deadline.hold) / p.capacity()
}

// predict is the predicted time to first output on r for a new attempt,
// given the unit to assume when r has none; 0 when nothing is known. bound
// is what the in-time check compares with the target: the prediction with
// Margin mean deviations added to the unit.
func (p *Deadline) predict(r *Replica, sc *scorer, prior float64) (pred, bound float64) {
	u := loadFloat(&r.deadline.unit)
	dev := loadFloat(&r.deadline.dev)
	if u == 0 {
		u = prior
	}
	if p.Options.Model == DeadlineModelLoad {
		f := p.factor(sc.score(r))
		return u * f, (u + p.margin()*dev) * f
	}
	n := 1.0
	if !p.fed.Load() {
		n = float64(max(r.deadline.pending.Load(), 0) + 1)
	}
	w := p.slotWait(r, sc)
	return u*n + w, (u+p.margin()*dev)*n + w
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
	// An attempt whose input does not exist yet starts on the replica
	// only when it comes: what is left of the budget for the replica's own
	// time is less the wait for it.
	var lead, leadBound float64
	if req.AwaitsInput {
		lead = loadFloat(&p.lead)
		leadBound = lead + p.margin()*loadFloat(&p.leadDev)
	}
	var best, least, soonest *Replica
	var bestScore, leastScore, soonestScore, bestQueued int64
	var bestPred, leastPred, soonestPred float64
	for _, r := range c {
		s := sc.score(r)
		pred, bound := p.predict(r, &sc, prior)
		pred, bound = pred+lead, bound+leadBound
		if least == nil || s < leastScore {
			least, leastScore, leastPred = r, s, pred
		}
		if soonest == nil || pred < soonestPred || (pred == soonestPred && s < soonestScore) {
			soonest, soonestScore, soonestPred = r, s, pred
		}
		if bound > budget || !keepsRate(r, req.MinRTF) {
			continue
		}
		q := p.queued(r)
		if best == nil || q < bestQueued || (q == bestQueued && (s < bestScore || (s == bestScore && pred < bestPred))) {
			best, bestScore, bestPred, bestQueued = r, s, pred, q
		}
	}
	d := Decision{Policy: PolicyDeadline, Reason: ReasonDeadline, Replica: best, Score: bestScore, Predicted: seconds(bestPred)}
	switch {
	case req.Deadline.IsZero() && req.MinRTF == 0:
		d = Decision{Policy: PolicyDeadline, Reason: ReasonLoad, Replica: least, Score: leastScore, Predicted: seconds(leastPred)}
	case best == nil:
		d = Decision{Policy: PolicyDeadline, Reason: ReasonLoadFallback, Replica: soonest, Score: soonestScore, Predicted: seconds(soonestPred)}
		if p.Options.Admission {
			d.Probe = probe(soonest, sc.now)
			if !d.Probe {
				d.Reason = ReasonDeadlineShed
			}
		}
	}
	return d
}

// queued is the load that the queue model balances first among replicas
// in time: the first outputs pending on r (0 with the load model, which
// balances by score alone).
func (p *Deadline) queued(r *Replica) int64 {
	if p.Options.Model == DeadlineModelLoad {
		return 0
	}
	return max(r.deadline.pending.Load(), 0)
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// probe reports whether r is due a probe (see DeadlineProbeAfter) and, if
// so, claims it: of concurrent picks one gets it.
func probe(r *Replica, now int64) bool {
	seen := r.deadline.seen.Load()
	return now-seen >= int64(DeadlineProbeAfter) && r.deadline.seen.CompareAndSwap(seen, now)
}

// ReleaseProbe makes r due a probe again (see DeadlineProbeAfter): its
// probe taught nothing, the attempt having ended before its input reached
// r (another stage of a streamed request shed it). A probe at one stage
// is otherwise spent on requests the other stages refuse, and a pipeline
// whose stages all predict late recovers only when their probes happen to
// fall on the same request. Safe for concurrent use.
func (rt *Router) ReleaseProbe(r *Replica) {
	if _, ok := rt.stages[r.Key.Stage].Policy.(*Deadline); ok {
		r.deadline.seen.Store(time.Now().Add(-DeadlineProbeAfter).UnixNano())
	}
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

// Observe records that an attempt on r gave its first output ttft after
// its input reached r (the replica's own time, see Pending); at is its
// place in r's queue then (nil: none ahead). An observation above
// deadlineMaxJump units counts as that many. Safe for concurrent use,
// lock-free but for at's lock.
func (p *Deadline) Observe(r *Replica, at *Pending, ttft time.Duration) {
	r.deadline.seen.Store(time.Now().UnixNano())
	var ahead, score int64
	var slot float64
	if at != nil {
		at.mu.Lock()
		ahead, slot, score = at.ahead, at.slot, at.score
		at.mu.Unlock()
	}
	if p.fed.Load() {
		ahead = 0 // see Deadline.fed
	}
	x := (ttft.Seconds() - slot) / float64(ahead+1)
	if p.Options.Model == DeadlineModelLoad {
		x = ttft.Seconds() / p.factor(score)
	}
	if x <= 0 {
		return
	}
	observeBounded(&r.deadline.unit, &r.deadline.dev, x)
}

// observeBounded moves the moving average in avg and its mean deviation
// in dev toward x, x counting at most deadlineMaxJump times the average.
func observeBounded(avg, dev *atomic.Uint64, x float64) {
	if u := loadFloat(avg); u > 0 {
		x = min(x, deadlineMaxJump*u)
		ewmaZero(dev, math.Abs(x-u))
	}
	ewma(avg, x)
}

// ObserveLead records that an attempt routed before its input existed got
// its first input piece lead after it started. Safe for concurrent use,
// lock-free.
func (p *Deadline) ObserveLead(lead time.Duration) {
	if lead > 0 {
		observeBounded(&p.lead, &p.leadDev, lead.Seconds())
	}
}

// deadlineMaxJump bounds how much one observation counts: at most this
// many times the replica's current unit. A step stalled by a busy host
// (hundreds of ms against tens) would otherwise spoil the unit, and a
// replica predicted late gets no attempts to correct it (no probe without
// admission); a replica that really slowed is learned in a few attempts
// (each may double the unit's pull).
const deadlineMaxJump = 2

// ObserveHold records how long an attempt on r held its slot (start to
// end). Safe for concurrent use, lock-free.
func (p *Deadline) ObserveHold(r *Replica, d time.Duration) { ewma(&r.deadline.hold, d.Seconds()) }

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
	sc := newScorer([]*Replica{r}, p.MaxAge)
	pred, _ := p.predict(r, &sc, 0)
	return seconds(pred), true
}

// Pending is one attempt's place among those of this head waiting for
// their first output on its replica, counted only on a stage whose policy
// is deadline (a nil *Pending counts nothing). An attempt queues on its
// replica from when its input reaches it: at its start (StartFirstOutput),
// or for a fed stage at its first input piece (AwaitInput, then
// InputSent); until then it is counted as awaiting its input, and the
// time it waits is not the replica's (Lead). Done ends it; call Done at
// the attempt's first output and again, harmlessly, when it ends. Safe for
// concurrent use: a fed stage's input sender calls InputSent while its
// receiver may call Done.
type Pending struct {
	r     *Replica
	p     *Deadline
	start time.Time

	awaiting bool // started by AwaitInput

	mu     sync.Mutex
	state  int8      // pendingAwaiting, pendingQueued or pendingDone
	queued time.Time // when the input reached the replica; zero: not yet
	ahead  int64     // attempts waiting on r then
	slot   float64   // the slot wait predicted then, seconds
	score  int64     // the replica's load score then (DeadlineModelLoad)
}

const (
	pendingAwaiting int8 = iota
	pendingQueued
	pendingDone
)

// StartFirstOutput counts an attempt starting on r with its input (a
// request of its own), before it takes its slot (Replica.Acquire), among
// those waiting for their first output. nil when r's stage does not route
// by deadline. Safe for concurrent use.
func (rt *Router) StartFirstOutput(r *Replica) *Pending {
	p, ok := rt.stages[r.Key.Stage].Policy.(*Deadline)
	if !ok {
		return nil
	}
	w := &Pending{r: r, p: p, start: time.Now()}
	w.mu.Lock()
	w.queue(w.start) // its input came with it: no lead
	w.mu.Unlock()
	return w
}

// AwaitInput counts an attempt starting on r whose input does not exist
// yet (a streamed later stage, fed by the stage before): it queues on r
// only from InputSent. nil when r's stage does not route by deadline.
// Safe for concurrent use.
func (rt *Router) AwaitInput(r *Replica) *Pending {
	p, ok := rt.stages[r.Key.Stage].Policy.(*Deadline)
	if !ok {
		return nil
	}
	if !p.fed.Load() {
		p.fed.Store(true)
	}
	r.deadline.awaiting.Add(1)
	return &Pending{r: r, p: p, start: time.Now(), awaiting: true}
}

// InputSent records that the attempt's first input piece reached its
// replica: from now it queues there, and the time it waited for it is the
// stage's lead (Deadline.ObserveLead). Only the first call of an attempt
// started by AwaitInput counts, and none after Done.
func (w *Pending) InputSent() {
	if w == nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.awaiting && w.state == pendingAwaiting {
		w.queue(time.Now())
		w.p.ObserveLead(w.queued.Sub(w.start))
	}
}

// queue moves the attempt into r's queue, its input having reached r at
// now; w.mu held. The slot wait is taken first, while the attempt itself
// does not count in r's occupancy (not yet acquired, or awaiting).
func (w *Pending) queue(now time.Time) {
	r, p := w.r, w.p
	sc := newScorer([]*Replica{r}, p.MaxAge)
	w.slot, w.score = p.slotWait(r, &sc), sc.score(r)
	if w.awaiting {
		r.deadline.awaiting.Add(-1)
	}
	w.state, w.queued = pendingQueued, now
	w.ahead = max(r.deadline.pending.Add(1)-1, 0)
}

// Done takes the attempt out of its replica's counts; only the first call
// counts.
func (w *Pending) Done() {
	if w == nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	switch w.state {
	case pendingAwaiting:
		w.r.deadline.awaiting.Add(-1)
	case pendingQueued:
		w.r.deadline.pending.Add(-1)
	}
	w.state = pendingDone
}

// Lead is how long after its start the attempt's input reached its
// replica; ok is false when it never did. A nil Pending's is 0.
func (w *Pending) Lead() (lead time.Duration, ok bool) {
	if w == nil {
		return 0, true
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.queued.IsZero() {
		return 0, false
	}
	return w.queued.Sub(w.start), true
}

// ObserveFirstOutput hands the time to first output of the attempt counted
// by at, from the attempt's start, to its stage's policy as the replica's
// own time: less the attempt's lead (the wait for its input). An attempt
// whose input never reached its replica teaches nothing of it. Safe for
// concurrent use.
func (rt *Router) ObserveFirstOutput(at *Pending, ttft time.Duration) {
	lead, ok := at.Lead()
	if at == nil || !ok || ttft-lead <= 0 {
		return
	}
	at.p.Observe(at.r, at, ttft-lead)
}

// ObserveHold hands how long an attempt on r held its slot to its stage's
// policy, when that policy learns from it (deadline). Safe for concurrent
// use.
func (rt *Router) ObserveHold(r *Replica, d time.Duration) {
	if p, ok := rt.stages[r.Key.Stage].Policy.(*Deadline); ok && d > 0 {
		p.ObserveHold(r, d)
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
