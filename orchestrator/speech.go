package orchestrator

import (
	"context"
	"time"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// SpeechStages is the first of the stages that turn text into audio, for
// a request that gives that text itself (Request.FirstStage; the speech
// endpoint): the stage after the last one, before the pipeline's last
// stage, whose routed replicas give text. It is 1 (after the thinker) while
// the head knows no roles yet, and 0 for a one-stage pipeline.
func (h *Head) SpeechStages() int {
	n := len(h.cfg.Pipeline.Stages)
	if n == 1 {
		return 0
	}
	outputs := *h.fleet.outputs.Load()
	for i := n - 2; i >= 0; i-- {
		if outputs[i] == stagepb.RoleText {
			return i + 1
		}
	}
	return 1
}

// executeFrom runs the stages first..n-1 of req on its prompt, as if stage
// first-1 had written it: all at once, each fed by the one before while it
// runs, as executeStreamed does after stage 0. The last stage's audio goes
// to req.OnAudio as it is made. The result's usage is the first stage's.
func (h *Head) executeFrom(ctx context.Context, req Request, first, n int, in *stagepb.GenerateRequest) (*Result, time.Duration, error) {
	if out := (*h.fleet.outputs.Load())[n-1]; out != "" && out != stagepb.RoleAudio {
		return nil, 0, newError(ErrBadRequest, nil, "the pipeline makes no speech: its last stage %q gives %s, not audio", h.cfg.Pipeline.Stages[n-1].Name, out)
	}
	in.OutputCodesPerChunk = h.segmentUnits(first, n, stagepb.RoleCodes)
	if first < n-1 {
		in.OutputWordsPerChunk = h.segmentUnits(first, n, stagepb.RoleText)
	}
	run := newStreamedRun(req, first, n, nil)
	outputs, err := h.runStreamed(ctx, run, first, func(gctx context.Context, i int) *stageRun {
		sr := h.streamedStage(gctx, run, i, in)
		if i == first {
			// Its input is the request's text, whole: a Generate routed on it.
			sr.input, sr.in = nil, in
			sr.route = &router.Request{Text: in.GetText(), SessionKey: req.SessionKey}
		}
		return sr
	})
	if err != nil {
		return nil, 0, err
	}
	res := &Result{Text: in.GetText(), PromptTokens: outputs[first].promptTokens, CompletionTokens: outputs[first].generationTokens}
	for i := first; i < n; i++ {
		res.add(i, outputs[i])
	}
	return res, run.audio.since(), nil
}

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
