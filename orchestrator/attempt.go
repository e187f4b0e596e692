package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	grpccodes "google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/internal/core/stats"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/telemetry"
)

// stageRun is one stage of a request as the attempt loop runs it: every
// stage, of a sequential or a streamed request, is one.
type stageRun struct {
	req   Request
	stage int
	n     int // stages the request runs
	// in is the stage's request: sent as a Generate, which a migration
	// continues; or, for a stage fed by the stage before (input not nil),
	// the header of its GenerateStream, which the first piece completes.
	in *stagepb.GenerateRequest
	// input is the input log of a stage fed by the stage before while both
	// run (the later stages of a streamed request); nil otherwise.
	input *stageInput
	route *router.Request // what the stage is routed on
	// forward passes the stage's output on, to the client or the next
	// stage; nil when nobody reads it before the stage ends.
	forward forwarder
	// flush, when not nil, is Request.Flush for a stage whose output the
	// client reads: the attempt reads ahead and flushes when it waits.
	flush func() error
	// streamed: a stage of a streamed request, whose attempt spans mark
	// the first output forwarded.
	streamed bool
	// audioToClient: the stage's audio goes to the client as it is made
	// (Request.OnAudio), so the attempt keeps none of it: the head holds
	// no copy of a streamed answer's audio, only its length.
	audioToClient bool
	// gate, on a stage that admits to deadlines, stops the stage at its
	// target when its first output has not come (firstGate); nil: none.
	gate *firstGate
	// tensorsOut, on a stage whose tensors go to the next stage, is where
	// the next stage's attempt is; tensorsIn, on a stage that takes them,
	// is where its attempts say they are (tensors.go).
	tensorsOut, tensorsIn *tensorRoute
}

// forwarder passes the new part of an output chunk on (to the client, or to
// the next stage). visible reports whether stage 0's text reached the
// client, after which the attempt is not retried but migrated. Audio that
// reached the client does not count: a later stage's output is a pure
// function of its input and seed, so a retry on another replica skips
// what was delivered (outputCursor) and the client hears every sample
// once.
type forwarder func(o output) (visible bool, err error)

// output is what an attempt forwards of one chunk: its output less what an
// earlier attempt of the stage already forwarded.
type output struct {
	text       string
	codes      []uint32
	pcm        []byte
	sampleRate int
}

// stageOutput accumulates one stage attempt's output.
type stageOutput struct {
	text             strings.Builder
	codes            []uint32
	pcm              []byte // empty when the audio went to the client (stageRun.audioToClient)
	pcmBytes         int    // the audio's length, kept or not
	sampleRate       int
	finish           string
	promptTokens     int
	generationTokens int
	computedTokens   int // prompt tokens the engine computed (not cache hits)
	media            MediaTokens
}

// stageTrail is what a stage's attempts leave to the next attempt.
type stageTrail struct {
	in        *stagepb.GenerateRequest // the next attempt's request: stageRun.in, or the continuation after a migration
	delivered outputCursor             // the output every attempt so far forwarded
	movedAt   outputCursor             // delivered at the latest migration: the continuation's output comes after it
	moved     migrated                 // what failed replicas gave the client before a migration
	rtfMoves  int                      // moves of the stream for falling behind real time (behind)
}

const maxAttempts = 2

// maxDrainRefusals bounds the extra attempts a stage may take past
// replicas that refused it because they drain (refusedDraining): such a
// refusal is not an attempt, but a stage whose every replica drains must
// still fail in bounded time.
const maxDrainRefusals = 8

// refusedDraining says whether an attempt's failure is a draining
// replica's refusal of a call it never started (stagepb.ReasonDraining).
// The stage then tries another replica without counting an attempt: in a
// rollout or a leave storm many replicas refuse before the heads learn
// from etcd that they drain, and each refusal costs only a round trip.
func refusedDraining(ctx context.Context, err error, produced bool) bool {
	return !produced && ctx.Err() == nil && stagepb.ErrorReason(err) == stagepb.ReasonDraining
}

// runStage runs one stage of a request: the one attempt loop of every
// stage, each attempt on a replica the router picks (pick). After a failed
// attempt one of two rules may go on:
//
//   - migration (migrate): a stage-0 replica that failed after its text
//     reached the client has the answer continued on another replica, up
//     to Config.MaxMigrations times;
//   - retry (retryable): any other failure is tried once more on another
//     replica, unless text already reached the client (forwarder), the
//     client's own context ended or its output could not be delivered
//     (errNotDelivered), or the input was refused.
//
// A draining replica's refusal (refusedDraining) is neither: the next
// replica is tried as if the refused one had not been picked, up to
// maxDrainRefusals times.
//
// A retry re-drives the stage from its start and skips the output earlier
// attempts forwarded (outputCursor), so neither the client nor the next
// stage gets anything twice; a continuation makes only what follows the
// delivered text, so it skips nothing of its own.
func (h *Head) runStage(ctx context.Context, sr *stageRun) (*stageOutput, error) {
	tr := &stageTrail{in: sr.in}
	var failed []*router.Replica
	var lastErr error
	refusals := 0
	for n := 1; n <= maxAttempts+tr.moved.count+tr.rtfMoves+refusals; n++ {
		d, err := h.pick(sr, h.excluded(sr, tr, failed), lastErr)
		if err != nil {
			return nil, err
		}
		a := h.newAttempt(sr, tr, d, n)
		out, err := h.attempt(ctx, a)
		if err == nil {
			return tr.moved.prepend(out), nil
		}
		failed = append(failed, d.Replica)
		if a.refused { // its Done marked the replica draining
			if refusals < maxDrainRefusals {
				refusals++
				lastErr = err
				continue
			}
		}
		finished, ok, err := h.migrate(ctx, sr, tr, a, failed, err)
		lastErr = err
		// A producer of tensors is retried from its start even after its
		// text reached the client: its next stage needs every tensor again
		// (a continuation would make only the rest), and the retry skips
		// what was delivered.
		produced := a.produced && sr.tensorsOut == nil
		if ok {
			if finished != nil {
				return finished, nil
			}
		} else if !retryable(ctx, err, produced) {
			return nil, err
		}
	}
	return nil, lastErr
}

// excluded is what the stage's next attempt must not go to: the replicas
// that failed, and after a migration of a chat answer, those that cannot
// continue one (EngineInfo.ContinuesChat).
func (h *Head) excluded(sr *stageRun, tr *stageTrail, failed []*router.Replica) []*router.Replica {
	if tr.moved.count == 0 || sr.in.GetChat() == nil {
		return failed
	}
	out := slices.Clone(failed)
	for r := range h.router.Snapshot().Stage(sr.stage).All() {
		if !r.Engine.ContinuesChat {
			out = append(out, r)
		}
	}
	return out
}

// pick chooses the replica of a stage's next attempt, none of those that
// failed, and counts the decision. When none is left the stage fails with
// the last attempt's error, or ErrNoReplica before any attempt.
func (h *Head) pick(sr *stageRun, failed []*router.Replica, lastErr error) (router.Decision, error) {
	h.setDeadline(sr)
	if sr.input != nil {
		sr.route.AwaitsInput = !sr.input.started()
	}
	d, err := h.router.Pick(sr.stage, sr.route, failed)
	if err != nil {
		if lastErr != nil {
			return d, lastErr
		}
		return d, h.noReplica(sr.stage, err)
	}
	if d.Reason == router.ReasonDeadlineShed {
		if lastErr == nil {
			h.countDecision(sr.stage, d)
			return router.Decision{}, h.shed(sr, d)
		}
		// A retry is not refused: the request is under way.
		d.Reason = router.ReasonLoadFallback
	}
	h.countDecision(sr.stage, d)
	return d, nil
}

// countDecision counts a pick in troupe_router_decisions_total.
func (h *Head) countDecision(stage int, d router.Decision) {
	if int(d.Reason) >= len(router.Reasons) {
		return
	}
	if c := h.decisions[stage][d.Reason]; c != nil {
		c.Inc()
		return
	}
	h.decisionVec.WithLabelValues(strconv.Itoa(stage), d.Policy, d.Reason.String()).Inc()
}

// retryable is the retry rule of every stage attempt: a failure is tried
// once more on another replica unless text already reached the client
// (produced), the client's own context ended or its output could not be
// delivered, or the input was refused.
func retryable(ctx context.Context, err error, produced bool) bool {
	return !produced && ctx.Err() == nil && !errors.Is(err, ErrBadRequest) && !errors.Is(err, errNotDelivered) && !errors.Is(err, ErrDeadlineMissed) &&
		!errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled)
}

// migrate is the migration rule: it decides whether attempt a's failure
// continues the answer on another replica. Only a failure of a stage-0
// replica (ErrStageFailed) after text reached the client migrates, within
// Config.MaxMigrations. It adds what a gave the client to tr.moved and
// sets tr.in to the request that continues the stage's request after all
// of it; finished is the whole answer instead when what was delivered
// already reached max_tokens. ok is false when the failure does not
// migrate; so is it when no replica but those that failed could continue
// the answer, and then the error returned says so (else it is err).
func (h *Head) migrate(ctx context.Context, sr *stageRun, tr *stageTrail, a *attemptRun, failed []*router.Replica, err error) (finished *stageOutput, ok bool, _ error) {
	if sr.stage != 0 || !a.produced || tr.moved.count >= h.cfg.MaxMigrations || ctx.Err() != nil || !errors.Is(err, ErrStageFailed) || sr.tensorsOut != nil {
		return nil, false, err
	}
	if !anyReplica(h.router.Snapshot().Stage(sr.stage), func(r *router.Replica) bool {
		return !slices.Contains(failed, r) && (sr.in.GetChat() == nil || r.Engine.ContinuesChat)
	}) {
		msg := "stage failed"
		if e := (*Error)(nil); errors.As(err, &e) {
			msg = e.Message
		}
		return nil, false, newError(ErrStageFailed, err, "%s; the answer cannot be continued: no other replica of stage %q can continue it", msg, a.name)
	}
	m := &tr.moved
	m.count++
	m.text += a.gotText()
	m.tokens += a.gotTokens
	next, done := m.continuation(sr.in)
	if done {
		return m.prepend(&stageOutput{finish: stagepb.FinishReason_FINISH_REASON_LENGTH.Name()}), true, err
	}
	h.log.Warn("orchestrator: replica failed after text reached the client; continuing the answer on another replica",
		"stage", h.cfg.Pipeline.Stages[sr.stage].Name, "replica", a.rep.Key.Replica, "delivered_chars", len(m.text), "err", err)
	tr.in, tr.movedAt = next, tr.delivered
	return nil, true, err
}

// migrated is the part of an answer that replicas which then failed had
// already delivered to the client.
type migrated struct {
	count  int // migrations so far
	text   string
	tokens int
}

// continuation is the request that continues the answer after what was
// delivered: the same input, the delivered text as the continuation, and
// what is left of max_tokens. done reports that nothing is left.
func (m migrated) continuation(in *stagepb.GenerateRequest) (next *stagepb.GenerateRequest, done bool) {
	next = proto.Clone(in).(*stagepb.GenerateRequest)
	next.Continuation = m.text
	if sp := next.GetSampling(); sp != nil && sp.GetMaxTokens() > 0 {
		if int(sp.GetMaxTokens()) <= m.tokens {
			return nil, true
		}
		sp.MaxTokens -= uint32(m.tokens)
	}
	return next, false
}

// prepend puts the delivered part in front of the continuation's output,
// so the result is the whole answer the client saw.
func (m migrated) prepend(out *stageOutput) *stageOutput {
	if m.count == 0 {
		return out
	}
	whole := m.text + out.text.String()
	out.text.Reset()
	out.text.WriteString(whole)
	out.generationTokens += m.tokens
	return out
}

// outputCursor counts the output units a stage has forwarded: text bytes,
// codes and PCM bytes. A retried attempt skips what an earlier one
// forwarded, so nothing is delivered twice.
type outputCursor struct{ text, codes, pcm int }

// cut removes from c's output the units still to skip and returns the rest.
func (s *outputCursor) cut(c *stagepb.GenerateChunk) (text string, codes []uint32, pcm []byte) {
	text, codes, pcm = c.GetText(), c.GetCodes(), c.GetAudioPcm16()
	n := min(s.text, len(text))
	text, s.text = text[n:], s.text-n
	n = min(s.codes, len(codes))
	codes, s.codes = codes[n:], s.codes-n
	n = min(s.pcm, len(pcm))
	pcm, s.pcm = pcm[n:], s.pcm-n
	return text, codes, pcm
}

// attemptRun is one attempt of a stage on the replica the router picked:
// what the pieces of attempt share.
type attemptRun struct {
	sr     *stageRun
	tr     *stageTrail
	d      router.Decision
	rep    *router.Replica
	name   string                   // the stage's
	number int                      // 1 for a stage's first attempt
	in     *stagepb.GenerateRequest // tr.in when the attempt started
	skip   outputCursor             // what earlier attempts forwarded and this one must not
	// The text this attempt gave the client is out.text[skipped:][:gotBytes]:
	// counted, not copied (gotText).
	skipped   int // text bytes at the start of the attempt's output that an earlier attempt delivered
	gotBytes  int
	gotTokens int
	produced  bool // text reached the client: a retry would repeat it
	refused   bool // a draining replica refused the call before it ran (refusedDraining)
	fault     bool // the attempt failed through the replica: it feeds the circuit breaker

	span      trace.Span
	recording bool // as in Execute: no attribute work when unsampled
	out       *stageOutput
	fin       stats.Finished
	start     time.Time
	last      time.Time // of the latest output
	// arrived is when the attempt's first output reached the head (its
	// chunk's arrival; a held chunk's outputs are dated earlier): when
	// the client or the next stage can have it.
	arrived time.Time
	// call is the attempt's hold on its replica (router.Router.Begin):
	// its outcome goes back through call.Done, once.
	call *router.Call
	// wait is how long a fed stage's input sender waited for input (behind).
	wait inputWait
	// stopped: the stage's first output missed its target (Head.missed).
	stopped bool
	// tensorBytes: what the attempt's chunks sent worker to worker.
	tensorBytes uint64
}

// newAttempt is attempt number of sr on the replica d chose.
func (h *Head) newAttempt(sr *stageRun, tr *stageTrail, d router.Decision, number int) *attemptRun {
	// A retry skips what earlier attempts forwarded; a continuation makes
	// only what follows, so it skips nothing of its own.
	done, at := tr.delivered, tr.movedAt
	skip := outputCursor{text: done.text - at.text, codes: done.codes - at.codes, pcm: done.pcm - at.pcm}
	return &attemptRun{sr: sr, tr: tr, d: d, rep: d.Replica, name: h.cfg.Pipeline.Stages[sr.stage].Name, number: number, in: tr.in,
		skip: skip, skipped: skip.text}
}

// gotText is the text this attempt gave the client.
func (a *attemptRun) gotText() string {
	return a.out.text.String()[a.skipped:][:a.gotBytes]
}

// attempt runs a stage on the replica the router chose: open the call,
// receive its chunks, account and forward each, and classify the end.
// a.produced reports whether any output reached the client.
//
// The attempt fails with errStalled when, once it has started to work, it
// makes no progress for the stall timeout: no chunk received, and no input
// sent. Time spent waiting for the reader of its output (forwarding,
// flushing to the client) or for input not yet made does not count
// (stallWatch).
func (h *Head) attempt(ctx context.Context, a *attemptRun) (_ *stageOutput, err error) {
	parent := ctx
	ctx = h.startAttemptSpan(ctx, a)
	defer a.span.End()
	ctx, cancel := context.WithCancelCause(ctx)
	wait := func() {}
	defer func() { cancel(context.Canceled); wait() }()
	stall := newStallWatch(h.cfg.StallTimeout, cancel, a.replicaAlive,
		func(d time.Duration) bool { return a.call.Answers(ctx, d, h.callOptions()...) })
	defer stall.stop()
	defer a.sr.gate.arm(cancel)()

	a.call = h.router.Begin(a.d, a.sr.input != nil && !a.sr.input.started(), cancel)
	h.startAccounting(a)
	defer func() {
		a.refused = refusedDraining(parent, err, a.produced)
		h.finishAttempt(a, err)
	}()

	stream, w, err := h.open(ctx, a, stall)
	wait = w
	if err != nil {
		return nil, h.stageError(ctx, a, err)
	}
	recv, w := readFrom(ctx, stream, w, stall.whilePaused(a.sr.flush))
	wait = w
	if err := h.receive(ctx, a, recv, stall); err != nil {
		return nil, err
	}
	return a.ended(ctx)
}

// startAttemptSpan starts the attempt's span, with its attributes when it
// records.
func (h *Head) startAttemptSpan(ctx context.Context, a *attemptRun) context.Context {
	ctx, a.span = h.tracer.Start(ctx, h.stageSpans[a.sr.stage], internalSpan)
	a.recording = a.span.IsRecording()
	if a.recording {
		d := a.d
		a.span.SetAttributes(telemetry.StageAttributes(a.sr.stage, a.name, uint64(a.rep.Key.Replica), a.rep.EngineIndex, a.number)...)
		a.span.SetAttributes(telemetry.RouteAttributes(d.Policy, d.Reason.String(), d.PrefixSource, d.MatchBlocks, d.InputBlocks)...)
		a.span.SetAttributes(requestAttributes(Request{Operation: a.sr.req.Operation, Sampling: a.sampling()}, h.cfg.Pipeline.Model)...)
	}
	return ctx
}

// replicaAlive is when the attempt's replica last showed this head that
// it works, on any of its requests.
func (a *attemptRun) replicaAlive() time.Time { return a.call.Alive() }

// sampling is what the attempt reports of its sampling parameters (span
// attributes, stats): its request's, or for a stage fed by the stage
// before, the client's.
func (a *attemptRun) sampling() *stagepb.SamplingParams {
	if a.sr.input != nil {
		return a.sr.req.Sampling
	}
	return a.in.GetSampling()
}

// stallWatch cancels an attempt that makes no progress for the stall
// timeout. Its clock starts with the first sign of work (a chunk, or input
// sent to a streamed stage). Before it a replica may rightly be busy for
// long (a queue, the prefill of a huge prompt), so an attempt still waiting
// for its first sign of work fails only when the replica, silent on every
// request for the stall timeout, also leaves a Health call unanswered
// (probe): a frozen replica releases its attempts within the stall
// timeout, not its lease's TTL, and a busy one keeps them.
//
// The clock measures the replica only: it stands while the attempt waits
// for whoever reads its output (the client, or the next stage's input
// window) and while a fed stage's sender waits for input the stage before
// has not made yet, and restarts in full when the wait ends. A replica
// that is not read cannot send, and one that is not fed cannot go on:
// that is the client's or the stage before's doing, never the replica's.
//
// And it measures the replica, not the request: when the clock runs out
// the attempt fails only if the replica also showed no sign of life for
// the stall timeout (alive: attemptRun.replicaAlive, the latest frame or
// chunk of any of its requests). A replica that goes on answering
// other requests while this one makes no progress is loaded, not frozen:
// the request was preempted (its KV blocks taken back until others end)
// or waits in the engine's queue, and another replica would do no better.
// Such a request waits, as long as its deadline allows; one that a live
// replica never serves again is not caught by the stall timeout.
// Safe for concurrent use (the delivery loop and the input sender both
// pause it).
type stallWatch struct {
	mu      sync.Mutex
	timer   *time.Timer
	timeout time.Duration
	cancel  context.CancelCauseFunc
	alive   func() time.Time // when the replica last showed life; nil: never asked
	// probe asks the replica for Health within the given time, before its
	// first sign of work: whether it answered.
	probe   func(time.Duration) bool
	since   time.Time // when the clock last (re)started
	started bool      // the replica has shown work: the clock runs
	waits   int       // waits on others under way: the clock stands
	stopped bool      // the attempt ended: nothing restarts the clock
}

func newStallWatch(timeout time.Duration, cancel context.CancelCauseFunc, alive func() time.Time, probe func(time.Duration) bool) *stallWatch {
	s := &stallWatch{timeout: timeout, cancel: cancel, alive: alive, probe: probe, since: time.Now()}
	s.timer = time.AfterFunc(timeout-probeWindow(timeout), s.fire)
	return s
}

// probeWindow is how long, of the stall timeout, a Health probe before
// the first sign of work may take: the probe starts that long before the
// timeout, so a frozen replica is given up within it.
func probeWindow(timeout time.Duration) time.Duration { return min(timeout/4, time.Second) }

// fire is the clock running out: the attempt is cancelled with errStalled
// unless the clock was restarted or stopped meanwhile (a timer that fires
// as it is reset) or the replica showed life within the stall timeout;
// then the clock is set to run out a stall timeout after the later of
// the two. Before the first sign of work it probes the replica instead
// (waiting).
func (s *stallWatch) fire() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopped {
		return
	}
	if !s.started {
		s.waiting()
		return
	}
	if s.waits > 0 {
		return
	}
	last := s.since
	if s.alive != nil {
		if at := s.alive(); at.After(last) {
			last = at
		}
	}
	if left := s.timeout - time.Since(last); left > 0 {
		s.timer.Reset(left)
		return
	}
	s.cancel(errStalled)
}

// waiting is fire before the attempt's first sign of work, s.mu held: a
// replica heard from within the stall timeout, or an attempt waiting on
// its input, is looked at again a stall timeout later; a silent replica is
// probed, off the lock, and the attempt fails as stalled unless it
// answers or the attempt made progress meanwhile.
func (s *stallWatch) waiting() {
	window := probeWindow(s.timeout)
	again := s.timeout - window
	if s.waits > 0 || s.probe == nil || (s.alive != nil && time.Since(s.alive()) < s.timeout) {
		s.timer.Reset(again)
		return
	}
	probe := s.probe // stop clears it
	s.mu.Unlock()
	answered := probe(window)
	s.mu.Lock()
	switch {
	case s.stopped || s.started:
	case answered:
		s.timer.Reset(again)
	default:
		s.cancel(errStalled)
	}
}

// restartLocked starts the clock in full.
func (s *stallWatch) restartLocked() {
	s.since = time.Now()
	s.timer.Reset(s.timeout)
}

// progress (re)starts the clock, unless the attempt waits on others.
func (s *stallWatch) progress() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.started = true
	if s.waits == 0 && !s.stopped {
		s.restartLocked()
	}
}

// pause stops the clock while the attempt waits on its reader or its
// input; every pause is followed by a resume.
func (s *stallWatch) pause() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.waits++
	s.timer.Stop()
}

// resume restarts the clock, in full, when the last wait ends.
func (s *stallWatch) resume() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.waits--
	switch {
	case s.waits > 0 || s.stopped:
	case s.started:
		s.restartLocked()
	default:
		s.timer.Reset(s.timeout - probeWindow(s.timeout)) // still waiting for its first sign of work
	}
}

// stop stops the clock for good: the input sender may still report
// progress or end a wait while the attempt winds down.
func (s *stallWatch) stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stopped = true
	s.timer.Stop()
	// The runtime may keep a stopped timer until its time comes; without
	// these the attempt (its call, its output) would stay as long.
	s.cancel, s.alive, s.probe = nil, nil, nil
}

// whilePaused is flush with the clock stopped while it runs: a flush waits
// for the client. nil stays nil.
func (s *stallWatch) whilePaused(flush func() error) func() error {
	if flush == nil {
		return nil
	}
	return func() error {
		s.pause()
		defer s.resume()
		return flush()
	}
}

// Causes of a stage attempt cancelled by the head, not by the client: both
// are stage failures, retried under the usual rule.
var (
	errStalled = errors.New("orchestrator: no progress within the stall timeout")
	// errReplicaGone: the replica's record went away and it does not
	// answer Health.
	errReplicaGone = errors.New("orchestrator: replica left and does not answer")
)

// startAccounting starts the attempt's record for the stats: failed until
// a finish reason comes.
func (h *Head) startAccounting(a *attemptRun) {
	a.out = &stageOutput{}
	// troupe runs one sequence per request (the API refuses n != 1), so n
	// is 1 for every stage request.
	a.fin = stats.Finished{Reason: stagepb.FinishReason_FINISH_REASON_ERROR, MaxTokensParam: int(a.sampling().GetMaxTokens()), N: 1}
	if sc := a.span.SpanContext(); sc.IsSampled() {
		a.fin.TraceID = sc.TraceID().String()
	}
	a.start = time.Now()
}

// finishAttempt records the ended attempt in the stats and on its span,
// and reports its outcome through its call.
func (h *Head) finishAttempt(a *attemptRun, err error) {
	out, fin := a.out, &a.fin
	fin.E2E = time.Since(a.start)
	fin.PromptTokens, fin.GenerationTokens = out.promptTokens, out.generationTokens
	fin.PrefillComputedTokens = out.computedTokens
	h.logOutcome(a, err, a.call.Done(h.outcome(a, err)))
	if rerr := h.stats.RecordFinished(a.rep.EngineIndex, *fin); rerr != nil {
		h.log.Debug("orchestrator: record finished", "err", rerr)
	}
	if a.recording {
		if a.tensorBytes > 0 {
			a.span.SetAttributes(telemetry.KeyTensorBytes.Int64(int64(a.tensorBytes)))
		}
		a.span.SetAttributes(telemetry.GenAIUsageAttributes(int64(out.promptTokens), int64(out.generationTokens), fin.Reason.Name())...)
		a.span.AddEvent("finish", trace.WithAttributes(attribute.String("finish_reason", fin.Reason.Name())))
	}
	if err != nil {
		a.span.RecordError(err)
		a.span.SetStatus(codes.Error, err.Error())
	}
}

// open starts the attempt's call: a GenerateStream fed from the stage's
// input log (see openStreamed), or a Generate of the attempt's request.
// wait, called after ctx is cancelled, waits for whatever goroutine the
// call started. The input sender of a fed stage reports to stall.
func (h *Head) open(ctx context.Context, a *attemptRun, stall *stallWatch) (stream chunkStream, wait func(), err error) {
	if a.sr.tensorsOut != nil {
		return h.openProducer(ctx, a)
	}
	if a.sr.input != nil {
		return h.openStreamed(ctx, a, stall)
	}
	if a.tr.moved.count > 0 {
		a.span.SetAttributes(attribute.Bool("troupe.migration", true), attribute.Int("troupe.migration.delivered_chars", len(a.tr.moved.text)))
	}
	// The pick's head-side blocks go with the request, for its worker to
	// tell every head (routed-block reports); an earlier attempt's go.
	// Attempts of a stage run one after another, and a call has sent its
	// request before openGenerate returns, so no send reads the field.
	a.in.RoutedBlocks = a.d.RoutedBlocks
	return h.openGenerate(ctx, a.rep, a.in)
}

// openGenerate starts req on rep as a Generate call.
func (h *Head) openGenerate(ctx context.Context, rep *router.Replica, req *stagepb.GenerateRequest) (chunkStream, func(), error) {
	stream, err := rep.Client.Generate(ctx, req, h.callOptions()...)
	return stream, func() {}, err
}

// callOptions set the gRPC message limits of a call to a replica (gRPC's
// default would stop at 4 MiB received).
func (h *Head) callOptions() []grpc.CallOption { return h.calls }

// readFrom is how the attempt receives from stream, whose wait is wait:
// straight from it, or, when the client reads the output (flush not nil),
// through a read-ahead that flushes whenever no chunk is at hand. The
// returned wait waits for the stream's goroutines and the read-ahead's.
func readFrom(ctx context.Context, stream chunkStream, wait func(), flush func() error) (recv func() (*stagepb.GenerateChunk, error), _ func()) {
	if flush == nil {
		return stream.Recv, wait
	}
	ra := startReadAhead(ctx, stream)
	// The read-ahead's Recv ends first: the call's wait runs only once
	// nothing reads it.
	return func() (*stagepb.GenerateChunk, error) { return ra.next(ctx, flush) },
		func() { <-ra.done; wait() }
}

// receive reads the attempt's chunks until its stream ends: each one
// counts as progress, is accounted, and its output is kept and forwarded.
// The stall clock stands while a chunk is forwarded: that waits for the
// reader, not the replica.
func (h *Head) receive(ctx context.Context, a *attemptRun, recv func() (*stagepb.GenerateChunk, error), stall *stallWatch) error {
	for {
		chunk, err := recv()
		if err == io.EOF {
			return nil
		}
		if errors.Is(err, errNotFlushed) {
			a.fin.Reason = stagepb.FinishReason_FINISH_REASON_ABORT
			return fmt.Errorf("orchestrator: stage %q: %w: %w", a.name, errNotDelivered, err)
		}
		if err != nil {
			return h.stageError(ctx, a, err)
		}
		stall.progress()
		h.account(a, chunk)
		if stagepb.HasOutput(chunk) {
			if a.last.IsZero() {
				if !a.sr.gate.serve() {
					return h.missed(a)
				}
				a.arrived = time.Now()
			}
			a.dateOutputs(chunk)
			a.keep(chunk)
			if a.sr.forward != nil {
				stall.pause()
				err := a.forward(chunk)
				stall.resume()
				if err != nil {
					a.fin.Reason = stagepb.FinishReason_FINISH_REASON_ABORT
					return fmt.Errorf("orchestrator: stage %q: %w: %w", a.name, errNotDelivered, err)
				}
			}
			if len(chunk.GetAudioPcm16()) > 0 && h.behind(a) {
				return fmt.Errorf("orchestrator: stage %q: replica %d: %w", a.name, a.rep.Key.Replica, errBehindRealTime)
			}
		}
		a.finishedBy(chunk)
	}
}

// account applies what a chunk tells of the replica: its KV events and
// load to the router (through the attempt's call), its stats to the stat
// logger, and the attempt's token counts.
func (h *Head) account(a *attemptRun, chunk *stagepb.GenerateChunk) {
	a.call.Chunk(chunk)
	a.tensorBytes += chunk.GetTensorBytes()
	s := chunk.GetStats()
	if s == nil {
		return
	}
	if err := h.stats.Record(a.rep.EngineIndex, s); err != nil {
		h.log.Debug("orchestrator: record stats", "err", err)
	}
	a.out.promptTokens += int(s.GetPromptTokens())
	a.out.generationTokens += int(s.GetGenerationTokens())
	a.out.computedTokens += int(s.GetPromptTokensLocalCompute())
	a.out.media.add(s)
}

// dateOutputs dates a chunk's outputs for time to first token and the
// inter-token latencies: a chunk of held output dates each of its outputs
// by its age; any other chunk is one output, made about now.
func (a *attemptRun) dateOutputs(chunk *stagepb.GenerateChunk) {
	now := time.Now()
	ages := chunk.GetOutputAgesUs()
	for i := range max(len(ages), 1) {
		at := now
		if i < len(ages) {
			at = now.Add(-time.Duration(ages[i]) * time.Microsecond)
		}
		if a.last.IsZero() {
			a.call.FirstOutput()
			a.wait.first = int64(a.wait.total())
			a.fin.TTFT = max(at.Sub(a.start), 0)
			if a.recording {
				a.span.AddEvent("first_token", trace.WithTimestamp(at))
			}
			if len(ages) > 1 {
				a.fin.InterTokenLatencies = make([]time.Duration, 0, len(ages)-1)
			}
		} else {
			a.fin.InterTokenLatencies = append(a.fin.InterTokenLatencies, max(at.Sub(a.last), 0))
		}
		a.last = at
	}
}

// keep adds a chunk's output to the attempt's: all of it but the audio
// that goes to the client (its length only).
func (a *attemptRun) keep(chunk *stagepb.GenerateChunk) {
	out := a.out
	out.text.WriteString(chunk.GetText())
	out.codes = append(out.codes, chunk.GetCodes()...)
	pcm := chunk.GetAudioPcm16()
	out.pcmBytes += len(pcm)
	if !a.sr.audioToClient {
		out.pcm = append(out.pcm, pcm...)
	}
	if r := chunk.GetSampleRate(); r > 0 {
		out.sampleRate = int(r)
	}
}

// forward passes on the part of a chunk's output that no earlier attempt
// forwarded, and keeps count of what was forwarded and what reached the
// client (for a retry's skip and a migration).
func (a *attemptRun) forward(chunk *stagepb.GenerateChunk) error {
	text, codes, pcm := a.skip.cut(chunk)
	if text == "" && len(codes) == 0 && len(pcm) == 0 {
		return nil
	}
	d := &a.tr.delivered
	if a.sr.streamed && *d == (outputCursor{}) {
		a.span.AddEvent("first_output_forwarded")
	}
	d.text += len(text)
	d.codes += len(codes)
	d.pcm += len(pcm)
	visible, err := a.sr.forward(output{text: text, codes: codes, pcm: pcm, sampleRate: int(chunk.GetSampleRate())})
	if visible {
		a.produced = true
		if text != "" {
			a.gotBytes += len(text)
			a.gotTokens += int(chunk.GetStats().GetGenerationTokens())
		}
	}
	return err
}

// finishedBy takes the finish reason and timings of the chunk that ends
// the stage, if it is one.
func (a *attemptRun) finishedBy(chunk *stagepb.GenerateChunk) {
	r := chunk.GetFinishReason()
	if r == stagepb.FinishReason_FINISH_REASON_UNSPECIFIED {
		return
	}
	a.fin.Reason = r
	a.out.finish = r.Name()
	if t := chunk.GetTimings(); t != nil {
		a.fin.Queue = seconds(t.GetQueueSeconds())
		a.fin.Prefill = seconds(t.GetPrefillSeconds())
		a.fin.Decode = seconds(t.GetDecodeSeconds())
	}
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// ended is the attempt's result once its stream ended: its output when the
// stage finished, else a failure of the replica.
func (a *attemptRun) ended(ctx context.Context) (*stageOutput, error) {
	switch a.fin.Reason {
	case stagepb.FinishReason_FINISH_REASON_STOP, stagepb.FinishReason_FINISH_REASON_LENGTH:
		return a.out, nil
	case stagepb.FinishReason_FINISH_REASON_ABORT:
		a.fault = ctx.Err() == nil
		return nil, newError(ErrStageFailed, nil, "stage %q failed on replica %d: it aborted the request", a.name, a.rep.Key.Replica)
	default:
		a.fin.Reason = stagepb.FinishReason_FINISH_REASON_ERROR
		a.fault = ctx.Err() == nil
		return nil, newError(ErrStageFailed, nil, "stage %q failed on replica %d: it ended its stream without finishing", a.name, a.rep.Key.Replica)
	}
}

// stageError classifies a gRPC failure of attempt a and sets its finish
// reason, and its fault when the replica is to blame (router.Outcome.Fault).
func (h *Head) stageError(ctx context.Context, a *attemptRun, err error) error {
	rep := a.rep
	// gRPC enforces the request's deadline with its own timer (and the
	// worker sees it too), so DeadlineExceeded can arrive a moment before
	// ctx reports it: both mean the client's time ran out, not a failure.
	if errors.Is(context.Cause(ctx), errFirstOutputDue) {
		return h.missed(a)
	}
	if cause := context.Cause(ctx); errors.Is(cause, errStalled) || errors.Is(cause, errReplicaGone) {
		a.fin.Reason = stagepb.FinishReason_FINISH_REASON_ERROR
		a.fault = true
		what := "stopped making progress"
		if errors.Is(cause, errReplicaGone) {
			what = "left the membership and does not answer"
		}
		return newError(ErrStageFailed, fmt.Errorf("replica %d (%s): %w", rep.Key.Replica, rep.Addr, cause),
			"stage %q failed on replica %d: it %s", a.name, rep.Key.Replica, what)
	}
	_, hasDeadline := ctx.Deadline()
	if ctx.Err() != nil || (hasDeadline && status.Code(err) == grpccodes.DeadlineExceeded) {
		a.fin.Reason = stagepb.FinishReason_FINISH_REASON_ABORT
		cause := context.Cause(ctx)
		if cause == nil {
			cause = context.DeadlineExceeded
		}
		return fmt.Errorf("orchestrator: stage %q: %w", a.name, cause)
	}
	a.fin.Reason = stagepb.FinishReason_FINISH_REASON_ERROR
	e := replicaError(fmt.Sprintf("stage %q", a.name), rep.Key.Replica, rep.Addr, err)
	// A draining replica refusing new work is doing what it should.
	a.fault = errors.Is(e, ErrStageFailed) && stagepb.ErrorReason(err) != stagepb.ReasonDraining
	return e
}

// logOutcome logs and counts what the attempt's outcome did to its
// replica's circuit breaker (router.Call.Done): a success closes it, a
// fault of the replica counts towards an ejection, other failures (the
// client left, its input was refused, the next stage failed) say nothing
// about the replica.
func (h *Head) logOutcome(a *attemptRun, err error, r router.Report) {
	rep, e := a.rep, r.Ejection
	switch {
	case r.Recovered:
		h.log.Info("orchestrator: ejected replica answers again; routing to it",
			"stage", rep.StageName, "replica", rep.Key.Replica, "addr", rep.Addr)
	case e.Ejected:
		h.ejections[a.sr.stage].Inc()
		h.log.Warn("orchestrator: replica fails repeatedly; ejected from routing",
			"stage", rep.StageName, "replica", rep.Key.Replica, "addr", rep.Addr,
			"consecutive_failures", e.Failures, "backoff", e.Backoff, "err", err)
	case e.Spared && e.Failures == h.router.BreakerFailures():
		h.log.Warn("orchestrator: replica fails repeatedly but is its stage's only routable one; kept in routing",
			"stage", rep.StageName, "replica", rep.Key.Replica, "addr", rep.Addr, "err", err)
	}
}

// readAheadChunks and readAheadBytes bound what a stage whose output goes
// to the client may have received and not yet delivered: the read-ahead
// lets the head see that more output is there before it flushes, and the
// bounds keep a client that stops reading slowing the stage down (through
// gRPC's flow control) while the head holds at most this window of its
// answer. readAheadBytes counts output (text, codes, PCM) and is about
// 0.7 s of 24 kHz audio.
const (
	readAheadChunks = 16
	readAheadBytes  = 32 << 10
)

// errNotFlushed wraps the error of Request.Flush.
var errNotFlushed = errors.New("orchestrator: flush failed")

// errNotDelivered wraps a failure to pass an attempt's output on: the
// client's (onText, OnAudio, Flush failed: it left, or stayed unreadable
// past the API's write deadline), or the next stage's context ended. It
// is never the replica's fault and never retried: the request ends, as
// when the client cancels.
var errNotDelivered = errors.New("orchestrator: output not delivered")

// readAhead receives a stage attempt's chunks ahead of the loop that
// delivers them, up to readAheadChunks chunks and readAheadBytes of
// output (and the chunk that crosses it). Its goroutine ends when the
// stream does (an error, io.EOF or the attempt's context cancelled); done
// is closed then.
type readAhead struct {
	ch    chan recvResult
	done  chan struct{}
	held  atomic.Int64  // output bytes received and not yet taken by next
	taken chan struct{} // a token when next took a chunk
}

type recvResult struct {
	chunk *stagepb.GenerateChunk
	err   error
	size  int64 // outputSize of chunk
}

func startReadAhead(ctx context.Context, s chunkStream) *readAhead {
	ra := &readAhead{ch: make(chan recvResult, readAheadChunks), done: make(chan struct{}), taken: make(chan struct{}, 1)}
	go func() {
		defer close(ra.done)
		for {
			c, err := s.Recv()
			n := outputSize(c)
			select {
			case ra.ch <- recvResult{c, err, n}:
			case <-ctx.Done():
				return
			}
			if err != nil {
				return
			}
			for ra.held.Add(n) >= readAheadBytes {
				n = 0
				select {
				case <-ra.taken:
				case <-ctx.Done():
					return
				}
			}
		}
	}()
	return ra
}

// outputSize is how many bytes of output c holds.
func outputSize(c *stagepb.GenerateChunk) int64 {
	return int64(len(c.GetText()) + 4*len(c.GetCodes()) + len(c.GetAudioPcm16()))
}

// took gives back the room of a chunk next took.
func (ra *readAhead) took(r recvResult) (*stagepb.GenerateChunk, error) {
	if r.size > 0 {
		ra.held.Add(-r.size)
		select {
		case ra.taken <- struct{}{}:
		default:
		}
	}
	return r.chunk, r.err
}

// next returns the next chunk; when none has come yet, it first flushes
// what was delivered, then waits.
func (ra *readAhead) next(ctx context.Context, flush func() error) (*stagepb.GenerateChunk, error) {
	select {
	case r := <-ra.ch:
		return ra.took(r)
	default:
	}
	if err := flush(); err != nil {
		return nil, fmt.Errorf("%w: %w", errNotFlushed, err)
	}
	select {
	case r := <-ra.ch:
		return ra.took(r)
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// anyReplica reports whether f holds for a replica of reps.
func anyReplica(reps *router.Replicas, f func(*router.Replica) bool) bool {
	for r := range reps.All() {
		if f(r) {
			return true
		}
	}
	return false
}
