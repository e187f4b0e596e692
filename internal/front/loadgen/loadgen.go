package loadgen

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Config is one benchmark: where, what, and at which load.
type Config struct {
	// BaseURL is the server's base URL, with or without /v1.
	BaseURL string `json:"url"`
	Model   string `json:"model"`
	APIKey  string `json:"-"`
	// Workload is one of Workloads; ignored with a Trace.
	Workload string `json:"workload,omitempty"`
	// Rate is the arrival rate per second of an open-loop run (0: closed
	// loop at Concurrency, or the trace's own times).
	Rate float64 `json:"rate,omitempty"`
	// Poisson arrivals (exponential gaps); else constant gaps.
	Poisson bool `json:"poisson,omitempty"`
	// Concurrency is the number of clients of a closed-loop run, each
	// sending its next request when its last one ended.
	Concurrency int `json:"concurrency,omitempty"`
	// Duration ends the arrivals of a run; Requests, when above 0, ends
	// them after that many requests (whichever comes first; a trace ends
	// with its last request).
	Duration time.Duration `json:"duration_ns"`
	Requests int           `json:"requests,omitempty"`
	// Trace replaces the workload: its requests are sent at their at_ms.
	Trace []Request `json:"-"`

	MaxTokens     int    `json:"max_tokens"`
	IgnoreEOS     bool   `json:"ignore_eos,omitempty"`
	PromptWords   int    `json:"prompt_words"`
	SystemPrompts int    `json:"system_prompts,omitempty"`
	SystemWords   int    `json:"system_words,omitempty"`
	Turns         int    `json:"turns,omitempty"`
	Voice         string `json:"voice,omitempty"`
	// SampleRate is the rate of the streamed pcm16 audio in Hz; 0 learns
	// it from the server before the run (the WAV header of one whole
	// answer with audio). An answer's X-Audio-Sample-Rate header wins.
	SampleRate int    `json:"sample_rate"`
	Seed       uint64 `json:"seed"`
	// Timeout bounds one request (0: none).
	Timeout time.Duration `json:"timeout_ns,omitempty"`
	SLO     SLO           `json:"slo"`
	// Deadline, when set, is sent as every request's X-Troupe-Deadline
	// header (e.g. "ttft=50ms,ttfa=800ms": targets a troupe head routes and
	// admits on; docs/api.md, Deadlines).
	Deadline string `json:"deadline,omitempty"`
}

// Progress is a run's state, reported about once a second.
type Progress struct {
	Elapsed                       time.Duration
	Sent, InFlight, OK, Shed, Err int64
	// Done marks the last report of the run.
	Done bool
}

// Validate reports what is wrong with cfg.
func (cfg Config) Validate() error {
	switch {
	case cfg.BaseURL == "":
		return fmt.Errorf("loadgen: no URL")
	case cfg.Trace == nil && !validWorkload(cfg.Workload):
		return fmt.Errorf("loadgen: unknown workload %q (known: %s)", cfg.Workload, strings.Join(Workloads, ", "))
	case cfg.Trace == nil && cfg.Rate <= 0 && cfg.Concurrency <= 0:
		return fmt.Errorf("loadgen: neither a rate nor a concurrency")
	case cfg.Rate > 0 && cfg.Concurrency > 0:
		return fmt.Errorf("loadgen: a rate (open loop) and a concurrency (closed loop) exclude each other")
	case cfg.Trace == nil && cfg.Duration <= 0 && cfg.Requests <= 0:
		return fmt.Errorf("loadgen: neither a duration nor a number of requests")
	case cfg.MaxTokens < 1:
		return fmt.Errorf("loadgen: max tokens %d is below 1", cfg.MaxTokens)
	case cfg.SampleRate < 0:
		return fmt.Errorf("loadgen: sample rate %d is negative", cfg.SampleRate)
	case cfg.Workload == WorkloadMultiTurn && (cfg.SystemPrompts < 1 || cfg.Turns < 1):
		return fmt.Errorf("loadgen: multiturn needs at least one system prompt and one turn")
	}
	return nil
}

func validWorkload(w string) bool {
	for _, k := range Workloads {
		if k == w {
			return true
		}
	}
	return false
}

// ChatURL is the chat completions URL of a base URL given with or without /v1.
func ChatURL(base string) string {
	base = strings.TrimRight(base, "/")
	if !strings.HasSuffix(base, "/v1") {
		base += "/v1"
	}
	return base + "/chat/completions"
}

// Run runs one benchmark and returns its summary. It returns when the
// arrivals have ended and every request sent has ended; a cancelled ctx
// cuts the requests in flight (they count as failed) and Run returns
// what it measured with ctx's error. progress, when not nil, is called
// about once a second from Run's own goroutine.
func Run(ctx context.Context, cfg Config, progress func(Progress)) (RunResult, error) {
	if err := cfg.Validate(); err != nil {
		return RunResult{}, err
	}
	transport := &http.Transport{MaxIdleConnsPerHost: 4096, ForceAttemptHTTP2: false}
	defer transport.CloseIdleConnections()
	c := &client{http: &http.Client{Transport: transport}, url: ChatURL(cfg.BaseURL), model: cfg.Model, apiKey: cfg.APIKey,
		voice: cfg.Voice, sampleRate: cfg.SampleRate, ignoreEOS: cfg.IgnoreEOS, timeout: cfg.Timeout, deadline: cfg.Deadline}
	if c.sampleRate == 0 && cfg.wantsAudio() {
		rate, err := c.probeSampleRate(ctx, cfg.MaxTokens)
		if err != nil {
			return RunResult{}, fmt.Errorf("loadgen: learning the audio's sample rate from a whole answer's WAV (or give one): %w", err)
		}
		c.sampleRate = rate
	}
	gen := newGenerator(cfg)
	r := &runner{cfg: cfg, client: c, gen: gen, start: time.Now()}

	ticker := time.NewTicker(time.Second)
	defer ticker.Stop()
	arrivalsDone := make(chan struct{})
	go func() {
		defer close(arrivalsDone)
		switch {
		case cfg.Trace != nil:
			r.replay(ctx)
		case cfg.Concurrency > 0:
			r.closedLoop(ctx)
		default:
			r.openLoop(ctx)
		}
	}()
	for waiting := true; waiting; {
		select {
		case <-arrivalsDone:
			waiting = false
		case <-ticker.C:
			if progress != nil {
				progress(r.progress())
			}
		}
	}
	// Every request runs under r.wg: wait for the last, reporting.
	allDone := make(chan struct{})
	go func() { r.wg.Wait(); close(allDone) }()
	for waiting := true; waiting; {
		select {
		case <-allDone:
			waiting = false
		case <-ticker.C:
			if progress != nil {
				progress(r.progress())
			}
		}
	}
	wall := time.Since(r.start)
	if progress != nil {
		p := r.progress()
		p.Done = true
		progress(p)
	}
	res := summarize(cfg, r.records, wall)
	if cfg.wantsAudio() {
		res.SampleRate = c.sampleRate
	}
	return res, ctx.Err()
}

// wantsAudio reports whether the run asks for audio: the audio workload,
// or a trace with a request for it.
func (cfg Config) wantsAudio() bool {
	if cfg.Trace == nil {
		return cfg.Workload == WorkloadAudio
	}
	for _, r := range cfg.Trace {
		if r.audio() {
			return true
		}
	}
	return false
}

type runner struct {
	cfg    Config
	client *client
	gen    *generator
	start  time.Time
	wg     sync.WaitGroup

	sent, inFlight, ok, shed, failed atomic.Int64

	mu      sync.Mutex
	records []Record
}

func (r *runner) progress() Progress {
	return Progress{Elapsed: time.Since(r.start), Sent: r.sent.Load(), InFlight: r.inFlight.Load(),
		OK: r.ok.Load(), Shed: r.shed.Load(), Err: r.failed.Load()}
}

// more reports whether another request may be sent.
func (r *runner) more(ctx context.Context) bool {
	if ctx.Err() != nil {
		return false
	}
	if r.cfg.Requests > 0 && r.sent.Load() >= int64(r.cfg.Requests) {
		return false
	}
	return r.cfg.Duration <= 0 || time.Since(r.start) < r.cfg.Duration
}

// send sends req, due at scheduled from the start, and records it; it
// returns the answer's Retry-After (0: none).
func (r *runner) send(ctx context.Context, req Request, scheduled time.Duration) time.Duration {
	late := time.Since(r.start) - scheduled
	r.inFlight.Add(1)
	rec := r.client.do(ctx, req)
	r.inFlight.Add(-1)
	rec.ScheduledMS = float64(scheduled) / float64(time.Millisecond)
	rec.LateMS = max(float64(late)/float64(time.Millisecond), 0)
	switch rec.Outcome {
	case OutcomeOK:
		r.ok.Add(1)
	case OutcomeShed:
		r.shed.Add(1)
	default:
		r.failed.Add(1)
	}
	r.gen.reply(req, rec.answer, rec.Outcome == OutcomeOK)
	r.mu.Lock()
	r.records = append(r.records, rec)
	r.mu.Unlock()
	return time.Duration(rec.RetryAfterMS * float64(time.Millisecond))
}

// launch sends req in its own goroutine, owned by r.wg.
func (r *runner) launch(ctx context.Context, req Request, scheduled time.Duration) {
	r.sent.Add(1)
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		r.send(ctx, req, scheduled)
	}()
}

// pause waits d, but not past the run's duration; false when ctx ends
// first.
func (r *runner) pause(ctx context.Context, d time.Duration) bool {
	if r.cfg.Duration > 0 {
		d = min(d, r.cfg.Duration-time.Since(r.start))
	}
	return wait(ctx, d)
}

// sleepUntil waits until at from the start; false when ctx ends first.
func (r *runner) sleepUntil(ctx context.Context, at time.Duration) bool {
	return wait(ctx, time.Until(r.start.Add(at)))
}

// wait waits d; false when ctx ends first.
func wait(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

func (r *runner) openLoop(ctx context.Context) {
	gap := arrivals(r.cfg.Rate, r.cfg.Poisson, rand.New(rand.NewPCG(r.cfg.Seed, 0x617272)))
	var at time.Duration
	for {
		if r.cfg.Duration > 0 && at >= r.cfg.Duration {
			return
		}
		if !r.sleepUntil(ctx, at) || !r.more(ctx) {
			return
		}
		r.launch(ctx, r.gen.next(), at)
		at += gap()
	}
}

func (r *runner) closedLoop(ctx context.Context) {
	var wg sync.WaitGroup
	for range r.cfg.Concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				r.mu.Lock() // sent is checked and counted at once, so Requests is exact
				ok := r.more(ctx)
				if ok {
					r.sent.Add(1)
				}
				r.mu.Unlock()
				if !ok {
					return
				}
				// A client honours Retry-After, as OpenAI's clients do:
				// without it, N clients refused at once send again at
				// once, and the run measures a spin of refusals.
				if wait := r.send(ctx, r.gen.next(), time.Since(r.start)); wait > 0 && !r.pause(ctx, wait) {
					return
				}
			}
		}()
	}
	wg.Wait()
}

func (r *runner) replay(ctx context.Context) {
	for _, req := range r.cfg.Trace {
		if r.cfg.Requests > 0 && r.sent.Load() >= int64(r.cfg.Requests) {
			return
		}
		at := time.Duration(req.AtMS * float64(time.Millisecond))
		if !r.sleepUntil(ctx, at) {
			return
		}
		if req.MaxTokens == 0 {
			req.MaxTokens = r.cfg.MaxTokens
		}
		r.launch(ctx, req, at)
	}
}
