package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	grpccodes "google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/internal/router"
	"github.com/troupe-serving/troupe/internal/stats"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/telemetry"
)

// Errors the HTTP layer maps to status codes.
var (
	// ErrNoReplica: a needed stage has no routable replica (503).
	ErrNoReplica = router.ErrNoReplica
	// ErrStageFailed: a replica failed and the request could not be
	// completed (502).
	ErrStageFailed = errors.New("orchestrator: stage failed")
	// ErrBadRequest: a replica refused the input as invalid (400).
	ErrBadRequest = errors.New("orchestrator: invalid request")
)

// Request is one pipeline request.
type Request struct {
	ID       string
	Prompt   string
	Sampling *stagepb.SamplingParams
	// Stages is how many stages to run, from stage 0: 1 for text, all of
	// them for audio. 0 means 1.
	Stages int
	// Operation is gen_ai.operation.name: "chat" (default) or
	// "text_completion".
	Operation string
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
}

// Execute walks req through the pipeline: each stage's output is the next
// stage's input. onText receives stage 0's text as it arrives and may be
// nil; an error from it aborts the request. Execute is safe for concurrent
// use.
func (h *Head) Execute(ctx context.Context, req Request, onText func(delta string) error) (*Result, error) {
	n := req.Stages
	if n <= 0 {
		n = 1
	}
	if n > len(h.cfg.Pipeline.Stages) {
		return nil, fmt.Errorf("%w: %d stages requested, pipeline has %d", ErrBadRequest, n, len(h.cfg.Pipeline.Stages))
	}
	if req.Operation == "" {
		req.Operation = telemetry.GenAIOperationChat
	}
	ctx, span := h.tracer.Start(ctx, telemetry.SpanRequest, trace.WithSpanKind(trace.SpanKindInternal),
		trace.WithAttributes(
			telemetry.KeyRequestID.String(req.ID),
			attribute.Int("troupe.request.stages", n),
		),
		trace.WithAttributes(requestAttributes(req, h.cfg.Pipeline.Model)...))
	defer span.End()

	// Fail fast: every needed stage must have a replica before any work.
	snap := h.router.Snapshot()
	for i := range n {
		if err := snap.CheckRoutable(i); err != nil {
			err = fmt.Errorf("orchestrator: stage %q: %w", h.cfg.Pipeline.Stages[i].Name, err)
			span.SetStatus(codes.Error, err.Error())
			return nil, err
		}
	}

	res := &Result{}
	in := &stagepb.GenerateRequest{RequestId: req.ID, Input: &stagepb.GenerateRequest_Text{Text: req.Prompt}, Sampling: req.Sampling}
	for i := range n {
		var emit func(*stagepb.GenerateChunk) error
		if i == 0 && onText != nil {
			emit = func(c *stagepb.GenerateChunk) error { return onText(c.GetText()) }
		}
		out, err := h.runStage(ctx, req, i, in, emit)
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
			return nil, err
		}
		switch i {
		case 0:
			res.Text, res.FinishReason = out.text.String(), out.finish
			res.PromptTokens, res.CompletionTokens = out.promptTokens, out.generationTokens
		}
		if len(out.codes) > 0 {
			res.Codes = out.codes
		}
		if len(out.pcm) > 0 {
			res.PCM, res.SampleRate = out.pcm, out.sampleRate
		}
		// The next stage takes this stage's output: codes if it made any,
		// otherwise its text.
		next := &stagepb.GenerateRequest{RequestId: req.ID, Sampling: &stagepb.SamplingParams{Seed: seedOf(req.Sampling)}}
		if len(out.codes) > 0 {
			next.Input = &stagepb.GenerateRequest_Codes{Codes: &stagepb.Codes{Codes: out.codes}}
		} else {
			next.Input = &stagepb.GenerateRequest_Text{Text: out.text.String()}
		}
		in = next
	}
	span.SetAttributes(telemetry.GenAIUsageAttributes(int64(res.PromptTokens), int64(res.CompletionTokens), res.FinishReason)...)
	return res, nil
}

// requestAttributes are the gen_ai.request.* attributes of a request.
func requestAttributes(req Request, model string) []attribute.KeyValue {
	var temp *float64
	if req.Sampling != nil && req.Sampling.Temperature != 0 {
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
}

const maxAttempts = 2

// runStage runs one stage, retrying once on another replica when the first
// attempt fails before any output reached the client. emit, when not nil,
// streams output to the client; without it nothing is visible until the
// stage ends, so any failure may be retried.
func (h *Head) runStage(ctx context.Context, req Request, stage int, in *stagepb.GenerateRequest, emit func(*stagepb.GenerateChunk) error) (*stageOutput, error) {
	var failed []*router.Replica
	var lastErr error
	for attempt := 1; attempt <= maxAttempts; attempt++ {
		rep, err := h.router.Snapshot().Pick(h.policy, stage, failed)
		if err != nil {
			if lastErr != nil {
				return nil, lastErr
			}
			return nil, fmt.Errorf("orchestrator: stage %q: %w", h.cfg.Pipeline.Stages[stage].Name, err)
		}
		out, produced, err := h.attempt(ctx, req, stage, rep, attempt, in, emit)
		if err == nil {
			return out, nil
		}
		lastErr = err
		if produced || ctx.Err() != nil || errors.Is(err, ErrBadRequest) ||
			errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
			return nil, err
		}
		failed = append(failed, rep)
	}
	return nil, lastErr
}

// attempt runs a stage on one replica. produced reports whether any output
// reached the client through emit, after which a retry would duplicate it.
func (h *Head) attempt(ctx context.Context, req Request, stage int, rep *router.Replica, attempt int, in *stagepb.GenerateRequest, emit func(*stagepb.GenerateChunk) error) (_ *stageOutput, produced bool, err error) {
	name := h.cfg.Pipeline.Stages[stage].Name
	ctx, span := h.tracer.Start(ctx, telemetry.StageSpanName(name), trace.WithSpanKind(trace.SpanKindInternal),
		trace.WithAttributes(telemetry.StageAttributes(stage, name, uint64(rep.Key.Replica), rep.EngineIndex, attempt)...),
		trace.WithAttributes(requestAttributes(Request{Operation: req.Operation, Sampling: in.GetSampling()}, h.cfg.Pipeline.Model)...))
	defer span.End()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	rep.Acquire()
	defer rep.Release()

	out := &stageOutput{} // not the named result: returning nil must not hide it from the deferred recorder
	fin := stats.Finished{Reason: stagepb.FinishReason_FINISH_REASON_ERROR}
	if sc := span.SpanContext(); sc.IsSampled() {
		fin.TraceID = sc.TraceID().String()
	}
	start := time.Now()
	var last time.Time
	defer func() {
		fin.E2E = time.Since(start)
		fin.PromptTokens, fin.GenerationTokens = out.promptTokens, out.generationTokens
		if rerr := h.stats.RecordFinished(rep.EngineIndex, fin); rerr != nil {
			h.log.Debug("orchestrator: record finished", "err", rerr)
		}
		span.SetAttributes(telemetry.GenAIUsageAttributes(int64(out.promptTokens), int64(out.generationTokens), fin.Reason.Name())...)
		span.AddEvent("finish", trace.WithAttributes(attribute.String("finish_reason", fin.Reason.Name())))
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
	}()

	stream, err := rep.Client.Generate(ctx, in)
	if err != nil {
		return nil, false, h.stageError(ctx, name, rep, err, &fin)
	}
	for {
		chunk, rerr := stream.Recv()
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			return nil, produced, h.stageError(ctx, name, rep, rerr, &fin)
		}
		if s := chunk.GetStats(); s != nil {
			if serr := h.stats.Record(rep.EngineIndex, s); serr != nil {
				h.log.Debug("orchestrator: record stats", "err", serr)
			}
			rep.SetLoad(int64(s.GetNumRequestsRunning()) + int64(s.GetNumRequestsWaitingCapacity()) + int64(s.GetNumRequestsWaitingDeferred()))
			out.promptTokens += int(s.GetPromptTokens())
			out.generationTokens += int(s.GetGenerationTokens())
		}
		if hasOutput(chunk) {
			now := time.Now()
			if last.IsZero() {
				fin.TTFT = now.Sub(start)
				span.AddEvent("first_token")
			} else {
				fin.InterTokenLatencies = append(fin.InterTokenLatencies, now.Sub(last))
			}
			last = now
			out.text.WriteString(chunk.GetText())
			out.codes = append(out.codes, chunk.GetCodes()...)
			out.pcm = append(out.pcm, chunk.GetAudioPcm16()...)
			if r := chunk.GetSampleRate(); r > 0 {
				out.sampleRate = int(r)
			}
			if emit != nil && chunk.GetText() != "" {
				produced = true
				if eerr := emit(chunk); eerr != nil {
					fin.Reason = stagepb.FinishReason_FINISH_REASON_ABORT
					return nil, true, fmt.Errorf("orchestrator: client gone: %w", eerr)
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
		return nil, produced, fmt.Errorf("%w: stage %q replica %d aborted the request", ErrStageFailed, name, rep.Key.Replica)
	default:
		fin.Reason = stagepb.FinishReason_FINISH_REASON_ERROR
		return nil, produced, fmt.Errorf("%w: stage %q replica %d ended its stream without finishing", ErrStageFailed, name, rep.Key.Replica)
	}
}

// stageError classifies a gRPC failure and sets the finish reason.
func (h *Head) stageError(ctx context.Context, stage string, rep *router.Replica, err error, fin *stats.Finished) error {
	// gRPC enforces the request's deadline with its own timer (and the
	// worker sees it too), so DeadlineExceeded can arrive a moment before
	// ctx reports it: both mean the client's time ran out, not a failure.
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
	if status.Code(err) == grpccodes.InvalidArgument {
		return fmt.Errorf("%w: stage %q: %s", ErrBadRequest, stage, status.Convert(err).Message())
	}
	return fmt.Errorf("%w: stage %q replica %d (%s): %s", ErrStageFailed, stage, rep.Key.Replica, rep.Addr, status.Convert(err).Message())
}

func hasOutput(c *stagepb.GenerateChunk) bool {
	return c.GetText() != "" || len(c.GetCodes()) > 0 || len(c.GetAudioPcm16()) > 0 || len(c.GetTokenIds()) > 0
}

// seedOf carries the client's seed to later stages, so the whole pipeline
// is a pure function of the request.
func seedOf(p *stagepb.SamplingParams) *int64 {
	seed := p.GetSeed()
	return &seed
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
