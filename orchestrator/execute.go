package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
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

// Request is one pipeline request.
type Request struct {
	ID     string
	Prompt string
	// Messages, when not empty, is the conversation: stage 0 gets it as
	// chat input (engines with a chat template apply it) instead of
	// Prompt.
	Messages []*stagepb.ChatMessage
	// Voice is the client's audio voice, passed to every stage.
	Voice    string
	Sampling *stagepb.SamplingParams
	// Stages is how many stages to run, from stage 0: 1 for text, all of
	// them for audio. 0 means 1.
	Stages int
	// Operation is gen_ai.operation.name: "chat" (default) or
	// "text_completion".
	Operation string
	// OnAudio, when not nil, receives the last stage's PCM16 audio as it is
	// made (with its sample rate); an error from it aborts the request.
	OnAudio func(pcm []byte, sampleRate int) error
	// SessionKey, when not empty, routes the request to its session's
	// replica on stages with session affinity (X-Session-ID, or the
	// OpenAI `user` field).
	SessionKey string
	// Flush, when not nil, lets onText and OnAudio buffer what they
	// deliver: Execute calls it whenever it has delivered all the output
	// that has come so far and is about to wait for more, so output that
	// comes in a burst goes out in one write while output that comes alone
	// goes out at once. It is called from the goroutines that call onText
	// and OnAudio; an error from it aborts the request. Execute does not
	// flush after the last output: the caller writes the end of the answer
	// and flushes that.
	Flush func() error
}

// Result is what a request produced.
type Result struct {
	Text             string
	FinishReason     string // stop | length
	PromptTokens     int
	CompletionTokens int
	Codes            []uint32
	PCM              []byte // PCM16 mono little-endian
	SampleRate       int
	// AudioTruncated: a stage after the first stopped at its output limit,
	// so the audio covers only part of the text. FinishReason is then
	// "length".
	AudioTruncated bool
}

// Execute walks req through the pipeline: each stage's output is the next
// stage's input, chosen by the role the stage gives (text or codes; see
// nextInput). With a streaming pipeline (the default) every stage runs at
// once and each chunk of output is forwarded to the next stage as it is
// made; otherwise each stage starts when the one before it finished.
// onText receives stage 0's text as it arrives and req.OnAudio the last
// stage's audio; either may be nil, and an error from either aborts the
// request. Execute is safe for concurrent use.
func (h *Head) Execute(ctx context.Context, req Request, onText func(delta string) error) (res *Result, err error) {
	n := req.Stages
	if n <= 0 {
		n = 1
	}
	if n > len(h.cfg.Pipeline.Stages) {
		return nil, newError(ErrBadRequest, nil, "%d stages requested, the pipeline has %d", n, len(h.cfg.Pipeline.Stages))
	}
	if req.Operation == "" {
		req.Operation = telemetry.GenAIOperationChat
	}
	start := time.Now()
	var ttfa time.Duration
	defer func() {
		r := stats.PipelineResult{Outcome: outcomeOf(ctx, err), E2E: time.Since(start), TTFA: ttfa}
		if res != nil && res.SampleRate > 0 {
			r.Audio = time.Duration(len(res.PCM) / 2 * int(time.Second) / res.SampleRate)
		}
		h.pipeline.Finish(r)
	}()
	// Attributes are set after the start, only on a recording span: an
	// unsampled request pays nothing for them (no sampler reads them).
	ctx, span := h.tracer.Start(ctx, telemetry.SpanRequest, internalSpan)
	defer span.End()
	recording := span.IsRecording()
	if recording {
		span.SetAttributes(telemetry.KeyRequestID.String(req.ID), attribute.Int("troupe.request.stages", n))
		span.SetAttributes(requestAttributes(req, h.cfg.Pipeline.Model)...)
	}

	// Fail fast: every needed stage must have a replica before any work.
	snap := h.router.Snapshot()
	for i := range n {
		if err := snap.CheckRoutable(i); err != nil {
			oe := newError(ErrNoReplica, err, "stage %q has no routable replica", h.cfg.Pipeline.Stages[i].Name)
			span.SetStatus(codes.Error, oe.Error())
			return nil, oe
		}
	}

	in := &stagepb.GenerateRequest{RequestId: req.ID, Sampling: req.Sampling, Voice: req.Voice}
	if len(req.Messages) > 0 {
		in.Input = &stagepb.GenerateRequest_Chat{Chat: &stagepb.Chat{Messages: req.Messages}}
	} else {
		in.Input = &stagepb.GenerateRequest_Text{Text: req.Prompt}
	}
	if sizeBound(req) > h.cfg.MaxMessageBytes/2 && proto.Size(in) > h.cfg.MaxMessageBytes {
		// gRPC would refuse it too, as a failure of the replica.
		err = newError(ErrInputTooLarge, nil, "the prompt is too large: %d bytes once decoded, and a request to a replica may hold %d bytes", proto.Size(in), h.cfg.MaxMessageBytes)
		span.SetStatus(codes.Error, err.Error())
		return nil, err
	}
	if n > 1 && h.cfg.Pipeline.StreamsBetweenStages() {
		span.SetAttributes(attribute.Bool("troupe.request.streamed", true))
		res, ttfa, err = h.executeStreamed(ctx, req, n, in, onText)
	} else {
		res, ttfa, err = h.executeSequential(ctx, req, n, in, onText)
	}
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
		return nil, err
	}
	if recording {
		span.SetAttributes(telemetry.GenAIUsageAttributes(int64(res.PromptTokens), int64(res.CompletionTokens), res.FinishReason)...)
	}
	return res, nil
}

// executeSequential runs the stages one after the other; the last stage's
// audio still reaches req.OnAudio as it is made.
func (h *Head) executeSequential(ctx context.Context, req Request, n int, in *stagepb.GenerateRequest, onText func(string) error) (*Result, time.Duration, error) {
	start := time.Now()
	var ttfa time.Duration
	res := &Result{}
	for i := range n {
		var forward forwarder
		switch {
		case i == 0 && onText != nil:
			forward = func(c *stagepb.GenerateChunk) (bool, error) {
				if c.GetText() == "" {
					return false, nil
				}
				return true, onText(c.GetText())
			}
		case i == n-1 && i > 0:
			forward = func(c *stagepb.GenerateChunk) (bool, error) {
				if len(c.GetAudioPcm16()) == 0 {
					return false, nil
				}
				if ttfa == 0 {
					ttfa = time.Since(start)
				}
				if req.OnAudio == nil {
					return false, nil
				}
				return true, req.OnAudio(c.GetAudioPcm16(), int(c.GetSampleRate()))
			}
		}
		// One stage after another: what the client does not read as it is
		// made, nobody reads before the stage ends.
		var flush func() error
		if readByClient(req, onText, i, n) {
			flush = req.Flush
		} else {
			in.HoldOutputMs = h.holdOutputMs()
		}
		out, err := h.runStage(ctx, req, i, in, forward, flush)
		if err != nil {
			return nil, 0, err
		}
		switch {
		case i == 0:
			res.Text, res.FinishReason = out.text.String(), out.finish
			res.PromptTokens, res.CompletionTokens = out.promptTokens, out.generationTokens
		case out.finish == stagepb.FinishReason_FINISH_REASON_LENGTH.Name():
			res.AudioTruncated = true
			res.FinishReason = out.finish
		}
		if len(out.codes) > 0 {
			res.Codes = out.codes
		}
		if len(out.pcm) > 0 {
			res.PCM, res.SampleRate = out.pcm, out.sampleRate
		}
		if i == n-1 {
			break
		}
		next, err := nextInput((*h.outputs.Load())[i], out)
		if err != nil {
			return nil, 0, err
		}
		next.RequestId, next.Voice = req.ID, req.Voice
		next.Sampling = &stagepb.SamplingParams{Seed: seedOf(req.Sampling)}
		in = next
	}
	return res, ttfa, nil
}

// readByClient reports whether the client reads stage's output (of n) as
// it is made: stage 0's text through onText, the last stage's audio
// through req.OnAudio.
func readByClient(req Request, onText func(string) error, stage, n int) bool {
	return (stage == 0 && onText != nil) || (stage == n-1 && stage > 0 && req.OnAudio != nil)
}

// sizeBound bounds the encoded size of stage 0's request for req from
// above, without encoding it: every string at most its length plus 16
// bytes of tags and lengths, and 256 bytes for the fixed fields. Only a
// request that could be near the limit pays for proto.Size of the whole
// (the sampling parameters, small, are measured exactly).
func sizeBound(req Request) int {
	n := 256 + len(req.ID) + len(req.Prompt) + len(req.Voice) + 16*3 + proto.Size(req.Sampling)
	for _, m := range req.Messages {
		n += len(m.GetRole()) + len(m.GetContent()) + 16*3
	}
	return n
}

// outcomeOf classifies a finished request for troupe_pipeline_requests_total.
func outcomeOf(ctx context.Context, err error) string {
	switch {
	case err == nil:
		return stats.OutcomeSuccess
	case errors.Is(err, ErrNoReplica):
		return stats.OutcomeNoReplica
	case errors.Is(err, ErrBadRequest), errors.Is(err, ErrInputTooLarge):
		return stats.OutcomeBadRequest
	case ctx.Err() != nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
		return stats.OutcomeAbort
	}
	return stats.OutcomeError
}

// requestAttributes are the gen_ai.request.* attributes of a request.
func requestAttributes(req Request, model string) []attribute.KeyValue {
	var temp *float64
	if req.Sampling != nil && req.Sampling.Temperature != nil {
		t := float64(req.Sampling.GetTemperature())
		temp = &t
	}
	return telemetry.GenAIRequestAttributes(req.Operation, model, int(req.Sampling.GetMaxTokens()), temp)
}

// stageOutput accumulates one stage attempt's output.
type stageOutput struct {
	text             strings.Builder
	codes            []uint32
	pcm              []byte
	sampleRate       int
	finish           string
	promptTokens     int
	generationTokens int
	computedTokens   int // prompt tokens the engine computed (not cache hits)
}

const maxAttempts = 2

// runStage runs one stage, retrying once on another replica when the first
// attempt fails before any output reached the client. forward, when not
// nil, streams output to the client; without it nothing is visible until
// the stage ends, so any failure may be retried.
func (h *Head) runStage(ctx context.Context, req Request, stage int, in *stagepb.GenerateRequest, forward forwarder, flush func() error) (*stageOutput, error) {
	var failed []*router.Replica
	var lastErr error
	var moved migrated // what failed attempts delivered before a migration
	base := in         // the request a migration continues
	route := routeOf(in, req.SessionKey)
	for attempt := 1; attempt <= maxAttempts+moved.count; attempt++ {
		d, err := h.router.Pick(stage, route, failed)
		if err != nil {
			if lastErr != nil {
				return nil, lastErr
			}
			return nil, newError(ErrNoReplica, err, "stage %q has no routable replica", h.cfg.Pipeline.Stages[stage].Name)
		}
		h.countDecision(stage, d)
		rep := d.Replica
		cur := in
		open := func(ctx context.Context, span trace.Span, _ func()) (chunkStream, func(), error) {
			if moved.count > 0 {
				span.SetAttributes(attribute.Bool("troupe.migration", true), attribute.Int("troupe.migration.delivered_chars", len(moved.text)))
			}
			return h.openGenerate(ctx, rep, cur)
		}
		var delivered migrated
		fwd := forward
		if forward != nil {
			fwd = func(c *stagepb.GenerateChunk) (bool, error) {
				visible, err := forward(c)
				if visible {
					delivered.text += c.GetText()
					delivered.tokens += int(c.GetStats().GetGenerationTokens())
				}
				return visible, err
			}
		}
		out, produced, err := h.attempt(ctx, req, stage, d, attempt, cur.GetSampling(), open, fwd, flush)
		if err == nil {
			return moved.prepend(out), nil
		}
		lastErr = err
		if next, finished, ok := h.migrate(ctx, stage, rep, err, produced, &moved, delivered, base); ok {
			if finished != nil {
				return finished, nil
			}
			in = next
			failed = append(failed, rep)
			continue
		}
		if !retryable(ctx, err, produced) {
			return nil, err
		}
		failed = append(failed, rep)
	}
	return nil, lastErr
}

// migrate decides whether a stage attempt's failure continues the answer
// on another replica: a stage-0 failure of the replica after text reached
// the client, within the migration limit. It adds what the attempt gave
// the client (got) to m and returns the request that continues base after
// all of it; finished is the whole answer instead when what was delivered
// already reached max_tokens. ok is false when the failure does not
// migrate.
func (h *Head) migrate(ctx context.Context, stage int, rep *router.Replica, err error, produced bool, m *migrated, got migrated, base *stagepb.GenerateRequest) (next *stagepb.GenerateRequest, finished *stageOutput, ok bool) {
	if stage != 0 || !produced || m.count >= h.cfg.MaxMigrations || ctx.Err() != nil || !errors.Is(err, ErrStageFailed) {
		return nil, nil, false
	}
	m.count++
	m.text += got.text
	m.tokens += got.tokens
	next, done := m.continuation(base)
	if done {
		return nil, m.prepend(&stageOutput{finish: stagepb.FinishReason_FINISH_REASON_LENGTH.Name()}), true
	}
	h.log.Warn("orchestrator: replica failed after text reached the client; continuing the answer on another replica",
		"stage", h.cfg.Pipeline.Stages[stage].Name, "replica", rep.Key.Replica, "delivered_chars", len(m.text), "err", err)
	return next, nil, true
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

// retryable is the retry rule of every stage attempt: a failure is tried
// once more on another replica unless output already reached the client,
// the client's own context ended, or the input was refused.
func retryable(ctx context.Context, err error, produced bool) bool {
	return !produced && ctx.Err() == nil && !errors.Is(err, ErrBadRequest) &&
		!errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled)
}

// chunkStream is the receiving side of Generate and GenerateStream.
type chunkStream interface {
	Recv() (*stagepb.GenerateChunk, error)
}

// openGenerate starts req on rep: over the replica's Multiplex stream when
// the worker serves it and no trace goes to workers (a call on the stream
// carries no trace context of its own), else as a Generate RPC of its own.
func (h *Head) openGenerate(ctx context.Context, rep *router.Replica, req *stagepb.GenerateRequest) (chunkStream, func(), error) {
	if h.multiplex && rep.Engine.Multiplex {
		call, err := rep.Mux.Generate(ctx, req, h.callOptions()...)
		if err != nil {
			return nil, func() {}, err
		}
		return call, call.Close, nil
	}
	stream, err := rep.Client.Generate(ctx, req, h.callOptions()...)
	return stream, func() {}, err
}

// opener starts a stage attempt's RPC under ctx. wait, called after ctx is
// cancelled, waits for whatever goroutine the opener started. An opener
// that feeds the stage its input calls progress after each piece it sends.
type opener func(ctx context.Context, span trace.Span, progress func()) (stream chunkStream, wait func(), err error)

// Causes of a stage attempt cancelled by the head, not by the client: both
// are stage failures, retried under the usual rule.
var (
	errStalled = errors.New("orchestrator: no progress within the stall timeout")
	// errReplicaGone: the replica's record went away and it does not
	// answer Health.
	errReplicaGone = errors.New("orchestrator: replica left and does not answer")
)

// forwarder passes an output chunk on (to the client, or to the next
// stage). visible reports whether the output reached the client, after
// which the attempt cannot be retried.
type forwarder func(c *stagepb.GenerateChunk) (visible bool, err error)

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

// attempt runs a stage on the replica d chose. produced reports whether any
// output reached the client through forward, after which a retry would
// duplicate it. forward may be nil.
//
// The attempt fails with errStalled when, once it has started to work, it
// makes no progress for the stall timeout: no chunk received, and no input
// sent.
func (h *Head) attempt(ctx context.Context, req Request, stage int, d router.Decision, attempt int, sampling *stagepb.SamplingParams, open opener, forward forwarder, flush func() error) (_ *stageOutput, produced bool, err error) {
	name := h.cfg.Pipeline.Stages[stage].Name
	rep := d.Replica
	ctx, span := h.tracer.Start(ctx, h.stageSpans[stage], internalSpan)
	defer span.End()
	recording := span.IsRecording() // as in Execute: no attribute work when unsampled
	if recording {
		span.SetAttributes(telemetry.StageAttributes(stage, name, uint64(rep.Key.Replica), rep.EngineIndex, attempt)...)
		span.SetAttributes(telemetry.RouteAttributes(d.Policy, d.Reason.String(), d.PrefixSource, d.MatchBlocks, d.InputBlocks)...)
		span.SetAttributes(requestAttributes(Request{Operation: req.Operation, Sampling: sampling}, h.cfg.Pipeline.Model)...)
	}
	ctx, cancel := context.WithCancelCause(ctx)
	wait := func() {}
	defer func() { cancel(context.Canceled); wait() }()
	// The stall clock starts with the first sign of work (a chunk, or input
	// sent to a streamed stage): before it a replica may rightly be busy for
	// long (a queue, the prefill of a huge prompt). A replica that dies or
	// freezes before its first chunk is caught by its lease instead: the
	// leave probe finds it does not answer and aborts its attempts.
	stall := time.AfterFunc(h.cfg.StallTimeout, func() { cancel(errStalled) })
	stall.Stop()
	defer stall.Stop()
	progress := func() { stall.Reset(h.cfg.StallTimeout) }

	rep.Acquire()
	defer rep.Release()
	defer rep.Track(cancel)()
	// fault: the attempt failed through the replica (not the client, the
	// input or the next stage); it feeds the circuit breaker.
	var fault bool
	defer func() { h.recordOutcome(stage, rep, err, fault) }()

	out := &stageOutput{} // not the named result: returning nil must not hide it from the deferred recorder
	// troupe runs one sequence per request (the API refuses n != 1), so n
	// is 1 for every stage request.
	fin := stats.Finished{Reason: stagepb.FinishReason_FINISH_REASON_ERROR, MaxTokensParam: int(sampling.GetMaxTokens()), N: 1}
	if sc := span.SpanContext(); sc.IsSampled() {
		fin.TraceID = sc.TraceID().String()
	}
	start := time.Now()
	var last time.Time
	defer func() {
		fin.E2E = time.Since(start)
		fin.PromptTokens, fin.GenerationTokens = out.promptTokens, out.generationTokens
		fin.PrefillComputedTokens = out.computedTokens
		if rerr := h.stats.RecordFinished(rep.EngineIndex, fin); rerr != nil {
			h.log.Debug("orchestrator: record finished", "err", rerr)
		}
		if recording {
			span.SetAttributes(telemetry.GenAIUsageAttributes(int64(out.promptTokens), int64(out.generationTokens), fin.Reason.Name())...)
			span.AddEvent("finish", trace.WithAttributes(attribute.String("finish_reason", fin.Reason.Name())))
		}
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
	}()

	stream, w, err := open(ctx, span, progress)
	wait = w
	if err != nil {
		return nil, false, h.stageError(ctx, name, rep, err, &fin, &fault)
	}
	recv := stream.Recv
	if flush != nil {
		ra := startReadAhead(ctx, stream)
		// The read-ahead's Recv ends first: a Multiplex call is closed
		// (w) only once nothing reads it.
		wait = func() { <-ra.done; w() }
		recv = func() (*stagepb.GenerateChunk, error) { return ra.next(ctx, flush) }
	}
	for {
		chunk, rerr := recv()
		if rerr == io.EOF {
			break
		}
		if errors.Is(rerr, errNotFlushed) {
			fin.Reason = stagepb.FinishReason_FINISH_REASON_ABORT
			return nil, produced, fmt.Errorf("orchestrator: stage %q: output not delivered: %w", name, rerr)
		}
		if rerr != nil {
			return nil, produced, h.stageError(ctx, name, rep, rerr, &fin, &fault)
		}
		progress()
		if ev := chunk.GetKvEvents(); ev != nil {
			h.router.ApplyKVEvents(rep, ev)
		}
		if s := chunk.GetStats(); s != nil {
			if serr := h.stats.Record(rep.EngineIndex, s); serr != nil {
				h.log.Debug("orchestrator: record stats", "err", serr)
			}
			rep.SetLoad(int64(s.GetNumRequestsRunning()) + int64(s.GetNumRequestsWaitingCapacity()) + int64(s.GetNumRequestsWaitingDeferred()))
			out.promptTokens += int(s.GetPromptTokens())
			out.generationTokens += int(s.GetGenerationTokens())
			out.computedTokens += int(s.GetPromptTokensLocalCompute())
		}
		if stagepb.HasOutput(chunk) {
			// A chunk of held output dates each of its outputs by its age;
			// any other chunk is one output, made about now.
			now := time.Now()
			ages := chunk.GetOutputAgesUs()
			for i := range max(len(ages), 1) {
				at := now
				if i < len(ages) {
					at = now.Add(-time.Duration(ages[i]) * time.Microsecond)
				}
				if last.IsZero() {
					fin.TTFT = max(at.Sub(start), 0)
					if recording {
						span.AddEvent("first_token", trace.WithTimestamp(at))
					}
					if len(ages) > 1 {
						fin.InterTokenLatencies = make([]time.Duration, 0, len(ages)-1)
					}
				} else {
					fin.InterTokenLatencies = append(fin.InterTokenLatencies, max(at.Sub(last), 0))
				}
				last = at
			}
			out.text.WriteString(chunk.GetText())
			out.codes = append(out.codes, chunk.GetCodes()...)
			out.pcm = append(out.pcm, chunk.GetAudioPcm16()...)
			if r := chunk.GetSampleRate(); r > 0 {
				out.sampleRate = int(r)
			}
			if forward != nil {
				visible, ferr := forward(chunk)
				produced = produced || visible
				if ferr != nil {
					fin.Reason = stagepb.FinishReason_FINISH_REASON_ABORT
					return nil, produced, fmt.Errorf("orchestrator: stage %q: output not delivered: %w", name, ferr)
				}
			}
		}
		if r := chunk.GetFinishReason(); r != stagepb.FinishReason_FINISH_REASON_UNSPECIFIED {
			fin.Reason = r
			out.finish = r.Name()
			if t := chunk.GetTimings(); t != nil {
				fin.Queue = seconds(t.GetQueueSeconds())
				fin.Prefill = seconds(t.GetPrefillSeconds())
				fin.Decode = seconds(t.GetDecodeSeconds())
			}
		}
	}
	switch fin.Reason {
	case stagepb.FinishReason_FINISH_REASON_STOP, stagepb.FinishReason_FINISH_REASON_LENGTH:
		return out, produced, nil
	case stagepb.FinishReason_FINISH_REASON_ABORT:
		fault = ctx.Err() == nil
		return nil, produced, newError(ErrStageFailed, nil, "stage %q failed on replica %d: it aborted the request", name, rep.Key.Replica)
	default:
		fin.Reason = stagepb.FinishReason_FINISH_REASON_ERROR
		fault = ctx.Err() == nil
		return nil, produced, newError(ErrStageFailed, nil, "stage %q failed on replica %d: it ended its stream without finishing", name, rep.Key.Replica)
	}
}

// stageError classifies a gRPC failure and sets the finish reason.
// fault is set when the replica is to blame (see recordOutcome).
func (h *Head) stageError(ctx context.Context, stage string, rep *router.Replica, err error, fin *stats.Finished, fault *bool) error {
	// gRPC enforces the request's deadline with its own timer (and the
	// worker sees it too), so DeadlineExceeded can arrive a moment before
	// ctx reports it: both mean the client's time ran out, not a failure.
	if cause := context.Cause(ctx); errors.Is(cause, errStalled) || errors.Is(cause, errReplicaGone) {
		fin.Reason = stagepb.FinishReason_FINISH_REASON_ERROR
		*fault = true
		what := "stopped making progress"
		if errors.Is(cause, errReplicaGone) {
			what = "left the membership and does not answer"
		}
		return newError(ErrStageFailed, fmt.Errorf("replica %d (%s): %w", rep.Key.Replica, rep.Addr, cause),
			"stage %q failed on replica %d: it %s", stage, rep.Key.Replica, what)
	}
	_, hasDeadline := ctx.Deadline()
	if ctx.Err() != nil || (hasDeadline && status.Code(err) == grpccodes.DeadlineExceeded) {
		fin.Reason = stagepb.FinishReason_FINISH_REASON_ABORT
		cause := context.Cause(ctx)
		if cause == nil {
			cause = context.DeadlineExceeded
		}
		return fmt.Errorf("orchestrator: stage %q: %w", stage, cause)
	}
	fin.Reason = stagepb.FinishReason_FINISH_REASON_ERROR
	e := replicaError(fmt.Sprintf("stage %q", stage), rep.Key.Replica, rep.Addr, err)
	*fault = errors.Is(e, ErrStageFailed)
	return e
}

// recordOutcome feeds an attempt's outcome to rep's circuit breaker: a
// success closes it, a fault of the replica counts towards an ejection.
// Other failures (the client left, its input was refused, the next stage
// failed) say nothing about rep and leave the breaker alone.
func (h *Head) recordOutcome(stage int, rep *router.Replica, err error, fault bool) {
	if err == nil {
		if h.router.RecordSuccess(rep) {
			h.log.Info("orchestrator: ejected replica answers again; routing to it",
				"stage", rep.StageName, "replica", rep.Key.Replica, "addr", rep.Addr)
		}
		return
	}
	if !fault {
		return
	}
	e := h.router.RecordFailure(rep)
	switch {
	case e.Ejected:
		h.ejections[stage].Inc()
		h.log.Warn("orchestrator: replica fails repeatedly; ejected from routing",
			"stage", rep.StageName, "replica", rep.Key.Replica, "addr", rep.Addr,
			"consecutive_failures", e.Failures, "backoff", e.Backoff, "err", err)
	case e.Spared && e.Failures == h.router.BreakerFailures():
		h.log.Warn("orchestrator: replica fails repeatedly but is its stage's only routable one; kept in routing",
			"stage", rep.StageName, "replica", rep.Key.Replica, "addr", rep.Addr, "err", err)
	}
}

// callOptions set the gRPC message limits of a call to a replica (gRPC's
// default would stop at 4 MiB received).
func (h *Head) callOptions() []grpc.CallOption { return h.calls }

// readAheadChunks is how many chunks a stage whose output goes to the
// client may have received and not yet delivered: the read-ahead lets the
// head see that more output is there before it flushes, and the bound
// keeps a client that stops reading slowing the stage down.
const readAheadChunks = 16

// errNotFlushed wraps the error of Request.Flush.
var errNotFlushed = errors.New("orchestrator: flush failed")

// readAhead receives a stage attempt's chunks ahead of the loop that
// delivers them. Its goroutine ends when the stream does (an error, io.EOF
// or the attempt's context cancelled); done is closed then.
type readAhead struct {
	ch   chan recvResult
	done chan struct{}
}

type recvResult struct {
	chunk *stagepb.GenerateChunk
	err   error
}

func startReadAhead(ctx context.Context, s chunkStream) *readAhead {
	ra := &readAhead{ch: make(chan recvResult, readAheadChunks), done: make(chan struct{})}
	go func() {
		defer close(ra.done)
		for {
			c, err := s.Recv()
			select {
			case ra.ch <- recvResult{c, err}:
			case <-ctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	return ra
}

// next returns the next chunk; when none has come yet, it first flushes
// what was delivered, then waits.
func (ra *readAhead) next(ctx context.Context, flush func() error) (*stagepb.GenerateChunk, error) {
	select {
	case r := <-ra.ch:
		return r.chunk, r.err
	default:
	}
	if err := flush(); err != nil {
		return nil, fmt.Errorf("%w: %w", errNotFlushed, err)
	}
	select {
	case r := <-ra.ch:
		return r.chunk, r.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// internalSpan is the start option of the head's own spans, built once.
var internalSpan = trace.WithSpanKind(trace.SpanKindInternal)

// maxHoldOutput is how long a worker may hold a stage's output that
// nothing reads before the stage ends (GenerateRequest.hold_output_ms).
// The end is never held and every output is dated by its age, so only the
// number of messages changes: a short answer at zero delay comes in one
// message instead of one per output, a long one in one per 100 ms. It stays well below the
// stall timeout, which a held stage must not trip.
const maxHoldOutput = 100 * time.Millisecond

// holdOutputMs is GenerateRequest.hold_output_ms for a stage whose output
// is read only when it ends.
func (h *Head) holdOutputMs() uint32 {
	return uint32(min(maxHoldOutput, h.cfg.StallTimeout/4).Milliseconds())
}

// seedOf carries the client's seed to later stages, so the whole pipeline
// is a pure function of the request.
func seedOf(p *stagepb.SamplingParams) *int64 {
	seed := p.GetSeed()
	return &seed
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
