package bench

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/internal/front/loadgen"
	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/worker/sim"
)

// The deadline workload: 4 thinker replicas of which one prefills 3×
// slower (so it holds a request about as long as the others, and
// least_loaded gives it its share), each running at most deadlineSeqs
// requests at once, under streamed chat at a Poisson rate, with a TTFT
// objective.
var (
	deadlinePrefill  = envFloat("TROUPE_DEADLINE_PREFILL_TPS", 4000) // tokens per second; the slow replica a third
	deadlineStep     = 10 * time.Millisecond                         // one decode step
	deadlineSeqs     = 4
	deadlineCapacity = int(envFloat("TROUPE_DEADLINE_CAPACITY", 4))
	deadlinePrompt   = 100 // words
	deadlineRate     = envFloat("TROUPE_DEADLINE_RATE", 16)
	deadlineTTFT     = envDuration("TROUPE_DEADLINE_TTFT", 50*time.Millisecond)
	deadlineDuration = envDuration("TROUPE_DEADLINE_DURATION", 20*time.Second)
	deadlineMaxTok   = 16
	// deadlineAdmitMargin is the admission case's margin (see
	// docs/routing.md): how many mean deviations of room a replica needs.
	deadlineAdmitMargin = envFloat("TROUPE_DEADLINE_ADMIT_MARGIN", 1)
	// deadlineMargin is the cases without admission's (0: the policy's
	// default, router.DeadlineMargin).
	deadlineMargin = envFloat("TROUPE_DEADLINE_MARGIN", 0)
)

func envFloat(name string, def float64) float64 {
	if v, err := strconv.ParseFloat(os.Getenv(name), 64); err == nil {
		return v
	}
	return def
}

func envDuration(name string, def time.Duration) time.Duration {
	if v, err := time.ParseDuration(os.Getenv(name)); err == nil {
		return v
	}
	return def
}

type deadlineCase struct {
	name  string
	stage orchestrator.Stage
}

// deadlineStage is the deadline policy's stage with the benchmark's
// target and capacity, its model and admission as given.
func deadlineStage(model string, admission bool) orchestrator.Stage {
	d := &orchestrator.Deadline{Targets: orchestrator.Targets{TTFT: deadlineTTFT}, Capacity: deadlineCapacity, Model: model, Margin: deadlineMargin}
	if admission {
		d.Admission, d.Margin = true, deadlineAdmitMargin
	}
	return orchestrator.Stage{Policy: "deadline", Deadline: d}
}

var deadlineCases = []deadlineCase{
	{name: "least_loaded", stage: orchestrator.Stage{Policy: "least_loaded"}},
	{name: "deadline, load model", stage: deadlineStage(router.DeadlineModelLoad, false)},
	{name: "deadline", stage: deadlineStage(router.DeadlineModelQueue, false)},
	{name: "deadline+admission, load model", stage: deadlineStage(router.DeadlineModelLoad, true)},
	{name: "deadline+admission", stage: deadlineStage(router.DeadlineModelQueue, true)},
}

type deadlineResult struct {
	name         string
	run          loadgen.RunResult
	late, missed int // OK past the target; late or shed or failed
	slowShare    float64
	shedCounted  float64 // troupe_router_decisions_total{reason="deadline_shed"}
	missCounted  float64 // troupe_router_decisions_total{reason="deadline_missed"}: stopped at the target
	lateBy       float64 // the most a served first token came past the target, ms
	predErr      float64 // mean actual − predicted first output, ms (deadline policy)
	predN        uint64
	predicted    []float64 // each replica's predicted first output after the run, ms (0: none)
}

// BenchmarkDeadline compares least_loaded with the deadline policy, with
// and without admission, on a heterogeneous fleet, through the HTTP API
// driven by the loadgen package as `troupe bench` drives it (see
// docs/benchmarks.md, "Deadline-aware routing"). One op is one whole run;
// run it once:
//
//	go test -run '^$' -bench BenchmarkDeadline -benchtime 1x ./test/bench
//
// TROUPE_DEADLINE_RATE, _TTFT and _DURATION override the load, _CAPACITY
// and _PREFILL_TPS the replicas, _MARGIN (without admission) and
// _ADMIT_MARGIN the policy.
func BenchmarkDeadline(b *testing.B) {
	var results []deadlineResult
	for _, dc := range deadlineCases {
		b.Run(dc.name, func(b *testing.B) {
			var r deadlineResult
			for range b.N {
				r = runDeadline(b, dc)
			}
			b.ReportMetric(float64(r.missed)/float64(r.run.Sent), "miss-share")
			b.ReportMetric(float64(r.late)/float64(r.run.Sent), "late-share")
			b.ReportMetric(r.run.Goodput, "goodput-rps")
			b.ReportMetric(r.run.TTFT.P99, "ttft-p99-ms")
			results = append(results, r)
		})
	}
	if len(results) > 0 {
		fmt.Println(deadlineTable(results))
	}
}

func runDeadline(b *testing.B, dc deadlineCase) deadlineResult {
	stage := dc.stage
	stage.Name = "thinker"
	quiet := slog.New(slog.DiscardHandler)
	fast := sim.Config{MaxNumSeqs: deadlineSeqs, DecodeTokenLatency: deadlineStep, PrefillTokensPerSec: deadlinePrefill, Logger: quiet}
	slow := fast
	slow.PrefillTokensPerSec = deadlinePrefill / 3
	c := orchestratortest.Start(b, orchestratortest.Options{
		Pipeline:         orchestrator.Pipeline{Model: "troupe-omni-sim", Stages: []orchestrator.Stage{stage}},
		ReplicasPerStage: -1,
		Sim:              fast,
		Logger:           quiet,
	})
	var slowID uint32
	for i := range 4 {
		cfg := fast
		if i == 3 {
			cfg = slow
		}
		w := c.AddWorker(b, "thinker", orchestratortest.WorkerOptions{Sim: &cfg})
		if i == 3 {
			slowID = w.ReplicaID()
		}
	}
	require.Eventually(b, func() bool {
		n := 0
		for _, r := range c.Head.Replicas() {
			if r.State == "attached" {
				n++
			}
		}
		return n == 4
	}, time.Minute, 10*time.Millisecond)
	base := serveRoutingHTTP(b, c.Head)

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cfg := loadgen.Config{
		BaseURL: base, Model: "troupe-omni-sim", Workload: loadgen.WorkloadStream,
		Rate: deadlineRate, Poisson: true, Duration: deadlineDuration,
		MaxTokens: deadlineMaxTok, IgnoreEOS: true, PromptWords: deadlinePrompt, Seed: 1, SampleRate: 24000,
		Timeout: time.Minute,
		SLO:     loadgen.SLO{TTFTMS: float64(deadlineTTFT) / float64(time.Millisecond)},
	}
	run, err := loadgen.Run(ctx, cfg, nil)
	require.NoError(b, err)
	res := deadlineResult{name: dc.name, run: run}
	for _, rec := range run.Records {
		switch {
		case rec.Outcome != loadgen.OutcomeOK:
			res.missed++
		case rec.TTFTMS > cfg.SLO.TTFTMS:
			res.late++
			res.missed++
			res.lateBy = max(res.lateBy, rec.TTFTMS-cfg.SLO.TTFTMS)
		}
	}
	for _, r := range c.Head.Replicas() {
		p := 0.0
		if r.PredictedFirstOutputSeconds != nil {
			p = 1000 * *r.PredictedFirstOutputSeconds
		}
		res.predicted = append(res.predicted, p)
	}
	fams, err := c.Metrics.Gather()
	require.NoError(b, err)
	var total, onSlow float64
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
				h := m.GetHistogram()
				res.predN += h.GetSampleCount()
				res.predErr += 1000 * h.GetSampleSum()
			case "troupe_request_success_total":
				total += m.GetCounter().GetValue()
				if labelValue(m, "replica") == strconv.FormatUint(uint64(slowID), 10) {
					onSlow += m.GetCounter().GetValue()
				}
			}
		}
	}
	if total > 0 {
		res.slowShare = onSlow / total
	}
	if res.predN > 0 {
		res.predErr /= float64(res.predN)
	}
	return res
}

// deadlineTable renders the results as a Markdown table, goodput as a
// multiple of the first case's (least_loaded); docs/benchmarks.md,
// "Deadline-aware routing", condenses it.
func deadlineTable(rs []deadlineResult) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "TTFT target %s, %.0f req/s Poisson for %s, admission margin %.2g\n\n", deadlineTTFT, deadlineRate, deadlineDuration, deadlineAdmitMargin)
	sb.WriteString("| policy | sent | served | shed (429 + 503) | refused (deadline_shed) / stopped at target (deadline_missed) | late (served past target; most past, ms) | missed (late + shed + failed) | goodput (req/s) | goodput ÷ least_loaded | TTFT p50 / p90 / p99 (ms) | slow replica's share | mean prediction error (ms) | predicted first output when idle, per replica (ms) |\n")
	sb.WriteString("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|\n")
	for _, r := range rs {
		sent := float64(r.run.Sent)
		fmt.Fprintf(&sb, "| %s | %d | %d | %d (%.1f%%) | %.0f / %.0f | %d (%.1f%%; %.1f) | %d (%.1f%%) | %.1f | %.2f× | %.0f / %.0f / %.0f | %.1f%% | %s | %s |\n",
			r.name, r.run.Sent, r.run.OK, r.run.Shed, 100*float64(r.run.Shed)/sent, r.shedCounted, r.missCounted,
			r.late, 100*float64(r.late)/sent, r.lateBy, r.missed, 100*float64(r.missed)/sent,
			r.run.Goodput, r.run.Goodput/rs[0].run.Goodput, r.run.TTFT.P50, r.run.TTFT.P90, r.run.TTFT.P99, 100*r.slowShare, predErrCell(r), predictedCell(r.predicted))
	}
	return sb.String()
}

func labelValue(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

func predErrCell(r deadlineResult) string {
	if r.predN == 0 {
		return "–"
	}
	return fmt.Sprintf("%+.1f (n=%d)", r.predErr, r.predN)
}

func predictedCell(ps []float64) string {
	if len(ps) == 0 || slices.Max(ps) == 0 {
		return "–"
	}
	parts := make([]string, len(ps))
	for i, p := range ps {
		parts[i] = fmt.Sprintf("%.0f", p)
	}
	return strings.Join(parts, " / ")
}
