package orchestrator

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/troupe-serving/troupe/internal/core/router"
)

// ErrDeadlineUnmeetable: no replica of a stage whose policy is deadline
// and whose `deadline.admission` is on is predicted to meet the request's
// target, so the request is refused before it runs (429
// deadline_unmeetable) instead of being served late.
var ErrDeadlineUnmeetable = errors.New("orchestrator: deadline unmeetable")

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
}

func (d *Deadline) check(where string) error {
	if d == nil {
		return nil
	}
	if d.TTFT < 0 || d.TTFA < 0 || d.RTF < 0 || d.Capacity < 0 || d.Margin < 0 {
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
	if !h.deadlineStage[sr.stage] {
		return
	}
	t := sr.req.Deadline.Or(h.targets[sr.stage])
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

// observeDeadline feeds what an attempt on a deadline stage took to the
// policy, and the prediction's error to troupe_router_deadline_prediction_error_seconds.
func (h *Head) observeDeadline(a *attemptRun) {
	if !h.deadlineStage[a.sr.stage] {
		return
	}
	if ttft := a.fin.TTFT; ttft > 0 {
		if a.d.Predicted > 0 {
			h.predictionError[a.sr.stage].Observe((ttft - a.d.Predicted).Seconds())
		}
		h.router.ObserveFirstOutput(a.pending, ttft)
	}
	h.router.ObserveHold(a.rep, a.fin.E2E)
	if a.out.sampleRate > 0 && a.out.pcmBytes > 0 && !a.last.IsZero() && a.fin.TTFT > 0 {
		first := a.start.Add(a.fin.TTFT)
		if wall := a.last.Sub(first); wall > 0 {
			audio := float64(a.out.pcmBytes/2) / float64(a.out.sampleRate)
			h.router.ObserveRate(a.rep, audio/wall.Seconds())
		}
	}
}

// deadlineMetrics makes troupe_router_deadline_prediction_error_seconds.
func (h *Head) deadlineMetrics(routing []router.StageRouting) prometheus.Collector {
	vec := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "troupe_router_deadline_prediction_error_seconds",
		Help: "Actual minus predicted time to first output of stage attempts routed by the deadline policy, by stage (negative: earlier than predicted).",
		Buckets: []float64{-2, -1, -0.5, -0.25, -0.1, -0.05, -0.025, -0.01, 0,
			0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2},
	}, []string{"stage"})
	h.deadlineStage = make([]bool, len(routing))
	h.targets = make([]Targets, len(routing))
	h.predictionError = make([]prometheus.Observer, len(routing))
	for i, st := range routing {
		h.targets[i] = h.cfg.Pipeline.targets(i)
		if _, ok := st.Policy.(*router.Deadline); ok {
			h.deadlineStage[i] = true
			h.predictionError[i] = vec.WithLabelValues(strconv.Itoa(i))
		}
	}
	return vec
}

// predictionOf is what /v1/replicas shows of the deadline policy's view of
// rep: its predicted first output now and its observed audio rate; nil
// when unknown or when its stage routes otherwise.
func (h *Head) predictionOf(rep *router.Replica) (predicted, rtf *float64) {
	if d, ok := h.router.PredictedFirstOutput(rep); ok && d > 0 {
		v := d.Seconds()
		predicted = &v
	}
	if v := h.router.ObservedRate(rep); v > 0 {
		rtf = &v
	}
	return predicted, rtf
}
