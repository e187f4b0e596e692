package bench

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/internal/front/loadgen"
	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/worker/sim"
)

// The audio deadline workload: thinker → talker → vocoder of sims, two
// replicas a stage, one of the vocoders (TROUPE_TTFA_SLOW: or another stage)
// three times slower (its decode step and its prefill), under closed-loop
// streamed audio at several concurrencies.
var (
	ttfaStep      = envDuration("TROUPE_TTFA_STEP", 5*time.Millisecond) // one decode step; the slow vocoder's three
	ttfaPrefill   = 8000.0                                              // tokens per second; the slow vocoder's a third
	ttfaSeqs      = 8
	ttfaTarget    = envDuration("TROUPE_TTFA_TARGET", 150*time.Millisecond)
	ttfaDuration  = envDuration("TROUPE_TTFA_DURATION", 8*time.Second)
	ttfaMaxTokens = 16
	ttfaLevels    = []int{1, 8, 32}
	ttfaSlow      = envString("TROUPE_TTFA_SLOW", "vocoder") // the stage with the slow replica
)

func envString(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

type ttfaResult struct {
	policy string
	runs   []loadgen.RunResult // by ttfaLevels
}

// BenchmarkDeadlineTTFA measures time to first audio at concurrency 1, 8
// and 32 (closed loop), least_loaded against deadline on every stage with
// a TTFA target (no admission), through the HTTP API driven by the
// loadgen package as `troupe bench --workload audio --concurrency N`
// drives it. One op is one whole run; run it once:
//
//	go test -run '^$' -bench BenchmarkDeadlineTTFA -benchtime 1x ./test/bench
//
// TROUPE_TTFA_TARGET, _STEP and _DURATION override the defaults.
func BenchmarkDeadlineTTFA(b *testing.B) {
	var results []ttfaResult
	for _, policy := range []string{"least_loaded", "deadline"} {
		b.Run(policy, func(b *testing.B) {
			var r ttfaResult
			for range b.N {
				r = runTTFA(b, policy)
			}
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

func runTTFA(b *testing.B, policy string) ttfaResult {
	quiet := slog.New(slog.DiscardHandler)
	p := orchestrator.DefaultPipeline()
	for i := range p.Stages {
		p.Stages[i].Policy = policy
	}
	if policy == "deadline" {
		p.Deadline = &orchestrator.Deadline{Targets: orchestrator.Targets{TTFT: ttfaTarget / 2, TTFA: ttfaTarget}}
	}
	fast := sim.Config{MaxNumSeqs: ttfaSeqs, DecodeTokenLatency: ttfaStep, PrefillTokensPerSec: ttfaPrefill, Logger: quiet}
	slow := fast
	slow.DecodeTokenLatency, slow.PrefillTokensPerSec = 3*ttfaStep, ttfaPrefill/3
	c := orchestratortest.Start(b, orchestratortest.Options{Pipeline: p, ReplicasPerStage: -1, Sim: fast, Logger: quiet})
	for _, stage := range []string{"thinker", "talker", "vocoder"} {
		for i := range 2 {
			cfg := fast
			if stage == ttfaSlow && i == 1 {
				cfg = slow
			}
			c.AddWorker(b, stage, orchestratortest.WorkerOptions{Sim: &cfg})
		}
	}
	require.Eventually(b, func() bool {
		n := 0
		for _, r := range c.Head.Replicas() {
			if r.State == "attached" {
				n++
			}
		}
		return n == 6
	}, time.Minute, 10*time.Millisecond)
	base := serveRoutingHTTP(b, c.Head)
	res := ttfaResult{policy: policy}
	for _, n := range ttfaLevels {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		run, err := loadgen.Run(ctx, loadgen.Config{
			BaseURL: base, Model: p.Model, Workload: loadgen.WorkloadAudio, Concurrency: n, Duration: ttfaDuration,
			MaxTokens: ttfaMaxTokens, IgnoreEOS: true, PromptWords: 32, Seed: 1, SampleRate: 24000, Timeout: time.Minute,
			SLO: loadgen.SLO{TTFAMS: float64(ttfaTarget) / float64(time.Millisecond)},
		}, nil)
		cancel()
		require.NoError(b, err)
		require.Zero(b, run.Failed, "errors: %v", run.Errors)
		res.runs = append(res.runs, run)
	}
	return res
}

// ttfaTable renders the results as the table of docs/benchmarks.md.
func ttfaTable(rs []ttfaResult) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "TTFA target %s (deadline policy; TTFT target half of it), closed loop %s per level, one %s 3x slower\n\n", ttfaTarget, ttfaDuration, ttfaSlow)
	sb.WriteString("| policy | concurrency | requests | TTFA p50 / p90 / p99 (ms) | TTFT p50 / p99 (ms) | met TTFA target | RTF p50 / min |\n")
	sb.WriteString("|---|---:|---:|---|---|---:|---|\n")
	for _, r := range rs {
		for i, run := range r.runs {
			fmt.Fprintf(&sb, "| %s | %d | %d | %.0f / %.0f / %.0f | %.0f / %.0f | %.1f%% | %.2f / %.2f |\n",
				r.policy, ttfaLevels[i], run.Sent, run.TTFA.P50, run.TTFA.P90, run.TTFA.P99, run.TTFT.P50, run.TTFT.P99,
				100*float64(run.MetSLO)/float64(max(run.Sent, 1)), run.RTF.P50, run.RTF.Min)
		}
	}
	return sb.String()
}
