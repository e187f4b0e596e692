package stats

import (
	"fmt"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Outcomes of a pipeline request (troupe_pipeline_requests_total{outcome}).
const (
	OutcomeSuccess    = "success"     // answered in full
	OutcomeAbort      = "abort"       // the client left or its deadline passed
	OutcomeNoReplica  = "no_replica"  // a needed stage had no routable replica
	OutcomeBadRequest = "bad_request" // a replica refused the input
	OutcomeError      = "error"       // a stage failed and could not be completed
)

var outcomes = []string{OutcomeSuccess, OutcomeAbort, OutcomeNoReplica, OutcomeBadRequest, OutcomeError}

// Pipeline holds the head's pipeline-level families, the counterparts of
// vLLM-Omni's e2e_request_latency_s, audio_ttfp_s, audio_rtf and transfer_*.
// Every child exists from NewPipeline on (at 0), as the per-replica series do
// from a replica's join. A nil *Pipeline records nothing
// (--log-stats=false). Its methods are safe for concurrent use.
type Pipeline struct {
	e2e, ttfa, rtf, duration prometheus.Observer
	handoff                  []prometheus.Observer // by upstream stage index
	outcome                  map[string]prometheus.Counter
}

// NewPipeline registers the pipeline families for a pipeline of numStages
// stages on reg.
func NewPipeline(reg prometheus.Registerer, model string, numStages int) (*Pipeline, error) {
	lat := []float64{0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 20, 40, 80}
	e2e := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: namespace, Name: "pipeline_e2e_request_latency_seconds",
		Help:    "Time from a request's arrival at the head to its last output, over every stage it ran.",
		Buckets: lat,
	}, []string{labelModel})
	ttfa := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: namespace, Name: "time_to_first_audio_seconds",
		Help:    "Time from a request's arrival at the head to its first audio samples.",
		Buckets: lat,
	}, []string{labelModel})
	rtf := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: namespace, Name: "audio_real_time_factor",
		Help:    "Time to make a request's audio over the audio's duration; below 1 is faster than real time.",
		Buckets: []float64{0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 5, 10},
	}, []string{labelModel})
	duration := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: namespace, Name: "audio_duration_seconds",
		Help:    "Duration of the audio a request produced.",
		Buckets: []float64{0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160},
	}, []string{labelModel})
	handoff := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: namespace, Name: "stage_handoff_latency_seconds",
		Help:    "Time from the head receiving a stage's output chunk to having sent it to the next stage, waits for the next stage included.",
		Buckets: []float64{0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1},
	}, []string{labelModel, "from_stage", "to_stage"})
	requests := prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: namespace, Name: "pipeline_requests_total",
		Help: "Pipeline requests finished, by outcome.",
	}, []string{labelModel, "outcome"})
	collectors := []prometheus.Collector{e2e, ttfa, rtf, duration, handoff, requests}
	for i, c := range collectors {
		if err := reg.Register(c); err != nil {
			for _, done := range collectors[:i] {
				reg.Unregister(done)
			}
			return nil, fmt.Errorf("stats: register pipeline families: %w", err)
		}
	}
	p := &Pipeline{
		e2e: e2e.WithLabelValues(model), ttfa: ttfa.WithLabelValues(model),
		rtf: rtf.WithLabelValues(model), duration: duration.WithLabelValues(model),
		outcome: map[string]prometheus.Counter{},
	}
	for i := 0; i+1 < numStages; i++ {
		p.handoff = append(p.handoff, handoff.WithLabelValues(model, strconv.Itoa(i), strconv.Itoa(i+1)))
	}
	for _, o := range outcomes {
		p.outcome[o] = requests.WithLabelValues(model, o)
	}
	return p, nil
}

// Handoff records one chunk handed from stage from to stage from+1.
func (p *Pipeline) Handoff(from int, d time.Duration) {
	if p == nil || from < 0 || from >= len(p.handoff) {
		return
	}
	p.handoff[from].Observe(d.Seconds())
}

// PipelineResult is one finished pipeline request as the head saw it.
type PipelineResult struct {
	Outcome string        // one of the Outcome constants
	E2E     time.Duration // arrival to last output
	// TTFA is arrival to the first audio samples; 0 when there was no audio.
	TTFA time.Duration
	// Audio is the duration of the audio produced; 0 when there was none.
	Audio time.Duration
}

// Finish records a finished request. E2E is observed for successes only,
// so failures do not skew the latency; every outcome is counted.
func (p *Pipeline) Finish(r PipelineResult) {
	if p == nil {
		return
	}
	c, ok := p.outcome[r.Outcome]
	if !ok {
		c = p.outcome[OutcomeError]
	}
	c.Inc()
	if r.Outcome != OutcomeSuccess {
		return
	}
	p.e2e.Observe(r.E2E.Seconds())
	if r.TTFA > 0 {
		p.ttfa.Observe(r.TTFA.Seconds())
	}
	if r.Audio > 0 {
		p.duration.Observe(r.Audio.Seconds())
		p.rtf.Observe(r.E2E.Seconds() / r.Audio.Seconds())
	}
}
