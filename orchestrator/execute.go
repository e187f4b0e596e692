package orchestrator

import (
	"context"
	"errors"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/proto"

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
	// Speech runs the pipeline's audio stages alone (SpeechStages to the
	// last) on Prompt, as if the text stage had written it (the speech
	// endpoint); Stages and Messages are then ignored. Its Result's usage
	// is the first of those stages'.
	Speech bool
	// Transcribe runs stage 0 alone on Messages as speech recognition (the
	// transcription endpoint): it is refused unless stage 0 takes audio.
	Transcribe bool
	// Language is the language of the audio to transcribe ("": detect).
	Language string
	// Deadline are the request's own targets (X-Troupe-Deadline); its zero
	// fields take the pipeline's. They act on stages whose policy is
	// deadline (docs/routing.md).
	Deadline Targets
	// Received is when the request came, from which its targets count
	// (zero: when Execute starts).
	Received time.Time
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
	// PromptMedia is how many of PromptTokens stage 0 made of media parts.
	PromptMedia MediaTokens
	Codes       []uint32
	// PCM is the audio, PCM16 mono little-endian; nil when Request.OnAudio
	// received it as it was made: the head keeps no copy of streamed audio.
	PCM        []byte
	SampleRate int
	// AudioTruncated: a stage after the first stopped at its output limit,
	// so the audio covers only part of the text. FinishReason is then
	// "length".
	AudioTruncated bool
	pcmBytes       int // the audio's length, in PCM or not
}

// Execute runs req through the pipeline as its plan says (planOf): each
// stage's output is the next stage's input, chosen by the role the stage
// gives (text or codes; see nextInput). With a streaming pipeline (the
// default) every stage runs at once and each chunk of output is forwarded
// to the next stage as it is made; otherwise each stage starts when the
// one before it finished. onText receives the text stage's text as it
// arrives and req.OnAudio the last stage's audio; either may be nil, and
// an error from either aborts the request. Execute is safe for concurrent
// use.
func (h *Head) Execute(ctx context.Context, req Request, onText func(delta string) error) (res *Result, err error) {
	n := max(req.Stages, 1)
	if req.Speech {
		n = len(h.cfg.Pipeline.Stages)
		req.Messages = nil
	}
	if n > len(h.cfg.Pipeline.Stages) {
		return nil, newError(ErrBadRequest, nil, "%d stages requested, the pipeline has %d", n, len(h.cfg.Pipeline.Stages))
	}
	if req.Operation == "" {
		req.Operation = telemetry.GenAIOperationChat
	}
	start := time.Now()
	if req.Received.IsZero() {
		req.Received = start
	}
	var ttfa time.Duration
	defer func() {
		r := stats.PipelineResult{Outcome: outcomeOf(ctx, err), E2E: time.Since(start), TTFA: ttfa}
		if res != nil && res.SampleRate > 0 {
			r.Audio = time.Duration(res.pcmBytes / 2 * int(time.Second) / res.SampleRate)
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
		span.SetAttributes(partAttributes(req.Messages)...)
	}

	// Fail fast: every needed stage must have a replica before any work.
	p, err := h.planOf(h.router.Snapshot(), req)
	if err != nil {
		span.SetStatus(codes.Error, err.Error())
		return nil, err
	}

	in := &stagepb.GenerateRequest{RequestId: req.ID, Sampling: req.Sampling, Voice: req.Voice, Language: req.Language}
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
	p.mark(span)
	res, ttfa, err = h.run(ctx, req, p, in, onText)
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

// sequentialForwarder is stage's forwarder (of n) in a sequential request:
// stage 0's text to onText, the last stage's audio to req.OnAudio (its
// first audio stops audio's clock); nil for a stage that nobody reads
// before it ends.
func sequentialForwarder(req Request, onText func(string) error, stage, n int, audio *firstAudio) forwarder {
	switch {
	case stage == 0 && onText != nil:
		return func(o output) (bool, error) {
			if o.text == "" {
				return false, nil
			}
			return true, onText(o.text)
		}
	case stage == n-1 && stage > 0:
		return func(o output) (bool, error) {
			if len(o.pcm) == 0 {
				return false, nil
			}
			audio.mark()
			if req.OnAudio == nil {
				return false, nil
			}
			// Not visible: a retry skips the samples delivered.
			return false, req.OnAudio(o.pcm, o.sampleRate)
		}
	}
	return nil
}

// AudioBytes is the length of the request's audio, PCM16 bytes, whether
// it is in PCM or went to Request.OnAudio as it was made.
func (r *Result) AudioBytes() int { return r.pcmBytes }

// add takes stage's output into the result: stage 0's text and usage, a
// later stage's truncation, and the codes and audio of the last stage that
// made any.
func (r *Result) add(stage int, out *stageOutput) {
	switch {
	case stage == 0:
		r.Text, r.FinishReason = out.text.String(), out.finish
		r.PromptTokens, r.CompletionTokens = out.promptTokens, out.generationTokens
		r.PromptMedia = out.media
	case out.finish == stagepb.FinishReason_FINISH_REASON_LENGTH.Name():
		r.AudioTruncated = true
		r.FinishReason = out.finish
	}
	if len(out.codes) > 0 {
		r.Codes = out.codes
	}
	if out.pcmBytes > 0 {
		r.PCM, r.pcmBytes, r.SampleRate = out.pcm, out.pcmBytes, out.sampleRate
	}
}

// firstAudio is the time to first audio of a request
// (stats.PipelineResult.TTFA): from the start of its stages to the first
// audio the last stage made. Safe for concurrent use.
type firstAudio struct {
	start time.Time
	at    atomic.Int64 // time.Duration since start; 0: no audio yet
}

func newFirstAudio() *firstAudio { return &firstAudio{start: time.Now()} }

// mark stops the clock at the first call.
func (f *firstAudio) mark() {
	if f.at.Load() == 0 {
		f.at.CompareAndSwap(0, int64(time.Since(f.start)))
	}
}

// since is the time to first audio; 0 when there was none.
func (f *firstAudio) since() time.Duration { return time.Duration(f.at.Load()) }

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
		for _, p := range m.GetParts() {
			n += len(p.GetKind()) + len(p.GetText()) + len(p.GetData()) + len(p.GetUrl()) + len(p.GetMimeType()) + len(p.GetFormat()) + 16*7
		}
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
	case ctx.Err() != nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded), errors.Is(err, errNotDelivered):
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

// chunkStream is the receiving side of Generate and GenerateStream.
type chunkStream interface {
	Recv() (*stagepb.GenerateChunk, error)
}

// internalSpan is the start option of the head's own spans, built once.
var internalSpan = trace.WithSpanKind(trace.SpanKindInternal)

// maxHoldOutput is how long a worker may hold a stage's output that
// nothing reads before the stage ends (GenerateRequest.hold_output_ms).
// The end is never held and every output is dated by its age, so only the
// number of messages changes. It stays well below the stall timeout,
// which a held stage must not trip.
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
