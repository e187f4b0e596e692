package bench

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"os"
	"slices"
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

// The scale-up workload: the default three-stage pipeline (thinker →
// talker → vocoder) with one replica per stage, each running at most
// scaleUpSeqs requests at once, the vocoder's decode step scaleUpSlowStep
// (the bottleneck) and the others' scaleUpFastStep, under streamed
// text + audio chat at a constant open-loop rate that one replica of the
// vocoder cannot keep up with.
var (
	scaleUpSeqs  = int(envFloat("TROUPE_SCALEUP_SEQS", 2))
	scaleUpSteps = map[string]time.Duration{ // decode step per stage
		"thinker": envDuration("TROUPE_SCALEUP_THINKER_STEP", 12*time.Millisecond),
		"talker":  envDuration("TROUPE_SCALEUP_TALKER_STEP", 2*time.Millisecond),
		"vocoder": envDuration("TROUPE_SCALEUP_VOCODER_STEP", 10*time.Millisecond),
	}
	scaleUpRates    = envFloats("TROUPE_SCALEUP_RATES", []float64{6, 7}) // one sub-benchmark each: at and over one vocoder's capacity
	scaleUpDuration = envDuration("TROUPE_SCALEUP_DURATION", 15*time.Second)
	scaleUpWarmup   = envDuration("TROUPE_SCALEUP_WARMUP", 5*time.Second)
	scaleUpMaxTok   = 16
	// The target after the scale-up: p90 within scaleUpTarget × the
	// unloaded p90, or within scaleUpSlack of it (a latency of a few ms is
	// scheduler noise on a shared VM).
	scaleUpTarget    = envFloat("TROUPE_SCALEUP_TARGET", 2)
	scaleUpSlack     = 20.0 // ms
	scaleUpUnloadedN = 20
	// scaleUpMaxReplicas caps the replicas a stage is scaled to, as an
	// autoscaler's maxReplicas does (0: none).
	scaleUpMaxReplicas = int(envFloat("TROUPE_SCALEUP_MAX_REPLICAS", 0))
)

// scaleUpStages are the sim engines of the stages, by name.
func scaleUpStages(quiet *slog.Logger) map[string]sim.Config {
	out := map[string]sim.Config{}
	for name, step := range scaleUpSteps {
		out[name] = sim.Config{MaxNumSeqs: scaleUpSeqs, DecodeTokenLatency: step, Logger: quiet}
	}
	return out
}

// latencies are the client-side percentiles of one window, in ms.
type latencies struct {
	n, notOK         int
	ttftP50, ttftP90 float64
	ttfaP50, ttfaP90 float64
	e2eP50           float64
}

type scaleUpResult struct {
	rate              float64
	stages            []string
	unloaded, before  latencies
	after             latencies
	desired, replicas map[string]int // recommendation read after "before"; replicas serving "after"
	attachIn          time.Duration  // from the first AddWorker to the last one attached
}

// BenchmarkScaleUp applies the head's troupe_stage_desired_replicas: it
// measures TTFT and TTFA through the HTTP API (driven by the loadgen
// package as `troupe bench` drives a head) unloaded, then under a constant
// open-loop load that saturates one replica per stage, reads each stage's
// recommendation from the head's registry, starts workers until each
// stage has that many replicas, waits until the head has attached them,
// and measures again under the same load. The target: after the scale-up
// the p90 TTFT and TTFA are within TROUPE_SCALEUP_TARGET (2) × their
// unloaded p90, or within scaleUpSlack of it. One op is one whole run (a
// fresh cluster); run it once:
//
//	go test -run '^$' -bench BenchmarkScaleUp -benchtime 1x ./test/bench
//
// TROUPE_SCALEUP_RATES (a comma-separated list), _DURATION, _WARMUP,
// _SEQS, _THINKER_STEP, _TALKER_STEP and _VOCODER_STEP override the load
// and the stages; TROUPE_SCALEUP_MAX_REPLICAS caps the replicas a stage is
// scaled to, as an autoscaler's maxReplicas does.
func BenchmarkScaleUp(b *testing.B) {
	var results []scaleUpResult
	for _, rate := range scaleUpRates {
		b.Run(fmt.Sprintf("rate=%g", rate), func(b *testing.B) {
			var r scaleUpResult
			for range b.N {
				r = runScaleUp(b, rate)
			}
			b.ReportMetric(r.before.ttftP90, "before-ttft-p90-ms")
			b.ReportMetric(r.before.ttfaP90, "before-ttfa-p90-ms")
			b.ReportMetric(r.after.ttftP90, "after-ttft-p90-ms")
			b.ReportMetric(r.after.ttfaP90, "after-ttfa-p90-ms")
			b.ReportMetric(boolMetric(r.met()), "target-met")
			for _, st := range r.stages {
				b.ReportMetric(float64(r.desired[st]), "desired-"+st)
			}
			b.Log("\n" + scaleUpTable([]scaleUpResult{r}))
			results = append(results, r)
		})
	}
	if len(results) > 1 {
		fmt.Println(scaleUpTable(results))
	}
}

// met reports whether the latencies after the scale-up meet the target.
func (r scaleUpResult) met() bool { return r.meets(r.after) }

func (r scaleUpResult) meets(l latencies) bool {
	ok := func(got, unloaded float64) bool {
		return got <= max(scaleUpTarget*unloaded, unloaded+scaleUpSlack)
	}
	return ok(l.ttftP90, r.unloaded.ttftP90) && ok(l.ttfaP90, r.unloaded.ttfaP90)
}

func boolMetric(ok bool) float64 {
	if ok {
		return 1
	}
	return 0
}

func runScaleUp(b *testing.B, rate float64) scaleUpResult {
	quiet := slog.New(slog.DiscardHandler)
	engines := scaleUpStages(quiet)
	c := orchestratortest.Start(b, orchestratortest.Options{
		ReplicasPerStage: -1,
		Logger:           quiet,
		// A cooldown longer than the run: the gauge read after the loaded
		// window is the highest figure of the window.
		Autoscale: orchestrator.AutoscaleConfig{Interval: 100 * time.Millisecond, ScaleDownCooldown: 10 * time.Minute},
	})
	res := scaleUpResult{rate: rate, desired: map[string]int{}, replicas: map[string]int{}}
	for _, st := range c.Head.Pipeline().Stages {
		res.stages = append(res.stages, st.Name)
		cfg := engines[st.Name]
		w := c.AddWorker(b, st.Name, orchestratortest.WorkerOptions{Sim: &cfg})
		c.WaitState(b, st.Name, w.ReplicaID(), orchestrator.StateAttached)
		res.replicas[st.Name] = 1
	}
	base := serveRoutingHTTP(b, c.Head)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cfg := loadgen.Config{
		BaseURL: base, Model: "troupe-omni-sim", Workload: loadgen.WorkloadAudio,
		MaxTokens: scaleUpMaxTok, IgnoreEOS: true, PromptWords: 20, Seed: 1, SampleRate: 24000,
		Timeout: time.Minute,
	}
	unloaded := cfg
	unloaded.Concurrency, unloaded.Requests = 1, scaleUpUnloadedN
	res.unloaded = scaleUpWindow(b, ctx, unloaded, 0)
	for name, v := range scaleUpDesired(b, c) {
		require.Equal(b, 1, v, "stage %s recommends %d replicas before any load", name, v)
	}

	loaded := cfg
	loaded.Rate, loaded.Duration = rate, scaleUpDuration
	res.before = scaleUpWindow(b, ctx, loaded, scaleUpWarmup)
	res.desired = scaleUpDesired(b, c)

	start := time.Now()
	var added []*orchestratortest.Worker
	for _, st := range res.stages {
		want := res.desired[st]
		if scaleUpMaxReplicas > 0 {
			want = min(want, scaleUpMaxReplicas)
		}
		for res.replicas[st] < want {
			cfg := engines[st]
			added = append(added, c.AddWorker(b, st, orchestratortest.WorkerOptions{Sim: &cfg}))
			res.replicas[st]++
		}
	}
	for _, w := range added {
		c.WaitState(b, w.Stage, w.ReplicaID(), orchestrator.StateAttached) // bounded: 30 s
	}
	res.attachIn = time.Since(start)
	res.after = scaleUpWindow(b, ctx, loaded, scaleUpWarmup)
	return res
}

// scaleUpWindow runs cfg and returns the percentiles of the requests
// scheduled from warmup on; every request must end OK.
func scaleUpWindow(b *testing.B, ctx context.Context, cfg loadgen.Config, warmup time.Duration) latencies {
	b.Helper()
	run, err := loadgen.Run(ctx, cfg, nil)
	require.NoError(b, err)
	var ttft, ttfa, e2e []float64
	var out latencies
	for _, rec := range run.Records {
		if rec.ScheduledMS < float64(warmup)/float64(time.Millisecond) {
			continue
		}
		out.n++
		if rec.Outcome != loadgen.OutcomeOK || rec.TTFTMS == 0 || rec.TTFAMS == 0 {
			out.notOK++
			continue
		}
		ttft, ttfa, e2e = append(ttft, rec.TTFTMS), append(ttfa, rec.TTFAMS), append(e2e, rec.E2EMS)
	}
	b.Logf("%s: sent %d ok %d failed %d shed %d, TTFT p50/p90 %.0f/%.0f ms, TTFA p50/p90 %.0f/%.0f ms, late p90 %.0f ms", run.Load, run.Sent, run.OK, run.Failed, run.Shed, run.TTFT.P50, run.TTFT.P90, run.TTFA.P50, run.TTFA.P90, run.Late.P90)
	require.Zero(b, out.notOK, "requests without text and audio: %v", run.Errors)
	require.NotZero(b, out.n, "no request in the window")
	out.ttftP50, out.ttftP90 = rank(ttft, 0.5), rank(ttft, 0.9)
	out.ttfaP50, out.ttfaP90 = rank(ttfa, 0.5), rank(ttfa, 0.9)
	out.e2eP50 = rank(e2e, 0.5)
	return out
}

// rank is the nearest-rank percentile, as loadgen computes it.
func rank(v []float64, p float64) float64 {
	v = slices.Clone(v)
	slices.Sort(v)
	return v[max(int(math.Ceil(p*float64(len(v))))-1, 0)]
}

// scaleUpDesired reads troupe_stage_desired_replicas of every stage from
// the head's registry.
func scaleUpDesired(b *testing.B, c *orchestratortest.Cluster) map[string]int {
	b.Helper()
	fams, err := c.Metrics.Gather()
	require.NoError(b, err)
	out := map[string]int{}
	for _, f := range fams {
		if f.GetName() != "troupe_stage_desired_replicas" {
			continue
		}
		for _, m := range f.GetMetric() {
			out[labelValue(m, "stage_name")] = int(m.GetGauge().GetValue())
		}
	}
	require.Len(b, out, len(c.Head.Pipeline().Stages), "troupe_stage_desired_replicas per stage")
	return out
}

// scaleUpTable renders the results as the table of docs/benchmarks.md,
// "Applying the recommendation".
func scaleUpTable(rs []scaleUpResult) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "max_num_seqs %d, decode step thinker %s, talker %s, vocoder %s; constant arrivals for %s, the first %s not counted; target: p90 ≤ max(%g× unloaded p90, unloaded p90 + %g ms)\n\n",
		scaleUpSeqs, scaleUpSteps["thinker"], scaleUpSteps["talker"], scaleUpSteps["vocoder"], scaleUpDuration, scaleUpWarmup, scaleUpTarget, scaleUpSlack)
	sb.WriteString("| rate (req/s) | window | replicas thinker/talker/vocoder | requests | TTFT p50 / p90 (ms) | TTFA p50 / p90 (ms) | E2E p50 (ms) | TTFT p90 ÷ unloaded | TTFA p90 ÷ unloaded | target met |\n")
	sb.WriteString("|---:|---|---|---:|---|---|---:|---:|---:|---|\n")
	for _, r := range rs {
		row := func(name string, replicas map[string]int, l latencies) {
			var n []string
			for _, st := range r.stages {
				n = append(n, fmt.Sprint(replicas[st]))
			}
			fmt.Fprintf(&sb, "| %g | %s | %s | %d | %.0f / %.0f | %.0f / %.0f | %.0f | %.1f× | %.1f× | %s |\n",
				r.rate, name, strings.Join(n, "/"), l.n, l.ttftP50, l.ttftP90, l.ttfaP50, l.ttfaP90, l.e2eP50,
				l.ttftP90/r.unloaded.ttftP90, l.ttfaP90/r.unloaded.ttfaP90, yesNo(r.meets(l)))
		}
		ones := map[string]int{}
		for _, st := range r.stages {
			ones[st] = 1
		}
		row("unloaded (1 at a time)", ones, r.unloaded)
		row("before", ones, r.before)
		row(fmt.Sprintf("after (+%d workers, attached in %s)", sum(r.replicas)-len(r.stages), r.attachIn.Round(time.Millisecond)), r.replicas, r.after)
	}
	sb.WriteString("\nreplicas after = troupe_stage_desired_replicas read from the head's registry after the loaded window (the highest figure of the window)")
	if scaleUpMaxReplicas > 0 {
		fmt.Fprintf(&sb, ", capped at %d", scaleUpMaxReplicas)
	}
	sb.WriteString("\n")
	return sb.String()
}

func envFloats(name string, def []float64) []float64 {
	var out []float64
	for _, f := range strings.Split(os.Getenv(name), ",") {
		v, err := strconv.ParseFloat(strings.TrimSpace(f), 64)
		if err != nil {
			return def
		}
		out = append(out, v)
	}
	return out
}

func sum(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

func yesNo(ok bool) string {
	if ok {
		return "yes"
	}
	return "no"
}
