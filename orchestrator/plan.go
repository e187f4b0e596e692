package orchestrator

import (
	"context"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// plan is how a request runs through the pipeline: which stages, what
// flows between them, what the client sees, at once or in turn. Every
// request kind is a plan (planOf); one runner (run) executes any plan
// through the one attempt loop (runStage). A new request kind is a new
// plan, not a new runner.
type plan struct {
	// first..n-1 are the stages that run, each fed by the one before;
	// first gets the request's input whole.
	first, n int
	// recognize: stage 0 transcribes the conversation's audio before the
	// others start, and first answers the conversation with the transcript
	// in place of the audio (the asr cascade; first is then 1).
	recognize bool
	// text is the stage whose text the client reads and whose usage is the
	// request's. textGiven: the client gave the text (speech), as if stage
	// text = first-1 had made it; the usage is then first's.
	text      int
	textGiven bool
	// streamed: the stages run at once, each fed by the one before as it
	// writes; otherwise each starts when the one before ended.
	streamed bool
	// tensors, by stage: the stage takes the tensors of the stage before,
	// worker to worker. Such a plan is streamed: both run at once.
	tensors []bool
}

// planOf is the plan of req, refused before any work when the routable
// replicas cannot serve it:
//   - text or chat, with media or audio out: stages 0..Stages-1;
//   - Speech: the stages that turn text into audio (SpeechStages on), on
//     req.Prompt, always streamed;
//   - Transcribe: stage 0 alone, which must recognize speech;
//   - a chat to a pipeline whose stage 0 recognizes speech: the asr
//     cascade, the recognizer then at least the text stage; without audio
//     (a typed turn, a text completion) the recognizer is skipped and the
//     text stage reads the input as it is.
func (h *Head) planOf(snap *router.Snapshot, req Request) (plan, error) {
	stages := h.cfg.Pipeline.Stages
	p := plan{n: max(req.Stages, 1), streamed: h.cfg.Pipeline.StreamsBetweenStages()}
	if req.Speech {
		first := h.SpeechStages()
		p = plan{first: first, n: len(stages), text: first - 1, textGiven: true, streamed: true}
	}
	for i := p.first; i < p.n; i++ {
		if err := snap.CheckRoutable(i); err != nil {
			return p, h.noReplica(i, err)
		}
	}
	switch {
	case req.Speech:
		if out := (*h.fleet.outputs.Load())[p.n-1]; out != "" && out != stagepb.RoleAudio {
			return p, newError(ErrBadRequest, nil, "the pipeline makes no speech: its last stage %q gives %s, not audio", stages[p.n-1].Name, out)
		}
	case req.Transcribe:
		p.n = 1
		if err := checkTranscriber(snap, stages[0].Name); err != nil {
			return p, err
		}
	case len(stages) > 1 && recognizesSpeech(snap):
		p.recognize, p.first, p.text = hasAudio(req.Messages), 1, 1
		if p.n < 2 {
			p.n = 2 // text only: the recognizer, then the text stage
			if err := snap.CheckRoutable(1); err != nil {
				return p, h.noReplica(1, err)
			}
		}
	}
	p.streamed = p.streamed && p.n-p.first > 1
	for i := p.first + 1; i < p.n; i++ {
		if !takesTensors(snap, i) {
			continue
		}
		if p.tensors == nil {
			p.tensors = make([]bool, p.n)
		}
		p.tensors[i], p.streamed = true, true
		if i-1 != p.first {
			return p, newError(ErrBadRequest, nil, "stage %q takes the tensors of stage %q, which this request does not run first: a stage that gives tensors must be the first stage a request runs", stages[i].Name, stages[i-1].Name)
		}
	}
	return p, checkParts(snap, req.Messages, stages[0].Name)
}

// takesTensors reports whether stage takes the tensors of the stage before.
func (p plan) takesTensors(stage int) bool { return stage < len(p.tensors) && p.tensors[stage] }

// mark says on the request's span how it runs.
func (p plan) mark(span trace.Span) {
	switch {
	case p.textGiven:
		span.SetAttributes(attribute.Int("troupe.request.first_stage", p.first))
	case p.first > 0:
		span.SetAttributes(attribute.Bool("troupe.request.cascade", true))
	case p.streamed:
		span.SetAttributes(attribute.Bool("troupe.request.streamed", true))
	}
}

// run executes p on in: the recognizer first when p says so, then its
// stages at once or in turn. onText receives the text stage's text as it
// is made and req.OnAudio the last stage's audio. ttfa is the time to the
// last stage's first audio, from when the stages after the recognizer
// started.
func (h *Head) run(ctx context.Context, req Request, p plan, in *stagepb.GenerateRequest, onText func(string) error) (_ *Result, ttfa time.Duration, _ error) {
	if p.recognize {
		heard, err := h.runStage(ctx, &stageRun{req: req, stage: 0, n: p.n, in: in, route: &router.Request{SessionKey: req.SessionKey}})
		if err != nil {
			return nil, 0, err
		}
		in = &stagepb.GenerateRequest{RequestId: req.ID, Sampling: req.Sampling, Voice: req.Voice,
			Input: &stagepb.GenerateRequest_Chat{Chat: &stagepb.Chat{Messages: transcribed(req.Messages, heard.text.String())}}}
	}
	audio := newFirstAudio()
	var outputs []*stageOutput
	var err error
	if p.streamed {
		outputs, err = h.runAtOnce(ctx, req, p, in, onText, audio)
	} else {
		outputs, err = h.runInTurn(ctx, req, p, in, onText, audio)
	}
	if err != nil {
		return nil, 0, err
	}
	return p.result(in, outputs), audio.since(), nil
}

// runAtOnce runs p's stages at once: stage first a Generate of in, each
// later one fed by the one before while it runs.
func (h *Head) runAtOnce(ctx context.Context, req Request, p plan, in *stagepb.GenerateRequest, onText func(string) error, audio *firstAudio) ([]*stageOutput, error) {
	in.OutputCodesPerChunk = h.segmentUnits(p.first, p.n, stagepb.RoleCodes)
	if p.first != p.text || onText == nil { // text read as it is made goes a token at a time
		in.OutputWordsPerChunk = h.segmentUnits(p.first, p.n, stagepb.RoleText)
	}
	run := newStreamedRun(req, p, onText, audio)
	return h.runStreamed(ctx, run, func(gctx context.Context, i int) *stageRun {
		return h.streamedStage(gctx, run, i, in)
	})
}

// runInTurn runs p's stages one after the other, each on the output of
// the one before; the last stage's audio still reaches req.OnAudio as it
// is made.
func (h *Head) runInTurn(ctx context.Context, req Request, p plan, in *stagepb.GenerateRequest, onText func(string) error, audio *firstAudio) ([]*stageOutput, error) {
	outputs := make([]*stageOutput, p.n)
	for i := p.first; i < p.n; i++ {
		rel, n := i-p.text, p.n-p.text // stage and stages counted from the text stage
		sr := &stageRun{req: req, stage: i, n: p.n, in: in, route: routeOf(in, req.SessionKey),
			forward: sequentialForwarder(req, onText, rel, n, audio), audioToClient: rel == n-1 && rel > 0 && req.OnAudio != nil}
		// What the client does not read as it is made, nobody reads
		// before the stage ends.
		if readByClient(req, onText, rel, n) {
			sr.flush = req.Flush
		} else {
			in.HoldOutputMs = h.holdOutputMs()
		}
		out, err := h.runStage(ctx, sr)
		if err != nil {
			return nil, err
		}
		outputs[i] = out
		if i == p.n-1 {
			break
		}
		next, err := nextInput((*h.fleet.outputs.Load())[i], out)
		if err != nil {
			return nil, err
		}
		next.RequestId, next.Voice = req.ID, req.Voice
		next.Sampling = &stagepb.SamplingParams{Seed: seedOf(req.Sampling)}
		in = next
	}
	return outputs, nil
}

// result is the request's result from its stages' outputs: the text
// stage's text and usage (for speech, the client's text and the first
// stage's usage), the last truncation, and the last codes and audio.
func (p plan) result(in *stagepb.GenerateRequest, outputs []*stageOutput) *Result {
	res := &Result{}
	if p.textGiven {
		res.Text, res.PromptTokens, res.CompletionTokens = in.GetText(), outputs[p.first].promptTokens, outputs[p.first].generationTokens
	}
	for i := p.first; i < p.n; i++ {
		stage := i
		if i == p.text {
			stage = 0 // Result.add's text stage
		}
		res.add(stage, outputs[i])
	}
	return res
}

// hasAudio reports whether a conversation carries audio to recognize.
func hasAudio(msgs []*stagepb.ChatMessage) bool {
	for _, m := range msgs {
		for _, p := range m.GetParts() {
			if p.GetKind() == stagepb.PartAudio {
				return true
			}
		}
	}
	return false
}

// recognizesSpeech reports whether stage 0 is a speech recognizer: every
// routable replica of it takes audio. It reads the snapshot's counts, not
// the stage's replicas: it runs on every chat request.
func recognizesSpeech(snap *router.Snapshot) bool { return snap.EveryReplicaTakesAudio(0) }

// checkTranscriber refuses a transcription unless every routable replica
// of stage 0 takes audio (a speech recognizer).
func checkTranscriber(snap *router.Snapshot, stage string) error {
	if snap.EveryReplicaTakesAudio(0) {
		return nil // the snapshot's counts: no replica read
	}
	for rep := range snap.Stage(0).All() {
		if rep.Engine.InputRole != stagepb.RoleAudio {
			return newError(ErrBadRequest, nil, "the pipeline has no speech recognition: its first stage %q takes %s, not audio (engine %s)", stage, rep.Engine.InputRole, rep.Engine.Name)
		}
	}
	return nil
}

// transcribed is msgs with the audio parts replaced by transcript, as
// text, so that a text stage reads what was said. A message's content
// becomes its text parts joined by "\n", as the head makes it.
func transcribed(msgs []*stagepb.ChatMessage, transcript string) []*stagepb.ChatMessage {
	out := make([]*stagepb.ChatMessage, len(msgs))
	for i, m := range msgs {
		if len(m.GetParts()) == 0 {
			out[i] = m
			continue
		}
		var texts []string
		for _, p := range m.GetParts() {
			switch p.GetKind() {
			case stagepb.PartText:
				texts = append(texts, p.GetText())
			case stagepb.PartAudio:
				texts = append(texts, transcript)
			}
		}
		out[i] = &stagepb.ChatMessage{Role: m.GetRole(), Content: strings.Join(texts, "\n")}
	}
	return out
}
