package orchestrator

import (
	"context"
	"strings"
	"time"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// recognizesSpeech reports whether stage 0 is a speech recognizer: every
// routable replica of it takes audio. A chat request then runs as a
// cascade (executeCascade). It reads the snapshot's counts, not the
// stage's replicas: it runs on every chat request.
func recognizesSpeech(snap *router.Snapshot) bool { return snap.EveryReplicaTakesAudio(0) }

// executeCascade runs a chat request through a pipeline whose stage 0
// recognizes speech (asr → thinker → …): stage 0 transcribes the
// conversation's audio; stage 1, the text stage, answers the conversation
// with each audio part replaced by the transcript, and its text is the
// client's (onText, usage); the later stages speak it, the last one's
// audio to req.OnAudio. The recognition ends before the text stage starts
// (its transcript is the text stage's prompt); the stages after it run as
// executeStreamed runs a pipeline's stages, all at once, each fed by the
// one before while it runs, so that the audio starts while the text stage
// still writes — or one after the other when the pipeline does not stream
// between stages.
func (h *Head) executeCascade(ctx context.Context, req Request, n int, in *stagepb.GenerateRequest, onText func(string) error) (*Result, time.Duration, error) {
	heard, err := h.runStage(ctx, &stageRun{req: req, stage: 0, n: n, in: in, route: &router.Request{SessionKey: req.SessionKey}})
	if err != nil {
		return nil, 0, err
	}
	next := &stagepb.GenerateRequest{RequestId: req.ID, Sampling: req.Sampling, Voice: req.Voice,
		Input: &stagepb.GenerateRequest_Chat{Chat: &stagepb.Chat{Messages: transcribed(req.Messages, heard.text.String())}}}
	if h.cfg.Pipeline.StreamsBetweenStages() {
		return h.cascadeStreamed(ctx, req, n, next, onText)
	}
	return h.cascadeSequential(ctx, req, n, next, onText)
}

// cascadeStreamed runs stages 1..n-1 of a cascade at once on prompt, the
// transcribed conversation, through the streamed-stage path (runStreamed):
// stage 1 is a Generate of prompt whose text goes to onText and to the
// next stage as it is made.
func (h *Head) cascadeStreamed(ctx context.Context, req Request, n int, prompt *stagepb.GenerateRequest, onText func(string) error) (*Result, time.Duration, error) {
	prompt.OutputCodesPerChunk = h.segmentUnits(1, n, stagepb.RoleCodes)
	if onText == nil {
		prompt.OutputWordsPerChunk = h.segmentUnits(1, n, stagepb.RoleText)
	}
	run := newStreamedRun(req, 1, n, onText)
	run.text = 1
	outputs, err := h.runStreamed(ctx, run, 1, func(gctx context.Context, i int) *stageRun {
		sr := h.streamedStage(gctx, run, i, prompt)
		if i == 1 {
			// Its input is the transcribed conversation, whole: a Generate
			// routed on it.
			sr.input, sr.in = nil, prompt
			sr.route = routeOf(prompt, req.SessionKey)
		}
		return sr
	})
	if err != nil {
		return nil, 0, err
	}
	res := &Result{}
	res.add(0, outputs[1]) // the text stage: the client's text and usage
	for i := 2; i < n; i++ {
		res.add(i, outputs[i])
	}
	return res, run.audio.since(), nil
}

// cascadeSequential runs stages 1..n-1 of a cascade one after the other
// on next, the transcribed conversation (a pipeline with streaming off).
func (h *Head) cascadeSequential(ctx context.Context, req Request, n int, next *stagepb.GenerateRequest, onText func(string) error) (*Result, time.Duration, error) {
	audio := newFirstAudio()
	res := &Result{}
	for i := 1; i < n; i++ {
		sr := &stageRun{req: req, stage: i, n: n, in: next, route: &router.Request{SessionKey: req.SessionKey}}
		switch {
		case i == 1 && onText != nil:
			sr.flush = req.Flush
			sr.forward = func(o output) (bool, error) {
				if o.text == "" {
					return false, nil
				}
				return true, onText(o.text)
			}
		case i == n-1:
			sr.forward = sequentialForwarder(req, nil, i, n, audio)
			if req.OnAudio != nil {
				sr.flush = req.Flush
			}
		}
		out, err := h.runStage(ctx, sr)
		if err != nil {
			return nil, 0, err
		}
		if i == 1 {
			res.add(0, out) // the text stage: the client's text and usage
		} else {
			res.add(i, out)
		}
		if i == n-1 {
			break
		}
		if next, err = nextInput((*h.fleet.outputs.Load())[i], out); err != nil {
			return nil, 0, err
		}
		next.RequestId, next.Voice = req.ID, req.Voice
		next.Sampling = &stagepb.SamplingParams{Seed: seedOf(req.Sampling)}
	}
	return res, audio.since(), nil
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
