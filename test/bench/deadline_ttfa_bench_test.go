package bench

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/internal/front/loadgen"
	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/worker/sim"
)

// The audio deadline workload: thinker → talker → vocoder of sims,
// streamed between stages; ttfaReplicas of each stage, one replica of
// TROUPE_TTFA_SLOW's stage (the talker by default) three times slower
// (its decode step and its prefill). Open loop: text + streamed audio at
// a Poisson rate with a TTFA objective; then closed loop at several
// concurrencies.
var (
	ttfaStep      = envDuration("TROUPE_TTFA_STEP", 5*time.Millisecond) // one decode step; the slow replica's three
	ttfaPrefill   = 8000.0                                              // tokens per second; the slow replica's a third
	ttfaSeqs      = 8
	ttfaTarget    = envDuration("TROUPE_TTFA_TARGET", 150*time.Millisecond)
	ttfaRate      = envFloat("TROUPE_TTFA_RATE", 20)
	ttfaOpen      = envDuration("TROUPE_TTFA_OPEN", 20*time.Second) // the open-loop run
	ttfaDuration  = envDuration("TROUPE_TTFA_DURATION", 8*time.Second)
	ttfaMaxTokens = 16
	ttfaLevels    = levels(envString("TROUPE_TTFA_LEVELS", "1,8,32"))
	ttfaSlow      = envString("TROUPE_TTFA_SLOW", "talker") // the stage with the slow replica
	ttfaReplicas  = map[string]int{"thinker": 2, "talker": 4, "vocoder": 2}
	// TROUPE_TTFA_SLOW_OF: how many replicas the slow one's stage has
	// (default: ttfaReplicas'), e.g. 2 for a fleet half of which is slow.
	ttfaSlowOf = int(envFloat("TROUPE_TTFA_SLOW_OF", 0))
	ttfaCases  = strings.Split(envString("TROUPE_TTFA_CASES", "least_loaded,deadline,deadline+admission"), ",")
)

func envString(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func levels(s string) []int {
	var out []int
	for f := range strings.SplitSeq(s, ",") {
		if n, err := strconv.Atoi(strings.TrimSpace(f)); err == nil && n > 0 {
			out = append(out, n)
		}
	}
	return out
}

type ttfaResult struct {
	policy       string
	open         loadgen.RunResult
	late, missed int     // served past the target; late or shed or failed
	lateBy       float64 // the most a served first audio came past the target, ms
	slowShare    float64 // of the slow stage's attempts
	shedCounted  float64 // troupe_router_decisions_total{reason="deadline_shed"}, every stage
	missCounted  float64 // {reason="deadline_missed"}: stopped at the target
	predErr      float64 // mean actual − predicted first output of the slow stage, ms
	predN        uint64
	predicted    []float64           // the slow stage's replicas' predicted first output after the run, ms
	runs         []loadgen.RunResult // closed loop, by ttfaLevels
}

// BenchmarkDeadlineTTFA proves the deadline policy on a time-to-first-audio
// target: a heterogeneous fleet (4 talkers, one 3× slower), least_loaded
// against deadline on every stage without and with admission, first open
// loop at TROUPE_TTFA_RATE (Poisson), then closed loop at concurrency 1, 8
// and 32, through the HTTP API driven by the loadgen package as `troupe
// bench --workload audio` drives it (text + streamed audio). One op is
// one whole run; run it once:
//
//	go test -run '^$' -bench BenchmarkDeadlineTTFA -benchtime 1x ./test/bench
//
// TROUPE_TTFA_TARGET, _RATE, _OPEN, _DURATION, _STEP, _SLOW, _SLOW_OF,
// _LEVELS and _CASES override the defaults (one more case: deadline+admission-last,
// admission on the last stage only).
func BenchmarkDeadlineTTFA(b *testing.B) {
	var results []ttfaResult
	for _, policy := range ttfaCases {
		b.Run(policy, func(b *testing.B) {
			var r ttfaResult
			for range b.N {
				r = runTTFA(b, policy)
			}
			b.ReportMetric(float64(r.missed)/float64(max(r.open.Sent, 1)), "miss-share")
			b.ReportMetric(r.open.Goodput, "goodput-rps")
			for i, run := range r.runs {
				b.ReportMetric(run.TTFA.P99, fmt.Sprintf("ttfa-p99-ms@c%d", ttfaLevels[i]))
			}
			results = append(results, r)
		})
	}
	if len(results) > 0 {
		fmt.Println(ttfaTable(results))
	}
}

func ttfaPipeline(policy string) orchestrator.Pipeline {
	p := orchestrator.DefaultPipeline()
	deadline := strings.HasPrefix(policy, "deadline")
	for i := range p.Stages {
		p.Stages[i].Policy = "least_loaded"
		if deadline {
			p.Stages[i].Policy = "deadline"
			// deadline+admission admits on every stage; -last only on the
			// last, whose first audio the TTFA target is about.
			admit := policy == "deadline+admission" || (policy == "deadline+admission-last" && i == len(p.Stages)-1)
			p.Stages[i].Deadline = &orchestrator.Deadline{Capacity: ttfaSeqs, Admission: admit}
		}
	}
	if deadline {
		// The first text is due with the first audio: the objective is TTFA.
		p.Deadline = &orchestrator.Deadline{Targets: orchestrator.Targets{TTFT: ttfaTarget, TTFA: ttfaTarget}}
	}
	return p
}

func runTTFA(b *testing.B, policy string) ttfaResult {
	if ttfaSlowOf > 0 {
		ttfaReplicas[ttfaSlow] = ttfaSlowOf
	}
	quiet := slog.New(slog.DiscardHandler)
	p := ttfaPipeline(policy)
	fast := sim.Config{MaxNumSeqs: ttfaSeqs, DecodeTokenLatency: ttfaStep, PrefillTokensPerSec: ttfaPrefill, Logger: quiet}
	slow := fast
	slow.DecodeTokenLatency, slow.PrefillTokensPerSec = 3*ttfaStep, ttfaPrefill/3
	c := orchestratortest.Start(b, orchestratortest.Options{Pipeline: p, ReplicasPerStage: -1, Sim: fast, Logger: quiet})
	var slowID uint32
	total := 0
	for _, stage := range []string{"thinker", "talker", "vocoder"} {
		for i := range ttfaReplicas[stage] {
			cfg := fast
			if stage == ttfaSlow && i == ttfaReplicas[stage]-1 {
				cfg = slow
			}
			w := c.AddWorker(b, stage, orchestratortest.WorkerOptions{Sim: &cfg})
			if cfg == slow {
				slowID = w.ReplicaID()
			}
			total++
		}
	}
	require.Eventually(b, func() bool {
		n := 0
		for _, r := range c.Head.Replicas() {
			if r.State == "attached" {
				n++
			}
		}
		return n == total
	}, time.Minute, 10*time.Millisecond)
	base := serveRoutingHTTP(b, c.Head)
	cfg := loadgen.Config{
		BaseURL: base, Model: p.Model, Workload: loadgen.WorkloadAudio,
		MaxTokens: ttfaMaxTokens, IgnoreEOS: true, PromptWords: 32, Seed: 1, SampleRate: 24000, Timeout: time.Minute,
		SLO: loadgen.SLO{TTFAMS: float64(ttfaTarget) / float64(time.Millisecond)},
	}
	res := ttfaResult{policy: policy}

	open := cfg
	open.Rate, open.Poisson, open.Duration = ttfaRate, true, ttfaOpen
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	run, err := loadgen.Run(ctx, open, nil)
	cancel()
	require.NoError(b, err)
	res.open = run
	for _, rec := range run.Records {
		switch {
		case rec.Outcome != loadgen.OutcomeOK:
			res.missed++
		case rec.TTFAMS == 0 || rec.TTFAMS > cfg.SLO.TTFAMS:
			res.late++
			res.missed++
			res.lateBy = max(res.lateBy, rec.TTFAMS-cfg.SLO.TTFAMS)
		}
	}
	slowStage := stageIndex(p, ttfaSlow)
	for _, r := range c.Head.Replicas() {
		if r.Stage == slowStage && r.PredictedFirstOutputSeconds != nil {
			res.predicted = append(res.predicted, 1000**r.PredictedFirstOutputSeconds)
		}
	}
	fams, err := c.Metrics.Gather()
	require.NoError(b, err)
	var attempts, onSlow float64
	for _, f := range fams {
		for _, m := range f.GetMetric() {
			switch f.GetName() {
			case "troupe_router_decisions_total":
				switch labelValue(m, "reason") {
				case "deadline_shed":
					res.shedCounted += m.GetCounter().GetValue()
				case "deadline_missed":
					res.missCounted += m.GetCounter().GetValue()
				}
			case "troupe_router_deadline_prediction_error_seconds":
				if labelValue(m, "stage") == strconv.Itoa(slowStage) {
					h := m.GetHistogram()
					res.predN += h.GetSampleCount()
					res.predErr += 1000 * h.GetSampleSum()
				}
			case "troupe_request_success_total":
				if labelValue(m, "stage") != strconv.Itoa(slowStage) {
					continue
				}
				attempts += m.GetCounter().GetValue()
				if labelValue(m, "replica") == strconv.FormatUint(uint64(slowID), 10) {
					onSlow += m.GetCounter().GetValue()
				}
			}
		}
	}
	if attempts > 0 {
		res.slowShare = onSlow / attempts
	}
	if res.predN > 0 {
		res.predErr /= float64(res.predN)
	}

	for _, n := range ttfaLevels {
		closed := cfg
		closed.Concurrency, closed.Duration = n, ttfaDuration
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		run, err := loadgen.Run(ctx, closed, nil)
		cancel()
		require.NoError(b, err)
		res.runs = append(res.runs, run)
	}
	return res
}

func stageIndex(p orchestrator.Pipeline, name string) int {
	for i, s := range p.Stages {
		if s.Name == name {
			return i
		}
	}
	return -1
}

// ttfaTable renders the results as Markdown tables, goodput as a multiple
// of the first case's (least_loaded); docs/benchmarks.md, "Time to first
// audio", condenses them.
func ttfaTable(rs []ttfaResult) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "TTFA target %s, open loop %.0f req/s Poisson for %s, one %s of %d 3x slower\n\n", ttfaTarget, ttfaRate, ttfaOpen, ttfaSlow, ttfaReplicas[ttfaSlow])
	sb.WriteString("| policy | sent | served | failed | shed (429 + 503) | refused / stopped at target | late (served past target; most past, ms) | missed | goodput (req/s) | ÷ least_loaded | TTFA p50 / p90 / p99 (ms) | TTFT p50 / p99 (ms) | slow replica's share | prediction error, slow stage (ms) | predicted, slow stage (ms) |\n")
	sb.WriteString("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---|\n")
	for _, r := range rs {
		sent := float64(max(r.open.Sent, 1))
		pe := "–"
		if r.predN > 0 {
			pe = fmt.Sprintf("%+.1f (n=%d)", r.predErr, r.predN)
		}
		fmt.Fprintf(&sb, "| %s | %d | %d | %d | %d (%.1f%%) | %.0f / %.0f | %d (%.1f%%; %.1f) | %d (%.1f%%) | %.1f | %.2f× | %.0f / %.0f / %.0f | %.0f / %.0f | %.1f%% | %s | %s |\n",
			r.policy, r.open.Sent, r.open.OK, r.open.Failed, r.open.Shed, 100*float64(r.open.Shed)/sent, r.shedCounted, r.missCounted,
			r.late, 100*float64(r.late)/sent, r.lateBy, r.missed, 100*float64(r.missed)/sent,
			r.open.Goodput, r.open.Goodput/rs[0].open.Goodput, r.open.TTFA.P50, r.open.TTFA.P90, r.open.TTFA.P99,
			r.open.TTFT.P50, r.open.TTFT.P99, 100*r.slowShare, pe, predictedCell(r.predicted))
	}
	sb.WriteString("\nClosed loop, ")
	fmt.Fprintf(&sb, "%s per level:\n\n", ttfaDuration)
	sb.WriteString("| policy | concurrency | requests | shed | failed | TTFA p50 / p90 / p99 (ms) | met TTFA target | RTF p50 / min |\n")
	sb.WriteString("|---|---:|---:|---:|---:|---|---:|---|\n")
	for _, r := range rs {
		for i, run := range r.runs {
			fmt.Fprintf(&sb, "| %s | %d | %d | %d | %d | %.0f / %.0f / **%.0f** | %.1f%% | %.2f / %.2f |\n",
				r.policy, ttfaLevels[i], run.Sent, run.Shed, run.Failed, run.TTFA.P50, run.TTFA.P90, run.TTFA.P99,
				100*float64(run.MetSLO)/float64(max(run.Sent, 1)), run.RTF.P50, run.RTF.Min)
		}
	}
	return sb.String()
}
