package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// ErrDeadlineUnmeetable: no replica of a stage whose policy is deadline
// and whose `deadline.admission` is on is predicted to meet the request's
// target, so the request is refused before it runs (429
// deadline_unmeetable) instead of being served late.
var ErrDeadlineUnmeetable = errors.New("orchestrator: deadline unmeetable")

// ErrDeadlineMissed: on a stage whose `deadline.admission` is on, the
// request's first output (stage 0's first text against its TTFT, the last
// stage's first audio against its TTFA) had not come by its target, so
// the head stopped the request at the target and cancelled its stage
// attempts (503 deadline_missed) instead of serving it late.
var ErrDeadlineMissed = errors.New("orchestrator: deadline missed")

// errFirstOutputDue is the cause with which a gated attempt is cancelled
// at its stage's target (firstGate).
var errFirstOutputDue = errors.New("orchestrator: first output due")

// errBehindRealTime ends an attempt whose audio fell behind the request's
// real-time target so the stage moves to another replica (behind).
var errBehindRealTime = errors.New("orchestrator: audio behind real time")

// DefaultRTFWindow is the wall time after an attempt's first audio over
// which its audio rate is judged before it may be moved (Deadline.RTFWindow):
// one slow step does not move a stream.
const DefaultRTFWindow = time.Second

// maxRTFMoves is how many times one stage of a request may be moved for
// falling behind real time.
const maxRTFMoves = 1

// Targets are a request's service objectives (pipeline `deadline:`, or the
// X-Troupe-Deadline header): the time to the first text (TTFT), to the
// first audio (TTFA), and the audio seconds made per wall second (RTF). A
// zero field sets nothing.
type Targets struct {
	TTFT time.Duration `yaml:"ttft,omitempty"`
	TTFA time.Duration `yaml:"ttfa,omitempty"`
	RTF  float64       `yaml:"rtf,omitempty"`
}

// Or is t with its zero fields taken from d.
func (t Targets) Or(d Targets) Targets {
	if t.TTFT == 0 {
		t.TTFT = d.TTFT
	}
	if t.TTFA == 0 {
		t.TTFA = d.TTFA
	}
	if t.RTF == 0 {
		t.RTF = d.RTF
	}
	return t
}

// ParseTargets reads "ttft=500ms,ttfa=800ms,rtf=1" (the X-Troupe-Deadline
// header): comma-separated key=value, durations in Go's syntax, rtf a
// positive number; every key at most once.
func ParseTargets(s string) (Targets, error) {
	var t Targets
	seen := map[string]bool{}
	for part := range strings.SplitSeq(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		key, val, ok := strings.Cut(part, "=")
		key, val = strings.TrimSpace(key), strings.TrimSpace(val)
		if !ok {
			return Targets{}, fmt.Errorf("orchestrator: deadline %q is not key=value", part)
		}
		if seen[key] {
			return Targets{}, fmt.Errorf("orchestrator: deadline key %q given twice", key)
		}
		seen[key] = true
		switch key {
		case "ttft", "ttfa":
			d, err := time.ParseDuration(val)
			if err != nil || d <= 0 {
				return Targets{}, fmt.Errorf("orchestrator: deadline %s=%q is not a positive duration (e.g. 500ms)", key, val)
			}
			if key == "ttft" {
				t.TTFT = d
			} else {
				t.TTFA = d
			}
		case "rtf":
			f, err := strconv.ParseFloat(val, 64)
			if err != nil || !(f > 0) || f > 1000 {
				return Targets{}, fmt.Errorf("orchestrator: deadline rtf=%q is not a positive number", val)
			}
			t.RTF = f
		default:
			return Targets{}, fmt.Errorf("orchestrator: unknown deadline key %q (known: ttft, ttfa, rtf)", key)
		}
	}
	if t == (Targets{}) {
		return Targets{}, errors.New("orchestrator: deadline names no target (known: ttft, ttfa, rtf)")
	}
	return t, nil
}

// Deadline is a stage's (or the pipeline's) `deadline:` block: targets,
// and for stages whose policy is deadline, how it predicts and admits.
type Deadline struct {
	Targets `yaml:",inline"`
	// Capacity: router.DeadlineOptions.Capacity (0: the default).
	Capacity int `yaml:"capacity,omitempty"`
	// Margin: router.DeadlineOptions.Margin (0: the default, 1).
	Margin float64 `yaml:"margin,omitempty"`
	// Admission refuses, with 429 deadline_unmeetable, a request that no
	// replica of the stage is predicted to serve in time.
	Admission bool `yaml:"admission,omitempty"`
	// Model: router.DeadlineOptions.Model, queue (the default) or load.
	Model string `yaml:"model,omitempty"`
	// RTFWindow is how long after an attempt's first audio its audio rate
	// is judged against the rtf target before the stream may be moved to
	// another replica (0: DefaultRTFWindow).
	RTFWindow time.Duration `yaml:"rtf_window,omitempty"`
}

// policyOnly reports whether d sets what applies to policy deadline only.
func (d *Deadline) policyOnly() bool {
	return d != nil && (d.Admission || d.Capacity != 0 || d.Margin != 0 || d.Model != "" || d.RTFWindow != 0)
}

func (d *Deadline) check(where string) error {
	if d == nil {
		return nil
	}
	if d.TTFT < 0 || d.TTFA < 0 || d.RTF < 0 || d.Capacity < 0 || d.Margin < 0 || d.RTFWindow < 0 {
		return fmt.Errorf("orchestrator: pipeline: %s: deadline values must not be negative: %+v", where, *d)
	}
	if err := router.CheckDeadlineModel(d.Model); err != nil {
		return fmt.Errorf("orchestrator: pipeline: %s: %w", where, err)
	}
	return nil
}

// targets is the stage's targets: its own, else the pipeline's.
func (p Pipeline) targets(stage int) Targets {
	var t Targets
	if d := p.Stages[stage].Deadline; d != nil {
		t = d.Targets
	}
	if p.Deadline != nil {
		t = t.Or(p.Deadline.Targets)
	}
	return t
}

// deadlineOptions are the deadline policy's options for a stage.
func (s Stage) deadlineOptions() router.DeadlineOptions {
	if s.Deadline == nil {
		return router.DeadlineOptions{}
	}
	return router.DeadlineOptions{Capacity: s.Deadline.Capacity, Margin: s.Deadline.Margin, Admission: s.Deadline.Admission, Model: s.Deadline.Model}
}

// setDeadline sets what a deadline stage is routed on: when its first
// output is due and the audio rate it must keep. Stage 0's first output is
// text and is due TTFT after the request came; a later stage's makes the
// audio, due TTFA after it. Targets of the request come before the
// pipeline's.
func (h *Head) setDeadline(sr *stageRun) {
	if !h.deadline.on[sr.stage] {
		return
	}
	t := sr.req.Deadline.Or(h.deadline.targets[sr.stage])
	due := t.TTFA
	if sr.stage == 0 {
		due = t.TTFT
	}
	if due > 0 && !sr.req.Received.IsZero() {
		sr.route.Deadline = sr.req.Received.Add(due)
	}
	if sr.stage > 0 {
		sr.route.MinRTF = t.RTF
	}
	if sr.gate == nil && h.deadline.admits[sr.stage] && !sr.route.Deadline.IsZero() && (sr.stage == 0 || sr.stage == sr.n-1) {
		sr.gate = &firstGate{due: sr.route.Deadline, target: due}
	}
}

// firstGate decides once whether a stage's first output came by its
// target (stage 0's first text, the last stage's first audio), on a stage
// that admits to deadlines: the first output claims it before it is
// forwarded, a timer at the target claims it for a miss, and whichever
// comes first wins. So nothing past the target is forwarded as a first
// output. Safe for concurrent use.
type firstGate struct {
	due    time.Time
	target time.Duration // due, from the request's arrival
	state  atomic.Int32  // gatePending, gateServed or gateMissed
}

const (
	gatePending int32 = iota
	gateServed
	gateMissed
)

// serve claims the gate for a first output made now; false when the
// target has passed (the gate is then missed).
func (g *firstGate) serve() bool {
	if g == nil {
		return true
	}
	if time.Now().After(g.due) {
		g.state.CompareAndSwap(gatePending, gateMissed)
	} else {
		g.state.CompareAndSwap(gatePending, gateServed)
	}
	return g.state.Load() == gateServed
}

// arm starts the attempt's timer at the gate's target, which cancels the
// attempt with errFirstOutputDue unless its first output came; the
// returned func stops it.
func (g *firstGate) arm(cancel context.CancelCauseFunc) (stop func()) {
	if g == nil || g.state.Load() != gatePending {
		return func() {}
	}
	t := time.AfterFunc(time.Until(g.due), func() {
		if g.state.CompareAndSwap(gatePending, gateMissed) {
			cancel(errFirstOutputDue)
		}
	})
	return func() { t.Stop() }
}

// missed ends attempt a, whose stage's first output missed its target:
// counted as reason deadline_missed, never the replica's fault.
func (h *Head) missed(a *attemptRun) error {
	a.fin.Reason = stagepb.FinishReason_FINISH_REASON_ABORT
	a.fault, a.stopped = false, true
	h.countDecision(a.sr.stage, router.Decision{Policy: router.PolicyDeadline, Reason: router.ReasonDeadlineMissed})
	what := "first output"
	if a.sr.stage > 0 {
		what = "first audio"
	}
	if a.recording {
		a.span.AddEvent("deadline_missed")
	}
	return newError(ErrDeadlineMissed, nil, "stage %q gave no %s within the target (%s): the request was stopped at the target instead of being served late; retry later or with a longer target",
		a.name, what, a.sr.gate.target)
}

// behind reports whether attempt a's audio fell behind the request's
// real-time target so that the stage should move to another replica: on a
// deadline stage with an rtf target, once RTFWindow of wall time has
// passed since the attempt's first audio, the audio it made per wall
// second in that time (less the time its input sender waited for input
// the stage before had not made) is below the target, the stage has not
// been moved for this before, and another routable replica of the stage
// is predicted to keep the target (its observed rate, or none yet). It
// then feeds the rate to the policy, counts reason rtf_migrate and marks
// the span.
func (h *Head) behind(a *attemptRun) bool {
	st, min := a.sr.stage, a.sr.route.MinRTF
	if !h.deadline.on[st] || min <= 0 || a.out.sampleRate <= 0 || a.out.pcmBytes == 0 || a.fin.TTFT <= 0 || a.tr.rtfMoves >= maxRTFMoves {
		return false
	}
	wall := time.Since(a.start.Add(a.fin.TTFT)) - a.inputWaitSinceFirst()
	if wall < h.deadline.rtfWindow[st] {
		return false
	}
	rate := float64(a.out.pcmBytes/2) / float64(a.out.sampleRate) / wall.Seconds()
	if rate >= min {
		return false
	}
	if !anyReplica(h.router.Snapshot().Stage(st), func(r *router.Replica) bool {
		v := h.router.ObservedRate(r)
		return r != a.rep && (v == 0 || v >= min)
	}) {
		return false
	}
	a.call.ObserveRate(rate)
	h.countDecision(st, router.Decision{Policy: router.PolicyDeadline, Reason: router.ReasonRTFMigrate})
	a.span.AddEvent("rtf_migrate", trace.WithAttributes(attribute.Float64("troupe.rtf", rate), attribute.Float64("troupe.rtf.target", min)))
	h.log.Info("orchestrator: audio fell behind real time; moving the stream to another replica",
		"stage", a.name, "replica", a.rep.Key.Replica, "rtf", rate, "target", min, "delivered_pcm_bytes", a.tr.delivered.pcm)
	a.fin.Reason = stagepb.FinishReason_FINISH_REASON_ABORT
	a.tr.rtfMoves++
	return true
}

// inputWait counts the time a fed stage's input sender waited for input
// the stage before had not made yet: done (nanoseconds) and, while it
// waits, since when. One sender writes, the attempt's receiver reads.
type inputWait struct {
	done  atomic.Int64
	since atomic.Int64 // unix nanoseconds; 0 when not waiting
	first int64        // done at the attempt's first output (receiver's)
}

// start and end bracket one wait.
func (w *inputWait) start() { w.since.Store(time.Now().UnixNano()) }
func (w *inputWait) end() {
	if s := w.since.Swap(0); s != 0 {
		w.done.Add(time.Now().UnixNano() - s)
	}
}

// total is the time waited so far, the wait under way included.
func (w *inputWait) total() time.Duration {
	t := w.done.Load()
	if s := w.since.Load(); s != 0 {
		t += max(time.Now().UnixNano()-s, 0)
	}
	return time.Duration(t)
}

// inputWaitSinceFirst is how long the attempt's sender has waited for
// input since the attempt's first output.
func (a *attemptRun) inputWaitSinceFirst() time.Duration {
	return a.wait.total() - time.Duration(a.wait.first)
}

// shed answers a stage attempt the deadline policy found unmeetable.
func (h *Head) shed(sr *stageRun, d router.Decision) error {
	what := "first output"
	if sr.stage > 0 {
		what = "first audio"
	}
	left := time.Until(sr.route.Deadline)
	return newError(ErrDeadlineUnmeetable, nil, "no replica of stage %q is predicted to give the %s in time (best predicted %s, %s left of the target); retry later or with a longer target",
		h.cfg.Pipeline.Stages[sr.stage].Name, what, d.Predicted.Round(time.Millisecond), max(left, 0).Round(time.Millisecond))
}

// outcome is how the attempt ended, for its call's Done. On a deadline
// stage it also carries what the policy learns of the replica: its first
// output (from when the input reached it, router.Pending, so a later
// stage that waited for the stage before is not judged slow for it, to
// when its first output reached the head), and observes the prediction's
// error in troupe_router_deadline_prediction_error_seconds.
func (h *Head) outcome(a *attemptRun, err error) router.Outcome {
	o := router.Outcome{Err: err, Fault: a.fault, Draining: a.refused, Elapsed: a.fin.E2E}
	if !h.deadline.on[a.sr.stage] {
		return o
	}
	if !a.arrived.IsZero() {
		o.FirstOutput = a.arrived.Sub(a.start)
		if a.d.Predicted > 0 {
			h.deadline.predictionError[a.sr.stage].Observe((o.FirstOutput - a.d.Predicted).Seconds())
		}
	} else if due := a.sr.route.Deadline; a.stopped || (!due.IsZero() && !time.Now().Before(due)) {
		// Stopped at its target (the gate), or cancelled with its request
		// when the last stage's gate stopped it: learned as if its first
		// output came now, or a replica slower than every target would
		// never be learned and would keep the share of an unobserved one.
		o.PastTarget = true
	}
	if a.out.sampleRate > 0 && a.out.pcmBytes > 0 && !a.last.IsZero() && a.fin.TTFT > 0 {
		first := a.start.Add(a.fin.TTFT)
		if wall := a.last.Sub(first); wall > 0 {
			o.AudioRate = float64(a.out.pcmBytes/2) / float64(a.out.sampleRate) / wall.Seconds()
		}
	}
	return o
}

// deadlineMetrics makes troupe_router_deadline_prediction_error_seconds.
func (h *Head) deadlineMetrics(routing []router.StageRouting) prometheus.Collector {
	vec := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "troupe_router_deadline_prediction_error_seconds",
		Help: "Actual minus predicted time to first output of stage attempts routed by the deadline policy, by stage (negative: earlier than predicted).",
		Buckets: []float64{-2, -1, -0.5, -0.25, -0.1, -0.05, -0.025, -0.01, 0,
			0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2},
	}, []string{"stage"})
	h.deadline.on = make([]bool, len(routing))
	h.deadline.admits = make([]bool, len(routing))
	h.deadline.rtfWindow = make([]time.Duration, len(routing))
	h.deadline.targets = make([]Targets, len(routing))
	h.deadline.predictionError = make([]prometheus.Observer, len(routing))
	for i, st := range routing {
		h.deadline.targets[i] = h.cfg.Pipeline.targets(i)
		if dp, ok := st.Policy.(*router.Deadline); ok {
			h.deadline.on[i] = true
			h.deadline.admits[i] = dp.Options.Admission
			h.deadline.rtfWindow[i] = DefaultRTFWindow
			if d := h.cfg.Pipeline.Stages[i].Deadline; d != nil && d.RTFWindow > 0 {
				h.deadline.rtfWindow[i] = d.RTFWindow
			}
			h.deadline.predictionError[i] = vec.WithLabelValues(strconv.Itoa(i))
		}
	}
	return vec
}

// predictionOf is what /v1/replicas shows of the deadline policy's view of
// rep: its predicted first output now and its observed audio rate; nil
// when unknown or when its stage routes otherwise.
func (f *fleet) predictionOf(rep *router.Replica) (predicted, rtf *float64) {
	if d, ok := f.router.PredictedFirstOutput(rep); ok && d > 0 {
		v := d.Seconds()
		predicted = &v
	}
	if v := f.router.ObservedRate(rep); v > 0 {
		rtf = &v
	}
	return predicted, rtf
}
