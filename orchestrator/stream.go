package orchestrator

import (
	"context"
	"strings"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// streamedRun is the state one streamed request shares between its stage
// goroutines.
type streamedRun struct {
	req    Request
	first  int // the stage that gets the request's input whole
	n      int
	onText func(string) error
	// text is the stage whose text the client reads through onText and
	// whose usage is the request's (plan.text).
	text   int
	inputs []*stageInput // by stage; nil up to first, whose input is whole
	// routes, by stage, say where the attempt of a stage that takes the
	// tensors of the stage before is; nil for other stages.
	routes []*tensorRoute
	audio  *firstAudio
}

// newStreamedRun makes the run of p's stages, each after the first fed by
// the one before it.
func newStreamedRun(req Request, p plan, onText func(string) error, audio *firstAudio) *streamedRun {
	run := &streamedRun{req: req, first: p.first, n: p.n, onText: onText, text: p.text, inputs: make([]*stageInput, p.n), audio: audio}
	run.routes = make([]*tensorRoute, p.n)
	for i := p.first + 1; i < p.n; i++ {
		run.inputs[i] = newStageInput()
		if p.takesTensors(i) {
			run.routes[i] = newTensorRoute()
		}
	}
	return run
}

// runStreamed runs the stages first..run.n-1 at once, each described by
// stageOf, through the one attempt loop (runStage). The goroutines are
// owned by an errgroup: the first stage to fail cancels the others, and
// runStreamed returns once every one has ended. A stage that ends closes
// the next one's input. outputs is indexed by stage (nil before first).
func (h *Head) runStreamed(ctx context.Context, run *streamedRun, stageOf func(gctx context.Context, stage int) *stageRun) (outputs []*stageOutput, err error) {
	n := run.n
	outputs = make([]*stageOutput, n)
	g, gctx := errgroup.WithContext(ctx)
	for i := run.first; i < n; i++ {
		sr := stageOf(gctx, i)
		g.Go(func() error {
			out, err := h.runStage(gctx, sr)
			if err != nil {
				return err
			}
			outputs[i] = out
			if i+1 < n {
				run.inputs[i+1].close()
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	return outputs, nil
}

// streamedStage describes stage of a streamed request for the attempt
// loop. Stage first is a Generate of in, routed on it; a later stage is
// fed by the stage before, routed on the session key and load only (its
// input is not known when it starts).
func (h *Head) streamedStage(ctx context.Context, run *streamedRun, stage int, in *stagepb.GenerateRequest) *stageRun {
	req := run.req
	sr := &stageRun{req: req, stage: stage, n: run.n, in: in, route: &router.Request{SessionKey: req.SessionKey},
		forward: run.forwarder(ctx, stage), streamed: true}
	read := readByClient(req, run.onText, stage-run.text, run.n-run.text)
	if read {
		sr.flush = req.Flush
	}
	sr.audioToClient = read && stage == run.n-1
	if stage+1 < run.n {
		sr.tensorsOut = run.routes[stage+1]
	}
	sr.tensorsIn = run.routes[stage]
	if stage == run.first {
		sr.route = routeOf(in, req.SessionKey)
		return sr
	}
	sr.input = run.inputs[stage]
	sr.in = &stagepb.GenerateRequest{RequestId: req.ID, Voice: req.Voice, Sampling: &stagepb.SamplingParams{Seed: seedOf(in.GetSampling())}}
	if stage == run.n-1 && !read {
		sr.in.HoldOutputMs = h.holdOutputMs() // the last stage's output: read when it ends
	}
	return sr
}

// forwarder is stage's forwarder: stage run.text's text goes to the
// client, each stage's output but the last's to the next stage's input,
// and the last stage's audio to req.OnAudio (its first audio stops the
// audio clock).
// Only the text is visible (see forwarder): a failed last stage is
// retried and skips the samples the client already has.
func (run *streamedRun) forwarder(ctx context.Context, stage int) forwarder {
	last := stage == run.n-1
	return func(o output) (bool, error) {
		visible := false
		if stage == run.text && run.onText != nil && o.text != "" {
			visible = true
			if err := run.onText(o.text); err != nil {
				return true, err
			}
		}
		if !last {
			if run.routes[stage+1] != nil {
				return visible, nil // the next stage takes this one's tensors, worker to worker
			}
			return visible, run.inputs[stage+1].append(ctx, piece{text: o.text, codes: o.codes, at: time.Now()})
		}
		if len(o.pcm) > 0 {
			run.audio.mark()
			if run.req.OnAudio != nil {
				return visible, run.req.OnAudio(o.pcm, o.sampleRate)
			}
		}
		return visible, nil
	}
}

// segmentUnits is GenerateRequest.output_codes_per_chunk (role codes) or
// output_words_per_chunk (role text) for stage of a streamed request
// through n stages: the next stage's segment size (it cannot start a
// segment on fewer) when this stage gives it role, else 0. A stall timeout
// too short for a worker's longest hold asks for none. Words are asked
// for only when the client does not read the text as it is made: the
// caller's rule.
func (h *Head) segmentUnits(stage, n int, role string) uint32 {
	if stage+1 >= n || (*h.fleet.outputs.Load())[stage] != role || h.cfg.StallTimeout < 2*stagepb.MaxHeldOutput {
		return 0
	}
	if units := h.cfg.Pipeline.Stages[stage+1].InputChunk; units > 0 {
		return uint32(units)
	}
	if role == stagepb.RoleCodes {
		return stagepb.DefaultSegmentCodes
	}
	return stagepb.DefaultSegmentWords
}

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

// started reports whether the input has its first piece, or ended
// without one: an attempt starting now sends its first message at once.
func (in *stageInput) started() bool {
	in.mu.Lock()
	defer in.mu.Unlock()
	return len(in.pieces) > 0 || in.closed
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

// availableWaiting is available, with stall's clock standing while it
// waits for piece i, and the wait counted in w.
func (in *stageInput) availableWaiting(ctx context.Context, i int, stall *stallWatch, w *inputWait) ([]piece, bool, error) {
	in.mu.Lock()
	there := i < len(in.pieces) || in.closed
	in.mu.Unlock()
	if !there {
		stall.pause()
		defer stall.resume()
		w.start()
		defer w.end()
	}
	return in.available(ctx, i)
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

// openStreamed opens GenerateStream on the attempt's replica and starts the
// goroutine that sends the stage's input as it arrives (sendInput); the
// returned wait waits for it.
func (h *Head) openStreamed(ctx context.Context, a *attemptRun, stall *stallWatch) (chunkStream, func(), error) {
	stream, err := a.rep.Client.GenerateStream(ctx, h.callOptions()...)
	if err != nil {
		return nil, func() {}, err
	}
	a.sr.input.restart()
	done := make(chan struct{})
	go func() {
		defer close(done)
		if a.sr.tensorsIn != nil {
			h.sendTicket(ctx, a, stream)
			return
		}
		h.sendInput(ctx, a, stream, stall)
	}()
	return stream, func() { <-done }, nil
}

// sendInput sends the stage's input log from its first piece, every piece
// that is there as one message, until the log ends or the attempt does
// (Recv then reports why). The request header goes out with the first
// piece. Each piece sent is progress; the stall clock stands while the
// sender waits for a piece the stage before has not made.
func (h *Head) sendInput(ctx context.Context, a *attemptRun, stream stagepb.StageService_GenerateStreamClient, stall *stallWatch) {
	in, stage := a.sr.input, a.sr.stage
	units := uint32(max(h.cfg.Pipeline.Stages[stage].InputChunk, 0))
	role := (*h.fleet.outputs.Load())[stage-1] // what the stage before gives
	for i := 0; ; {
		ps, ok, err := in.availableWaiting(ctx, i, stall, &a.wait)
		if err != nil {
			return
		}
		if !ok {
			if i == 0 { // the previous stage made nothing: an empty text input
				if err := stream.Send(h.header(a.sr, role, units, piece{})); err != nil {
					return
				}
			}
			_ = stream.CloseSend()
			return
		}
		p := joined(ps)
		msg := &stagepb.StreamInput{Text: p.text, Codes: p.codes}
		if i == 0 {
			msg = h.header(a.sr, role, units, p)
			a.span.AddEvent("first_input")
		}
		if err := stream.Send(msg); err != nil {
			return
		}
		if i == 0 {
			a.call.InputSent() // from now the attempt queues on the replica
		}
		for _, p := range ps {
			h.pipeline.Handoff(stage-1, time.Since(p.at))
		}
		i += len(ps)
		in.markSent(i - 1)
		stall.progress()
	}
}

// header is the first message of a fed stage's GenerateStream: the stage's
// request with the first piece p as its input, whose kind (text or codes)
// is what the stage before gives (role), as the sequential path decides it
// (see nextInput).
func (h *Head) header(sr *stageRun, role string, units uint32, p piece) *stagepb.StreamInput {
	r := proto.Clone(sr.in).(*stagepb.GenerateRequest)
	if inputKind(role, len(p.codes) > 0) == stagepb.RoleCodes {
		r.Input = &stagepb.GenerateRequest_Codes{Codes: &stagepb.Codes{Codes: p.codes}}
	} else {
		r.Input = &stagepb.GenerateRequest_Text{Text: p.text}
	}
	r.OutputCodesPerChunk = h.segmentUnits(sr.stage, sr.n, stagepb.RoleCodes)
	return &stagepb.StreamInput{Request: r, SegmentUnits: units}
}

// The head's flow-control windows on its connections to replicas
// (FlowControlDialOptions). gRPC would otherwise grow a stream's receive
// window with its bandwidth-delay estimate, up to 16 MiB: that much of a
// stage's output per stream the head could hold while nobody reads it (a
// client that does not read, and through it the stages before). Fixed
// windows bound it, and bound nothing else that matters here:
//
//   - StreamWindow, 64 KiB (gRPC's least, HTTP/2's initial): a stream
//     carries at most a window per round trip, 64 MiB/s at a LAN's 1 ms and
//     1.3 MiB/s at 50 ms, against 48 KB/s of 24 kHz PCM16 audio and far less
//     text or codes. The head holds at most this much received and unread
//     per stream.
//   - ConnWindow, 4 MiB: what all the streams of one connection carry per
//     round trip (4 GiB/s at 1 ms, 80 MiB/s at 50 ms: 1,700 audio streams).
//     gRPC gives it back as data arrives, not as it is read, so it holds
//     nothing of its own.
const (
	StreamWindow = 64 << 10
	ConnWindow   = 4 << 20
)

// FlowControlDialOptions are the dial options that set the head's windows
// (StreamWindow, ConnWindow); they turn gRPC's window estimate off.
func FlowControlDialOptions() []grpc.DialOption {
	return []grpc.DialOption{grpc.WithInitialWindowSize(StreamWindow), grpc.WithInitialConnWindowSize(ConnWindow)}
}
