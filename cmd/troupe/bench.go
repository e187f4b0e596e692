package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"time"

	"github.com/troupe-serving/troupe/internal/front/loadgen"
	"github.com/troupe-serving/troupe/orchestrator"
)

// benchDetail is the help's text after the summary.
const benchDetail = `Open loop at --rate (Poisson or constant arrivals; a list sweeps the rates, one run each),
closed loop at --concurrency, or a --trace replayed (JSONL: at_ms, prompt or messages,
max_tokens, modalities, stream). Workloads: chat (whole text answers), stream (streamed text),
audio (text + streamed pcm16 audio), multiturn (streamed conversations over shared system prompts).
'troupe bench compare A.json B.json' prints B's figures next to A's, with B/A.`

// runBench runs `troupe bench`, or `troupe bench compare A B`.
func runBench(ctx context.Context, args []string, stdout io.Writer) error {
	if len(args) > 0 && args[0] == "compare" {
		return runBenchCompare(args[1:], stdout)
	}
	fs := newFlagSet("bench")
	url := fs.String("url", "http://127.0.0.1:8000", "the server's `base` URL, with or without /v1")
	model := fs.String("model", "troupe-omni-sim", "the `model` to ask for")
	apiKey := fs.String("api-key", "", "bearer `key` (better: TROUPE_API_KEY)")
	workload := fs.String("workload", loadgen.WorkloadStream, "`kind` of requests: chat, stream, audio, multiturn")
	rates := fs.String("rate", "", "open loop: arrivals per second, or a comma-separated `list` to sweep")
	arrival := fs.String("arrival", "poisson", "`process` of open-loop arrivals: poisson or constant")
	concurrency := fs.Int("concurrency", 0, "closed loop: `n` clients, each sending when its last answer ended")
	trace := fs.String("trace", "", "JSONL `file` of requests to replay at their at_ms")
	duration := fs.Duration("duration", 30*time.Second, "how long arrivals last, per run (0: until --requests)")
	requests := fs.Int("requests", 0, "at most `n` requests per run (0: no limit)")
	maxTokens := fs.Int("max-tokens", 64, "max_tokens of each request (a trace's own win)")
	ignoreEOS := fs.Bool("ignore-eos", false, "send ignore_eos, so every answer has --max-tokens tokens")
	promptWords := fs.Int("prompt-words", 32, "`words` of each user message")
	systemPrompts := fs.Int("system-prompts", 4, "multiturn: `n` shared system prompts")
	systemWords := fs.Int("system-words", 256, "multiturn: `words` of each system prompt")
	turns := fs.Int("turns", 4, "multiturn: user `turns` per conversation")
	voice := fs.String("voice", "alloy", "audio: the `voice`")
	sampleRate := fs.Int("sample-rate", 0, "audio: `Hz` of the streamed pcm16 (0: learned from the server before the run, from the WAV header of one whole answer; an answer's X-Audio-Sample-Rate header wins)")
	seed := fs.Uint64("seed", 1, "`seed` of prompts and arrivals")
	timeout := fs.Duration("timeout", 5*time.Minute, "limit of one request (0: none)")
	sloFlag := fs.String("slo", "", "goodput objectives, e.g. `ttft=500ms,itl=50ms,ttfa=800ms,e2e=10s,rtf=1`")
	deadline := fs.String("deadline", "", "targets sent as every request's X-Troupe-Deadline header, e.g. `ttft=50ms,ttfa=800ms,rtf=1` (a troupe head routes and admits on them)")
	out := fs.String("out", "", "write the result as JSON to `file`")
	records := fs.Bool("records", false, "keep every request's record in the --out file")
	progress := fs.String("progress", "auto", "progress on stderr: `mode` auto (a live line on a terminal, else a line every 10s), plain, off")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(fs.Output(), "troupe bench: unexpected arguments %q (only 'compare A.json B.json' takes any)\n", fs.Args())
		return errUsage
	}
	slo, err := loadgen.ParseSLO(*sloFlag)
	if err != nil {
		return err
	}
	if *deadline != "" {
		if _, err := orchestrator.ParseTargets(*deadline); err != nil {
			return fmt.Errorf("bench: --deadline: %w", err)
		}
	}
	cfg := loadgen.Config{
		BaseURL: *url, Model: *model, APIKey: *apiKey, Workload: *workload, Poisson: *arrival == "poisson",
		Concurrency: *concurrency, Duration: *duration, Requests: *requests, MaxTokens: *maxTokens, IgnoreEOS: *ignoreEOS,
		PromptWords: *promptWords, SystemPrompts: *systemPrompts, SystemWords: *systemWords, Turns: *turns,
		Voice: *voice, SampleRate: *sampleRate, Seed: *seed, Timeout: *timeout, SLO: slo, Deadline: *deadline,
	}
	if *arrival != "poisson" && *arrival != "constant" {
		return fmt.Errorf("bench: unknown --arrival %q (poisson or constant)", *arrival)
	}
	var rateList []float64
	for _, s := range splitList(*rates) {
		r, err := strconv.ParseFloat(s, 64)
		if err != nil || r <= 0 {
			return fmt.Errorf("bench: --rate %q: not a positive number", s)
		}
		rateList = append(rateList, r)
	}
	if *trace != "" {
		if len(rateList) > 0 || *concurrency > 0 {
			return errors.New("bench: --trace sets its own arrivals: no --rate or --concurrency")
		}
		f, err := os.Open(*trace)
		if err != nil {
			return err
		}
		cfg.Trace, err = loadgen.ReadTrace(f)
		f.Close()
		if err != nil {
			return err
		}
		cfg.Duration = 0
	}
	runs := []loadgen.Config{cfg}
	if len(rateList) > 0 {
		runs = runs[:0]
		for _, r := range rateList {
			c := cfg
			c.Rate = r
			runs = append(runs, c)
		}
	}
	for _, c := range runs {
		if err := c.Validate(); err != nil {
			return err
		}
	}
	report, err := newProgress(*progress, os.Stderr)
	if err != nil {
		return err
	}
	result := loadgen.Result{Version: loadgen.ResultVersion, StartedAt: time.Now().UTC(), Config: cfg}
	for _, c := range runs {
		res, err := loadgen.Run(ctx, c, report(c))
		if !*records {
			res.Records = nil
		}
		result.Runs = append(result.Runs, res)
		if err != nil {
			break // interrupted: report what was measured
		}
	}
	if err := loadgen.WriteTable(stdout, result.Runs); err != nil {
		return err
	}
	for _, r := range result.Runs {
		for _, e := range r.Errors {
			fmt.Fprintf(stdout, "%s: error: %s\n", r.Load, e)
		}
	}
	if *out != "" {
		data, err := json.MarshalIndent(result, "", "  ")
		if err != nil {
			return err
		}
		if err := os.WriteFile(*out, append(data, '\n'), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// newProgress returns, per run, the progress callback of mode: auto is a
// line rewritten in place when w is a terminal, else plain; plain writes
// a line every 10 seconds; off nothing.
func newProgress(mode string, w *os.File) (func(loadgen.Config) func(loadgen.Progress), error) {
	live := false
	switch mode {
	case "off":
		return func(loadgen.Config) func(loadgen.Progress) { return nil }, nil
	case "plain":
	case "auto":
		if fi, err := w.Stat(); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
			live = true
		}
	default:
		return nil, fmt.Errorf("bench: unknown --progress %q (auto, plain, off)", mode)
	}
	return func(c loadgen.Config) func(loadgen.Progress) {
		load := "trace"
		switch {
		case c.Rate > 0:
			load = fmt.Sprintf("rate %g/s", c.Rate)
		case c.Concurrency > 0:
			load = fmt.Sprintf("concurrency %d", c.Concurrency)
		}
		var last time.Duration
		return func(p loadgen.Progress) {
			line := fmt.Sprintf("bench %s: %s sent %d, in flight %d, ok %d, shed %d, failed %d",
				load, p.Elapsed.Truncate(time.Second), p.Sent, p.InFlight, p.OK, p.Shed, p.Err)
			if live {
				fmt.Fprintf(w, "\r\033[K%s", line)
				if p.Done {
					fmt.Fprintln(w)
				}
				return
			}
			if p.Done || p.Elapsed-last >= 10*time.Second {
				last = p.Elapsed
				fmt.Fprintln(w, line)
			}
		}
	}, nil
}

// runBenchCompare prints the figures of two result files side by side.
func runBenchCompare(args []string, stdout io.Writer) error {
	fs := newFlagSet("bench")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() != 2 {
		fmt.Fprintf(fs.Output(), "troupe bench compare: two result files, got %q\n", fs.Args())
		return errUsage
	}
	var res [2]loadgen.Result
	for i, name := range fs.Args() {
		f, err := os.Open(name)
		if err != nil {
			return err
		}
		res[i], err = loadgen.ReadResult(f)
		f.Close()
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
	}
	return loadgen.Compare(stdout, res[0], res[1])
}
