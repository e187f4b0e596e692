package loadgen

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

// SLO is what a request must meet to count in goodput; a zero field sets
// no objective. Latencies are upper bounds in milliseconds (ITL: the
// request's mean gap between text deltas); RTF is a lower bound, and a
// request with an RTF objective and no audio misses it.
type SLO struct {
	TTFTMS float64 `json:"ttft_ms,omitempty"`
	ITLMS  float64 `json:"itl_ms,omitempty"`
	TTFAMS float64 `json:"ttfa_ms,omitempty"`
	E2EMS  float64 `json:"e2e_ms,omitempty"`
	RTF    float64 `json:"rtf,omitempty"`
}

// ParseSLO reads "ttft=500ms,itl=50ms,ttfa=800ms,e2e=10s,rtf=1".
func ParseSLO(s string) (SLO, error) {
	var slo SLO
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		key, val, ok := strings.Cut(part, "=")
		if !ok {
			return SLO{}, fmt.Errorf("loadgen: SLO %q is not key=value", part)
		}
		if key == "rtf" {
			f, err := strconv.ParseFloat(val, 64)
			if err != nil || f <= 0 {
				return SLO{}, fmt.Errorf("loadgen: SLO rtf=%q is not a positive number", val)
			}
			slo.RTF = f
			continue
		}
		d, err := time.ParseDuration(val)
		if err != nil || d <= 0 {
			return SLO{}, fmt.Errorf("loadgen: SLO %s=%q is not a positive duration", key, val)
		}
		ms := float64(d) / float64(time.Millisecond)
		switch key {
		case "ttft":
			slo.TTFTMS = ms
		case "itl":
			slo.ITLMS = ms
		case "ttfa":
			slo.TTFAMS = ms
		case "e2e":
			slo.E2EMS = ms
		default:
			return SLO{}, fmt.Errorf("loadgen: unknown SLO %q (known: ttft, itl, ttfa, e2e, rtf)", key)
		}
	}
	return slo, nil
}

// met reports whether rec meets every objective; a request that did not
// end OK never does.
func (s SLO) met(rec Record) bool {
	if rec.Outcome != OutcomeOK {
		return false
	}
	switch {
	case s.TTFTMS > 0 && (rec.TTFTMS == 0 || rec.TTFTMS > s.TTFTMS),
		s.ITLMS > 0 && rec.meanITL() > s.ITLMS,
		s.TTFAMS > 0 && (rec.TTFAMS == 0 || rec.TTFAMS > s.TTFAMS),
		s.E2EMS > 0 && rec.E2EMS > s.E2EMS,
		s.RTF > 0 && rec.RTF < s.RTF:
		return false
	}
	return true
}

// Dist is a distribution's mean, standard deviation (population, as
// numpy's std) and percentiles (nearest rank; P50 is the median); N is
// its size.
type Dist struct {
	N    int     `json:"n"`
	Mean float64 `json:"mean"`
	Std  float64 `json:"std"`
	P50  float64 `json:"p50"`
	P90  float64 `json:"p90"`
	P99  float64 `json:"p99"`
	Min  float64 `json:"min"`
	Max  float64 `json:"max"`
}

func dist(v []float64) Dist {
	if len(v) == 0 {
		return Dist{}
	}
	v = slices.Clone(v)
	slices.Sort(v)
	var sum float64
	for _, x := range v {
		sum += x
	}
	rank := func(p float64) float64 {
		i := int(math.Ceil(p*float64(len(v)))) - 1
		return v[max(i, 0)]
	}
	mean := sum / float64(len(v))
	var sq float64
	for _, x := range v {
		sq += (x - mean) * (x - mean)
	}
	return Dist{N: len(v), Mean: mean, Std: math.Sqrt(sq / float64(len(v))), P50: rank(0.50), P90: rank(0.90), P99: rank(0.99), Min: v[0], Max: v[len(v)-1]}
}

// RunResult is the summary of one run (one rate of a sweep).
type RunResult struct {
	// Load names the load: "rate 4/s", "concurrency 8", "trace".
	Load        string  `json:"load"`
	Rate        float64 `json:"rate,omitempty"`
	Concurrency int     `json:"concurrency,omitempty"`
	WallSeconds float64 `json:"wall_seconds"`
	Sent        int     `json:"sent"`
	OK          int     `json:"ok"`
	Shed        int     `json:"shed"`
	Failed      int     `json:"failed"`
	// MetSLO counts the requests that ended OK and met every objective.
	MetSLO int `json:"met_slo"`
	// Throughput is OK requests per second of wall time; Goodput those
	// that met every objective (all OK requests without objectives): a
	// shed or failed request is never in either.
	Throughput  float64 `json:"throughput_rps"`
	Goodput     float64 `json:"goodput_rps"`
	ShedShare   float64 `json:"shed_share"`
	FailedShare float64 `json:"failed_share"`
	// TokensPerSecond counts text deltas (a token each from troupe).
	TokensPerSecond float64 `json:"deltas_per_second"`
	// TotalOutputTokens sums the OK answers' output tokens (their usage's
	// completion_tokens, else their text deltas); OutputThroughput is
	// them per second of wall time (vllm bench serve's output_throughput,
	// genai-perf's output token throughput).
	TotalOutputTokens int     `json:"total_output_tokens"`
	OutputThroughput  float64 `json:"output_throughput"`
	// Latencies in ms, of the OK requests; ITL pools every gap between
	// text deltas; TPOT is one value per streamed answer of two tokens or
	// more (vllm bench serve's TPOT, genai-perf's inter-token latency).
	TTFT      Dist `json:"ttft_ms"`
	TPOT      Dist `json:"tpot_ms"`
	ITL       Dist `json:"itl_ms"`
	TTFA      Dist `json:"ttfa_ms"`
	E2E       Dist `json:"e2e_ms"`
	RTF       Dist `json:"rtf"`
	Underruns Dist `json:"underruns"`
	// LateMS is how late the client sent requests (open loop): a large
	// value means the client, not the server, was the bottleneck.
	Late Dist `json:"late_ms"`
	// SampleRate is the Hz the audio was measured at (given, or learned
	// from the server before the run); 0 without audio.
	SampleRate int `json:"sample_rate,omitempty"`
	// StreamedAnswers counts the OK streamed answers with two text deltas
	// or more; BurstAnswers those of them whose deltas all came within a
	// millisecond of the first, as one burst (a server that made the
	// whole text in one step: troupe's sim with --decode-latency 0), and
	// OneDeltaAnswers the OK streamed answers whose text of two tokens or
	// more came in a single delta. When nine answers in ten are bursts, or
	// all are single deltas, the ITL says nothing of the decoding speed;
	// the table says so in a note.
	StreamedAnswers int `json:"streamed_answers"`
	BurstAnswers    int `json:"burst_answers"`
	OneDeltaAnswers int `json:"one_delta_answers"`
	// VLLM is the run in the names of vllm bench serve's result file
	// (its --save-result JSON), to read side by side: see VLLMView.
	VLLM map[string]float64 `json:"vllm_bench_serve,omitempty"`
	// Errors holds up to 5 distinct errors, for the reader.
	Errors  []string `json:"errors,omitempty"`
	Records []Record `json:"records,omitempty"`
}

func summarize(cfg Config, recs []Record, wall time.Duration) RunResult {
	res := RunResult{Rate: cfg.Rate, Concurrency: cfg.Concurrency, WallSeconds: wall.Seconds(), Sent: len(recs), Records: recs}
	switch {
	case cfg.Trace != nil:
		res.Load = "trace"
	case cfg.Concurrency > 0:
		res.Load = fmt.Sprintf("concurrency %d", cfg.Concurrency)
	default:
		res.Load = fmt.Sprintf("rate %g/s", cfg.Rate)
	}
	var ttft, tpot, itl, ttfa, e2e, rtf, under, late []float64
	deltas := 0
	for _, r := range recs {
		late = append(late, r.LateMS)
		switch r.Outcome {
		case OutcomeShed:
			res.Shed++
		case OutcomeFailed:
			res.Failed++
		}
		if r.Error != "" && len(res.Errors) < 5 && !slices.Contains(res.Errors, r.Error) {
			res.Errors = append(res.Errors, r.Error)
		}
		if r.Outcome != OutcomeOK {
			continue
		}
		res.OK++
		if cfg.SLO.met(r) {
			res.MetSLO++
		}
		deltas += r.Deltas
		res.TotalOutputTokens += r.OutputTokens
		e2e = append(e2e, r.E2EMS)
		if r.TTFTMS > 0 {
			ttft = append(ttft, r.TTFTMS)
		}
		if r.TPOTMS > 0 {
			tpot = append(tpot, r.TPOTMS)
		}
		itl = append(itl, r.ITLMS...)
		switch {
		case r.Deltas >= 2:
			res.StreamedAnswers++
			if r.burst() {
				res.BurstAnswers++
			}
		case r.Deltas == 1 && r.OutputTokens >= 2:
			res.OneDeltaAnswers++
		}
		if r.AudioSeconds > 0 {
			ttfa = append(ttfa, r.TTFAMS)
			rtf = append(rtf, r.RTF)
			under = append(under, float64(r.Underruns))
		}
	}
	if s := wall.Seconds(); s > 0 {
		res.Throughput = float64(res.OK) / s
		res.Goodput = float64(res.MetSLO) / s
		res.TokensPerSecond = float64(deltas) / s
		res.OutputThroughput = float64(res.TotalOutputTokens) / s
	}
	if res.Sent > 0 {
		res.ShedShare = float64(res.Shed) / float64(res.Sent)
		res.FailedShare = float64(res.Failed) / float64(res.Sent)
	}
	res.TTFT, res.TPOT, res.ITL, res.TTFA, res.E2E, res.RTF, res.Underruns, res.Late = dist(ttft), dist(tpot), dist(itl), dist(ttfa), dist(e2e), dist(rtf), dist(under), dist(late)
	res.VLLM = VLLMView(res)
	return res
}

// VLLMView is r under the names of vllm bench serve's result file, so the
// two read side by side: duration, completed (OK), failed (shed and
// failed), total_output_tokens, request_throughput, request_goodput,
// output_throughput, and for ttft, tpot, itl and e2el the mean_, median_,
// std_, p90_ and p99_ figures in ms. Percentiles are nearest rank where
// vLLM interpolates; the two agree closely from a few hundred requests.
func VLLMView(r RunResult) map[string]float64 {
	v := map[string]float64{
		"duration":            r.WallSeconds,
		"completed":           float64(r.OK),
		"failed":              float64(r.Shed + r.Failed),
		"total_output_tokens": float64(r.TotalOutputTokens),
		"request_throughput":  r.Throughput,
		"request_goodput":     r.Goodput,
		"output_throughput":   r.OutputThroughput,
	}
	for name, d := range map[string]Dist{"ttft": r.TTFT, "tpot": r.TPOT, "itl": r.ITL, "e2el": r.E2E} {
		v["mean_"+name+"_ms"] = d.Mean
		v["median_"+name+"_ms"] = d.P50
		v["std_"+name+"_ms"] = d.Std
		v["p90_"+name+"_ms"] = d.P90
		v["p99_"+name+"_ms"] = d.P99
	}
	return v
}

// Result is a result file: the configuration and one run per load.
type Result struct {
	Version   int         `json:"version"`
	StartedAt time.Time   `json:"started_at"`
	Config    Config      `json:"config"`
	Runs      []RunResult `json:"runs"`
}

// ResultVersion is the version of the result file's shape.
const ResultVersion = 1

// ReadResult decodes a result file.
func ReadResult(r io.Reader) (Result, error) {
	var res Result
	if err := json.NewDecoder(r).Decode(&res); err != nil {
		return Result{}, fmt.Errorf("loadgen: decoding a result: %w", err)
	}
	if res.Version != ResultVersion {
		return Result{}, fmt.Errorf("loadgen: result version %d, want %d", res.Version, ResultVersion)
	}
	return res, nil
}

// WriteTable writes one row per run: counts, rates, and the mean, median
// and p99 of each latency (as vllm bench serve prints them), then a note
// under a run whose ITL says nothing of the decoding speed.
func WriteTable(w io.Writer, runs []RunResult) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "load\tsent\tok\tshed\tfailed\treq/s\tgoodput/s\toutput tok/s\tTTFT mean/med/p99 ms\tTPOT mean/med/p99 ms\tITL mean/med/p99 ms\tE2EL mean/med/p99 ms\tTTFA mean/med/p99 ms\tRTF med/min\tunderruns med/p99\t")
	for _, r := range runs {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%.2f\t%.2f\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t\n", r.Load, r.Sent, r.OK, r.Shed, r.Failed,
			r.Throughput, r.Goodput, num(r.OutputThroughput), ms3(r.TTFT), ms3(r.TPOT), ms3(r.ITL), ms3(r.E2E), ms3(r.TTFA), rtfCell(r.RTF), underCell(r.Underruns))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, r := range runs {
		if note := itlNote(r); note != "" {
			if _, err := fmt.Fprintf(w, "note: %s: %s\n", r.Load, note); err != nil {
				return err
			}
		}
		if r.SampleRate > 0 {
			if _, err := fmt.Fprintf(w, "note: %s: audio measured at %d Hz\n", r.Load, r.SampleRate); err != nil {
				return err
			}
		}
	}
	return nil
}

// itlNote explains an ITL that measures no decoding: nine streamed
// answers in ten or more came as one burst of deltas (a few may be
// stretched past the burst's millisecond by the client's own scheduling),
// or every one as one delta.
func itlNote(r RunResult) string {
	switch {
	case r.StreamedAnswers > 0 && 10*r.BurstAnswers >= 9*r.StreamedAnswers && r.OneDeltaAnswers == 0:
		return fmt.Sprintf("ITL and TPOT are about 0: the text deltas of %d of the %d answers came within %gms of their first, as one burst: "+
			"the server made the whole text at once (troupe's sim decodes instantly unless given --decode-latency)", r.BurstAnswers, r.StreamedAnswers, burstMS)
	case r.OneDeltaAnswers > 0 && r.StreamedAnswers == 0:
		return fmt.Sprintf("no ITL: each of the %d answers came in one text delta of several tokens", r.OneDeltaAnswers)
	}
	return ""
}

// ms3 is a latency's mean, median and p99.
func ms3(d Dist) string {
	if d.N == 0 {
		return "-"
	}
	return fmt.Sprintf("%s/%s/%s", num(d.Mean), num(d.P50), num(d.P99))
}

// rtfCell shows the median RTF and the lowest (a low RTF is the bad one).
func rtfCell(d Dist) string {
	if d.N == 0 {
		return "-"
	}
	return fmt.Sprintf("%s/%s", num(d.P50), num(d.Min))
}

func underCell(d Dist) string {
	if d.N == 0 {
		return "-"
	}
	return fmt.Sprintf("%g/%g", d.P50, d.P99)
}

// num prints a figure with three significant digits at most.
func num(v float64) string {
	switch a := math.Abs(v); {
	case a >= 100:
		return strconv.FormatFloat(v, 'f', 0, 64)
	case a >= 10:
		return strconv.FormatFloat(v, 'f', 1, 64)
	default:
		return strconv.FormatFloat(v, 'f', 2, 64)
	}
}

// Compare writes, for each run of a matched with the run of b at the same
// position, b's figure next to a's and their ratio b/a.
func Compare(w io.Writer, a, b Result) error {
	if len(a.Runs) != len(b.Runs) {
		fmt.Fprintf(w, "note: %d runs against %d; comparing the first %d\n", len(a.Runs), len(b.Runs), min(len(a.Runs), len(b.Runs)))
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "load\tmetric\ta\tb\tb/a\t")
	for i := range min(len(a.Runs), len(b.Runs)) {
		ra, rb := a.Runs[i], b.Runs[i]
		load := ra.Load
		if rb.Load != ra.Load {
			load += " vs " + rb.Load
		}
		row := func(metric string, x, y float64) {
			ratio := "-"
			if x != 0 {
				ratio = fmt.Sprintf("%.2f", y/x)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t\n", load, metric, num(x), num(y), ratio)
		}
		row("req/s", ra.Throughput, rb.Throughput)
		row("goodput/s", ra.Goodput, rb.Goodput)
		row("output tok/s", ra.OutputThroughput, rb.OutputThroughput)
		row("shed share", ra.ShedShare, rb.ShedShare)
		row("failed share", ra.FailedShare, rb.FailedShare)
		dists := []struct {
			name string
			x, y Dist
		}{{"TTFT", ra.TTFT, rb.TTFT}, {"TPOT", ra.TPOT, rb.TPOT}, {"ITL", ra.ITL, rb.ITL}, {"TTFA", ra.TTFA, rb.TTFA}, {"RTF", ra.RTF, rb.RTF}, {"E2EL", ra.E2E, rb.E2E}}
		for _, d := range dists {
			if d.x.N == 0 && d.y.N == 0 {
				continue
			}
			row(d.name+" mean", d.x.Mean, d.y.Mean)
			row(d.name+" p50", d.x.P50, d.y.P50)
			row(d.name+" p99", d.x.P99, d.y.P99)
		}
	}
	return tw.Flush()
}
