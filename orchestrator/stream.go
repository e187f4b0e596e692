package orchestrator

import (
	"context"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/errgroup"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// inputWindow is how many pieces of a stage's input may wait for its
// sender. Beyond it the previous stage's forwarding blocks, and with it
// that stage's gRPC stream: a slow stage slows the one before it.
const inputWindow = 16

// piece is one chunk of a stage's output, forwarded as the next stage's
// input.
type piece struct {
	text  string
	codes []uint32
	at    time.Time // when the head received it
}

// stageInput is one stage's input in a streamed request: every piece the
// previous stage forwarded, in order, kept whole so that a retry can replay
// it. The previous stage's goroutine appends and closes; the sender of the
// stage's current attempt reads. All methods are safe for concurrent use.
type stageInput struct {
	mu      sync.Mutex
	pieces  []piece
	closed  bool          // the previous stage finished
	sent    int           // pieces the current attempt has sent
	changed chan struct{} // closed and replaced on every change
}

func newStageInput() *stageInput { return &stageInput{changed: make(chan struct{})} }

func (in *stageInput) notifyLocked() {
	close(in.changed)
	in.changed = make(chan struct{})
}

// append adds a piece, waiting while the current attempt is more than
// inputWindow pieces behind.
func (in *stageInput) append(ctx context.Context, p piece) error {
	for {
		in.mu.Lock()
		if len(in.pieces)-in.sent < inputWindow {
			in.pieces = append(in.pieces, p)
			in.notifyLocked()
			in.mu.Unlock()
			return nil
		}
		ch := in.changed
		in.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// close marks the input complete.
func (in *stageInput) close() {
	in.mu.Lock()
	in.closed = true
	in.notifyLocked()
	in.mu.Unlock()
}

// restart starts a new attempt's reading from the first piece.
func (in *stageInput) restart() {
	in.mu.Lock()
	in.sent = 0
	in.notifyLocked()
	in.mu.Unlock()
}

// next returns piece i once it is there; ok is false when the input ended
// before it.
func (in *stageInput) next(ctx context.Context, i int) (p piece, ok bool, err error) {
	for {
		in.mu.Lock()
		if i < len(in.pieces) {
			p = in.pieces[i]
			in.mu.Unlock()
			return p, true, nil
		}
		if in.closed {
			in.mu.Unlock()
			return piece{}, false, nil
		}
		ch := in.changed
		in.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return piece{}, false, ctx.Err()
		}
	}
}

// available returns pieces i and every one after it that is there now,
// waiting for i like next. The sender sends them as one message: under
// load a slow send lets pieces gather, and the next stage takes text and
// codes in any cut, while the first piece never waits for a second. The
// returned slice is shared and must not be changed.
func (in *stageInput) available(ctx context.Context, i int) (ps []piece, ok bool, err error) {
	if _, ok, err = in.next(ctx, i); !ok || err != nil {
		return nil, ok, err
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.pieces[i:len(in.pieces):len(in.pieces)], true, nil
}

// joined is pieces as one: their text and codes one after the other, and
// the time of the first.
func joined(ps []piece) piece {
	if len(ps) == 1 {
		return ps[0]
	}
	var text strings.Builder
	var codes []uint32
	for _, p := range ps {
		text.WriteString(p.text)
		codes = append(codes, p.codes...)
	}
	return piece{text: text.String(), codes: codes, at: ps[0].at}
}

// markSent records that pieces [0, i] went out, freeing the window.
func (in *stageInput) markSent(i int) {
	in.mu.Lock()
	in.sent = max(in.sent, i+1)
	in.notifyLocked()
	in.mu.Unlock()
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

// streamedRun is the state one streamed request shares between its stage
// goroutines.
type streamedRun struct {
	req     Request
	n       int
	start   time.Time
	onText  func(string) error
	inputs  []*stageInput // by stage; nil for stage 0, whose input is the prompt
	prompt  *stagepb.GenerateRequest
	ttfaMu  sync.Mutex
	ttfa    time.Duration
	outputs []*stageOutput
}

// executeStreamed runs every stage at once: each stage's output chunks are
// forwarded to the next stage while it is still generating, and the last
// stage's audio goes to req.OnAudio as it is made. The first stage to fail
// cancels the others; its error is the request's.
func (h *Head) executeStreamed(ctx context.Context, req Request, n int, prompt *stagepb.GenerateRequest, onText func(string) error) (*Result, time.Duration, error) {
	prompt.OutputCodesPerChunk = h.codesPerChunk(0, n)
	prompt.OutputWordsPerChunk = h.wordsPerChunk(0, n, readByClient(req, onText, 0, n))
	run := &streamedRun{req: req, n: n, start: time.Now(), onText: onText, prompt: prompt,
		inputs: make([]*stageInput, n), outputs: make([]*stageOutput, n)}
	for i := 1; i < n; i++ {
		run.inputs[i] = newStageInput()
	}
	g, gctx := errgroup.WithContext(ctx)
	for i := range n {
		g.Go(func() error {
			out, err := h.runStreamedStage(gctx, run, i)
			if err != nil {
				return err
			}
			run.outputs[i] = out
			if i+1 < n {
				run.inputs[i+1].close()
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return nil, 0, err
	}
	res := &Result{}
	for i, out := range run.outputs {
		if i == 0 {
			res.Text, res.FinishReason = out.text.String(), out.finish
			res.PromptTokens, res.CompletionTokens = out.promptTokens, out.generationTokens
		} else if out.finish == stagepb.FinishReason_FINISH_REASON_LENGTH.Name() {
			res.AudioTruncated = true
			res.FinishReason = out.finish
		}
		if len(out.codes) > 0 {
			res.Codes = out.codes
		}
		if len(out.pcm) > 0 {
			res.PCM, res.SampleRate = out.pcm, out.sampleRate
		}
	}
	return res, run.ttfa, nil
}

// runStreamedStage runs one stage of a streamed request, retrying once on
// another replica as runStage does. A retry replays the whole input so far
// and skips the output the failed attempt already forwarded.
func (h *Head) runStreamedStage(ctx context.Context, run *streamedRun, stage int) (*stageOutput, error) {
	var failed []*router.Replica
	var lastErr error
	var delivered outputCursor
	var moved migrated       // stage 0: what a failed replica gave the client before a migration
	var movedAt outputCursor // delivered at the migration: the continuation's output comes after it
	prompt := run.prompt     // stage 0's request; a migration continues it
	last := stage == run.n-1
	// Only stage 0's input is known before the stage starts; later stages
	// are routed on the session key and load.
	route := &router.Request{SessionKey: run.req.SessionKey}
	if stage == 0 {
		route = routeOf(run.prompt, run.req.SessionKey)
	}
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
		// A retry skips what an earlier attempt forwarded; a continuation
		// makes only what follows, so it skips nothing of its own.
		skip := outputCursor{text: delivered.text - movedAt.text, codes: delivered.codes - movedAt.codes, pcm: delivered.pcm - movedAt.pcm}
		var clientText migrated // what this attempt gave the client
		var span trace.Span
		forward := func(c *stagepb.GenerateChunk) (bool, error) {
			text, codes, pcm := skip.cut(c)
			if text == "" && len(codes) == 0 && len(pcm) == 0 {
				return false, nil
			}
			if delivered == (outputCursor{}) {
				span.AddEvent("first_output_forwarded")
			}
			delivered.text += len(text)
			delivered.codes += len(codes)
			delivered.pcm += len(pcm)
			visible := false
			if stage == 0 && run.onText != nil && text != "" {
				visible = true
				clientText.text += text
				clientText.tokens += int(c.GetStats().GetGenerationTokens())
				if err := run.onText(text); err != nil {
					return true, err
				}
			}
			if !last {
				return visible, run.inputs[stage+1].append(ctx, piece{text: text, codes: codes, at: time.Now()})
			}
			if len(pcm) > 0 {
				run.ttfaMu.Lock()
				if run.ttfa == 0 {
					run.ttfa = time.Since(run.start)
				}
				run.ttfaMu.Unlock()
				if run.req.OnAudio != nil {
					return true, run.req.OnAudio(pcm, int(c.GetSampleRate()))
				}
			}
			return visible, nil
		}
		open := func(ctx context.Context, s trace.Span, progress func()) (chunkStream, func(), error) {
			span = s
			if stage == 0 {
				if moved.count > 0 {
					s.SetAttributes(attribute.Bool("troupe.migration", true), attribute.Int("troupe.migration.delivered_chars", len(moved.text)))
				}
				return h.openGenerate(ctx, rep, prompt)
			}
			return h.openStreamed(ctx, run, stage, rep, s, progress)
		}
		var flush func() error
		if readByClient(run.req, run.onText, stage, run.n) {
			flush = run.req.Flush
		}
		out, produced, err := h.attempt(ctx, run.req, stage, d, attempt, prompt.GetSampling(), open, forward, flush)
		if err == nil {
			return moved.prepend(out), nil
		}
		lastErr = err
		if next, finished, ok := h.migrate(ctx, stage, rep, err, produced, &moved, clientText, run.prompt); ok {
			if finished != nil {
				return finished, nil
			}
			prompt, movedAt = next, delivered
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

// codesPerChunk is GenerateRequest.output_codes_per_chunk for stage of a
// streamed request through n stages: the next stage's segment size when
// this stage gives it codes (it cannot start a segment on fewer), else 0.
// A stall timeout too short for a worker's longest hold asks for none.
func (h *Head) codesPerChunk(stage, n int) uint32 {
	if stage+1 >= n || (*h.outputs.Load())[stage] != stagepb.RoleCodes || h.cfg.StallTimeout < 2*stagepb.MaxHeldOutput {
		return 0
	}
	if units := h.cfg.Pipeline.Stages[stage+1].InputChunk; units > 0 {
		return uint32(units)
	}
	return stagepb.DefaultSegmentCodes
}

// wordsPerChunk is GenerateRequest.output_words_per_chunk for stage of a
// streamed request through n stages: the next stage's segment size in
// words when this stage gives it text and the client does not read that
// text as it is made (read), else 0. Like codesPerChunk, none with a short
// stall timeout.
func (h *Head) wordsPerChunk(stage, n int, read bool) uint32 {
	if read || stage+1 >= n || (*h.outputs.Load())[stage] != stagepb.RoleText || h.cfg.StallTimeout < 2*stagepb.MaxHeldOutput {
		return 0
	}
	if units := h.cfg.Pipeline.Stages[stage+1].InputChunk; units > 0 {
		return uint32(units)
	}
	return stagepb.DefaultSegmentWords
}

// openStreamed opens GenerateStream on rep and starts the goroutine that
// sends the stage's input as it arrives; the returned wait waits for it.
// The request header goes out with the first piece. The input's kind (text
// or codes) is what the stage before gives, as the sequential path decides
// it (see nextInput).
func (h *Head) openStreamed(ctx context.Context, run *streamedRun, stage int, rep *router.Replica, span trace.Span, progress func()) (chunkStream, func(), error) {
	stream, err := rep.Client.GenerateStream(ctx, h.callOptions()...)
	if err != nil {
		return nil, func() {}, err
	}
	in := run.inputs[stage]
	in.restart()
	units := uint32(max(h.cfg.Pipeline.Stages[stage].InputChunk, 0))
	done := make(chan struct{})
	go func() {
		defer close(done)
		role := (*h.outputs.Load())[stage-1] // what the stage before gives
		header := func(p piece) *stagepb.StreamInput {
			r := &stagepb.GenerateRequest{RequestId: run.req.ID, Voice: run.req.Voice, Sampling: &stagepb.SamplingParams{Seed: seedOf(run.prompt.GetSampling())}}
			if inputKind(role, len(p.codes) > 0) == stagepb.RoleCodes {
				r.Input = &stagepb.GenerateRequest_Codes{Codes: &stagepb.Codes{Codes: p.codes}}
			} else {
				r.Input = &stagepb.GenerateRequest_Text{Text: p.text}
			}
			if stage == run.n-1 && !readByClient(run.req, run.onText, stage, run.n) {
				r.HoldOutputMs = h.holdOutputMs() // the last stage's output: read when it ends
			}
			r.OutputCodesPerChunk = h.codesPerChunk(stage, run.n)
			return &stagepb.StreamInput{Request: r, SegmentUnits: units}
		}
		for i := 0; ; {
			ps, ok, err := in.available(ctx, i)
			if err != nil {
				return // the attempt ended; Recv reports why
			}
			if !ok {
				if i == 0 { // the previous stage made nothing: an empty text input
					if err := stream.Send(header(piece{})); err != nil {
						return
					}
				}
				_ = stream.CloseSend()
				return
			}
			p := joined(ps)
			msg := &stagepb.StreamInput{Text: p.text, Codes: p.codes}
			if i == 0 {
				msg = header(p)
				span.AddEvent("first_input")
			}
			if err := stream.Send(msg); err != nil {
				return // Recv reports the stream's error
			}
			for _, p := range ps {
				h.pipeline.Handoff(stage-1, time.Since(p.at))
			}
			i += len(ps)
			in.markSent(i - 1)
			progress()
		}
	}()
	return stream, func() { <-done }, nil
}
