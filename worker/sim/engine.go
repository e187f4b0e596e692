// Package sim is a deterministic engine that behaves like a continuous-
// batching LLM server without a GPU: a scheduler with a sequence limit, a
// token budget, a KV block pool with a prefix cache, preemption, chunked
// prefill, speculative decoding and sleep levels. Its output is a pure
// function of the request (see Expect), so pipelines can be checked byte for
// byte; its stats and timings are its own, measured from its real queues.
package sim

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/tokenizers"
)

// EngineName is what Health reports as the engine.
const EngineName = tokenizers.SimEngine

// Engine runs the scheduler in one goroutine, started by New and stopped by
// Close. Generate, Health, Sleep, WakeUp and Snapshot may be called
// concurrently from any goroutine.
type Engine struct {
	cfg       Config
	events    chan event // unbuffered: once sent, the loop owns the event
	quit      chan struct{}
	done      chan struct{} // closed when the loop has exited
	closeOnce sync.Once
	snap      atomic.Pointer[Snapshot]
	// slowdown is added to every step that computes (SlowDown).
	slowdown atomic.Int64
}

// SlowDown adds d to every later step that computes anything, as a replica that
// slows mid-stream (a noisy neighbour, a throttled GPU) would; 0 undoes
// it. Safe for concurrent use: tests call it while requests run.
func (e *Engine) SlowDown(d time.Duration) { e.slowdown.Store(int64(max(d, 0))) }

type eventKind uint8

const (
	evSubmit eventKind = iota
	evAbort
	evSleep
	evWake
	evWatch
	evUnwatch
)

type event struct {
	kind  eventKind
	seq   *seq
	level int
	reply chan sleepReply // evSleep, evWake; buffered 1
	watch *cacheWatcher   // evWatch, evUnwatch
	done  chan struct{}   // evWatch, evUnwatch: closed once handled
}

type sleepReply struct {
	state stagepb.SleepState
	err   error
}

// New starts an engine. Zero config fields take defaults; invalid values
// are clamped (use Config.Validate to report them instead). The caller owns
// the engine and must Close it.
func New(cfg Config) *Engine {
	e := &Engine{
		cfg:    cfg.withDefaults(),
		events: make(chan event),
		quit:   make(chan struct{}),
		done:   make(chan struct{}),
	}
	sc := newScheduler(e.cfg)
	snap := sc.snapshot()
	e.snap.Store(&snap)
	go e.loop(sc)
	return e
}

// Config returns the effective configuration (defaults filled in).
func (e *Engine) Config() Config { return e.cfg }

// Close stops the scheduler and waits for it. Requests still in flight end
// with Unavailable. Close is idempotent.
func (e *Engine) Close() error {
	e.closeOnce.Do(func() { close(e.quit) })
	<-e.done
	return nil
}

// Run blocks until ctx ends, then closes the engine; for callers that own
// the engine through a context rather than a deferred Close.
func (e *Engine) Run(ctx context.Context) error {
	select {
	case <-ctx.Done():
	case <-e.done:
	}
	return e.Close()
}

// Snapshot returns the engine's latest published state.
func (e *Engine) Snapshot() Snapshot { return *e.snap.Load() }

var errClosed = status.Error(codes.Unavailable, "sim: engine closed")

// invalidArgument refuses input; msg is shown to the API client as is (see
// stagepb's rules for refusals), so it has no package prefix.
func invalidArgument(msg string) error { return status.Error(codes.InvalidArgument, msg) }

// Generate runs one request and calls emit, from the calling goroutine, for
// each chunk in order; the last one carries the finish reason and timings.
// Cancelling ctx, or emit failing, aborts the request in the engine (its
// blocks are freed and it counts as finished with abort). Errors are gRPC
// status errors, except ctx's own error and emit's.
func (e *Engine) Generate(ctx context.Context, req *stagepb.GenerateRequest, emit func(*stagepb.GenerateChunk) error) error {
	role := e.cfg.Role
	p := paramsOf(req.GetSampling())
	p.continues = req.GetContinuation() != ""
	if e.cfg.InputRole == stagepb.RoleAudio {
		prompt, pl, err := asrPlan(req, p)
		if err != nil {
			return err
		}
		if need := len(prompt) + len(pl.ids) + e.cfg.NumSpeculativeTokens; need > e.cfg.maxModelLen() {
			return stagepb.ContextLengthError(e.cfg.maxModelLen(), len(prompt), need)
		}
		s := newSeq(req.GetRequestId(), role, prompt, pl, p.seed)
		s.delta.PromptAudioTokens = uint64(len(prompt) - 1) // all but SimBOS
		return e.run(ctx, s, emit)
	}
	prompt, ctxLen, err := promptOf(role, req)
	if err != nil {
		return err
	}
	n, _ := outputLength(role, prompt, ctxLen, p)
	if need := len(prompt) + n + e.cfg.NumSpeculativeTokens; need > e.cfg.maxModelLen() {
		// The cache (num-kv-blocks x block-size) is the sim's context.
		return stagepb.ContextLengthError(e.cfg.maxModelLen(), len(prompt), need)
	}
	s := newSeq(req.GetRequestId(), role, prompt, buildPlan(role, prompt, ctxLen, p), p.seed)
	countMediaTokens(req.GetChat().GetMessages(), s.delta)
	s.media = mediaItemsOf(req.GetChat().GetMessages())
	return e.run(ctx, s, emit)
}

// run submits s to the scheduler and emits its chunks until it ends.
func (e *Engine) run(ctx context.Context, s *seq, emit func(*stagepb.GenerateChunk) error) error {
	select {
	case e.events <- event{kind: evSubmit, seq: s}:
	case <-ctx.Done():
		return ctx.Err()
	case <-e.done:
		return errClosed
	}
	for {
		closed := false
		select {
		case <-s.box.notify:
		case <-ctx.Done():
			e.abort(s)
			return ctx.Err()
		case <-e.done:
			closed = true
		}
		chunks, final, err := s.box.take()
		for _, c := range chunks {
			if err := emit(c); err != nil {
				e.abort(s)
				return err
			}
		}
		switch {
		case err != nil:
			return err
		case final:
			return nil
		case closed:
			return errClosed
		}
	}
}

func (e *Engine) abort(s *seq) {
	select {
	case e.events <- event{kind: evAbort, seq: s}:
	case <-e.done:
	}
}

// Sleep puts the engine to sleep: level 1 offloads the weights, level 2
// also discards the KV cache (the prefix and encoder caches are emptied). A sleeping
// engine refuses Generate with FailedPrecondition. The engine must be idle:
// with requests in flight Sleep fails with FailedPrecondition (drain first).
func (e *Engine) Sleep(ctx context.Context, level int) (stagepb.SleepState, error) {
	if _, err := stagepb.SleepStateForLevel(level); err != nil {
		return e.Snapshot().SleepState, invalidArgument("sim: " + err.Error())
	}
	return e.control(ctx, event{kind: evSleep, level: level})
}

// WakeUp restores a sleeping engine; waking an awake one is a no-op.
func (e *Engine) WakeUp(ctx context.Context) (stagepb.SleepState, error) {
	return e.control(ctx, event{kind: evWake})
}

func (e *Engine) control(ctx context.Context, ev event) (stagepb.SleepState, error) {
	ev.reply = make(chan sleepReply, 1)
	select {
	case e.events <- ev:
	case <-ctx.Done():
		return e.Snapshot().SleepState, ctx.Err()
	case <-e.done:
		return e.Snapshot().SleepState, errClosed
	}
	r := <-ev.reply // the loop answers every control event it receives
	return r.state, r.err
}

// Health reports the engine's state; Status is SERVING unless closed.
func (e *Engine) Health() *stagepb.HealthResponse {
	s := e.Snapshot()
	st := stagepb.ServingStatus_SERVING_STATUS_SERVING
	if s.Closed {
		st = stagepb.ServingStatus_SERVING_STATUS_NOT_SERVING
	}
	return &stagepb.HealthResponse{
		Status:               st,
		SleepState:           s.SleepState,
		Engine:               EngineName,
		Role:                 e.cfg.Role,
		InputRole:            e.inputRole(),
		ContinuesChat:        e.cfg.Role == stagepb.RoleText, // it reads the continuation after the rendered chat
		InputParts:           e.inputParts(),
		NumSpeculativeTokens: uint32(e.cfg.NumSpeculativeTokens),
		CacheConfig: &stagepb.CacheConfig{
			BlockSize:           uint32(e.cfg.BlockSize),
			NumKvBlocks:         uint32(e.cfg.NumKVBlocks),
			EnablePrefixCaching: !e.cfg.DisablePrefixCaching,
			MaxNumSeqs:          uint32(e.cfg.MaxNumSeqs),
			KvEvents:            !e.cfg.DisablePrefixCaching,
		},
		Gauges: &stagepb.EngineStats{
			NumRequestsRunning:         uint32(s.Running),
			NumRequestsWaitingCapacity: uint32(s.WaitingCapacity),
			NumRequestsWaitingDeferred: uint32(s.WaitingDeferred),
			KvCacheUsagePerc:           s.KVCacheUsage(),
		},
	}
}

// loop is the scheduler goroutine: it owns sc and the sleep state.
func (e *Engine) loop(sc *scheduler) {
	defer close(e.done)
	sleep := stagepb.SleepState_SLEEP_STATE_AWAKE
	publish := func() {
		s := sc.snapshot()
		s.SleepState = sleep
		e.snap.Store(&s)
	}
	handle := func(ev event) {
		var reply sleepReply
		switch ev.kind {
		case evSubmit:
			if sleep != stagepb.SleepState_SLEEP_STATE_AWAKE {
				ev.seq.box.fail(status.Errorf(codes.FailedPrecondition, "engine is asleep (%s); wake it up first", sleep.Name()))
				return
			}
			sc.add(ev.seq, time.Now())
		case evAbort:
			sc.abort(ev.seq)
		case evSleep:
			if n := sc.inFlight(); n > 0 {
				reply.err = status.Errorf(codes.FailedPrecondition, "cannot sleep with %d requests in flight; drain first", n)
				break
			}
			sleep, _ = stagepb.SleepStateForLevel(ev.level) // Sleep checked the level
			if sleep == stagepb.SleepState_SLEEP_STATE_DISCARD_ALL {
				sc.pool.reset()
				sc.encoder.clear()
			}
			e.cfg.Logger.Info("sim: engine asleep", "sleep_state", sleep.Name())
		case evWatch:
			if sc.pool.events.watchers == nil {
				sc.pool.events.watchers = map[*cacheWatcher]struct{}{}
			}
			ev.watch.fn(sc.pool.events.snapshot(sc.pool.cached))
			sc.pool.events.watchers[ev.watch] = struct{}{}
			close(ev.done)
			return
		case evUnwatch:
			delete(sc.pool.events.watchers, ev.watch)
			close(ev.done)
			return
		case evWake:
			if sleep != stagepb.SleepState_SLEEP_STATE_AWAKE {
				e.cfg.Logger.Info("sim: engine awake")
			}
			sleep = stagepb.SleepState_SLEEP_STATE_AWAKE
		}
		publish() // before replying, so the caller sees its change in Health
		if ev.reply != nil {
			reply.state = sleep
			ev.reply <- reply
		}
	}
	shutdown := func() {
		sc.failAll(errClosed)
		publish()
		s := *e.snap.Load()
		s.Closed = true
		e.snap.Store(&s)
	}
	timer := time.NewTimer(0)
	<-timer.C
	defer timer.Stop()
	for {
		if !sc.busy() {
			select {
			case ev := <-e.events:
				handle(ev)
			case <-e.quit:
				shutdown()
				return
			}
			continue
		}
		// Take whatever arrived, without waiting, before the next step.
		for drained := false; !drained; {
			select {
			case ev := <-e.events:
				handle(ev)
			case <-e.quit:
				shutdown()
				return
			default:
				drained = true
			}
		}
		if !sc.busy() {
			continue
		}
		b := sc.schedule(time.Now())
		publish()
		if d := e.stepDuration(b); d > 0 {
			timer.Reset(d)
		wait:
			for {
				select {
				case <-timer.C:
					break wait
				case ev := <-e.events:
					handle(ev)
				case <-e.quit:
					shutdown()
					return
				}
			}
		}
		for _, o := range sc.complete(b, time.Now()) {
			o.seq.box.push(o.chunk, o.final)
		}
		publish()
	}
}

// WatchCache calls fn with a snapshot of the prefix cache (a KvEvents with
// Snapshot and Cleared set, Seq that of the last report it includes), then
// with every report the engine makes (the KvEvents its chunks carry), in
// seq order, until stop is called. fn runs on the scheduler goroutine: it
// must not block, and must not modify the reports (they are shared). An
// engine without prefix caching never reports: fn gets the empty snapshot
// only. It fails when ctx ends or the engine is closed first.
func (e *Engine) WatchCache(ctx context.Context, fn func(*stagepb.KvEvents)) (stop func(), err error) {
	w := &cacheWatcher{fn: fn}
	if err := e.send(ctx, event{kind: evWatch, watch: w, done: make(chan struct{})}); err != nil {
		return nil, err
	}
	return func() { _ = e.send(context.Background(), event{kind: evUnwatch, watch: w, done: make(chan struct{})}) }, nil
}

// send hands ev to the loop and waits until it is handled.
func (e *Engine) send(ctx context.Context, ev event) error {
	select {
	case e.events <- ev:
	case <-ctx.Done():
		return ctx.Err()
	case <-e.done:
		return errClosed
	}
	select {
	case <-ev.done:
		return nil
	case <-e.done:
		return errClosed
	}
}

// stepDuration is how long a step takes: its prefill tokens at the prefill
// throughput, plus one decode latency if it decodes anything, plus the
// encoding of the media parts it missed in the encoder cache.
func (e *Engine) stepDuration(b *batch) time.Duration {
	var d time.Duration
	if b.prefillTokens > 0 && e.cfg.PrefillTokensPerSec > 0 {
		d += time.Duration(float64(b.prefillTokens) / e.cfg.PrefillTokensPerSec * float64(time.Second))
	}
	if b.decodeTokens > 0 {
		d += e.cfg.DecodeTokenLatency
	}
	if b.decodeTokens > 0 || b.prefillTokens > 0 {
		d += time.Duration(e.slowdown.Load())
	}
	d += time.Duration(b.encodeBytes) * e.cfg.EncodeTimePerKiB / 1024
	return d
}

// mailbox carries one request's chunks from the loop to its Generate call
// without ever blocking the loop. The loop pushes; Generate takes.
type mailbox struct {
	mu     sync.Mutex
	chunks []*stagepb.GenerateChunk
	final  bool
	err    error
	notify chan struct{} // buffered 1: "something changed"
}

func newMailbox() *mailbox { return &mailbox{notify: make(chan struct{}, 1)} }

func (m *mailbox) push(c *stagepb.GenerateChunk, final bool) {
	m.mu.Lock()
	m.chunks = append(m.chunks, c)
	m.final = m.final || final
	m.mu.Unlock()
	m.signal()
}

func (m *mailbox) fail(err error) {
	m.mu.Lock()
	if m.err == nil {
		m.err = err
	}
	m.mu.Unlock()
	m.signal()
}

func (m *mailbox) signal() {
	select {
	case m.notify <- struct{}{}:
	default:
	}
}

// take returns the chunks pushed since the last take.
func (m *mailbox) take() (chunks []*stagepb.GenerateChunk, final bool, err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	chunks, m.chunks = m.chunks, nil
	return chunks, m.final, m.err
}

// ContinuesInput reports whether the engine can take a streamed input in
// segments, each with the earlier input as context (worker.Continuer): the
// codes and audio roles can, since each output depends only on the input
// before it; the text role needs its whole prompt.
func (e *Engine) ContinuesInput() bool { return e.cfg.Role != stagepb.RoleText }

// inputParts are the media kinds the engine takes, with their bytes: a
// text-in role all of them (see MediaTokens) unless Config.TextOnly, a
// speech recognizer audio, codes none.
func (e *Engine) inputParts() []string {
	switch e.inputRole() {
	case stagepb.RoleAudio:
		return []string{stagepb.PartAudio}
	case stagepb.RoleText:
		if e.cfg.TextOnly {
			return nil
		}
		return mediaParts
	}
	return nil
}

// inputRole is what the engine takes: Config.InputRole, or what its role
// takes.
func (e *Engine) inputRole() string {
	if e.cfg.InputRole != "" {
		return e.cfg.InputRole
	}
	return stagepb.InputRoleOf(e.cfg.Role)
}
