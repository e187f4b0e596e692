package worker

import (
	"context"
	"errors"
	"io"
	"strings"
	"time"
	"unicode"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// Continuer is an optional Engine interface. An engine whose
// ContinuesInput is true makes, for an input split into segments that are
// each run with the input before them as GenerateRequest.context, exactly
// the output it makes for the whole input at once: GenerateStream then
// starts on the first segment instead of waiting for the whole input.
type Continuer interface {
	ContinuesInput() bool
}

// SentenceSegmenter is an optional interface of a Continuer whose text
// segments should end at sentence ends only (a speech engine: a segment cut
// mid-sentence would be spoken with a break there). Its segments end after
// a sentence, or after maxSentenceWords words without one.
type SentenceSegmenter interface {
	SegmentsBySentence() bool
}

// maxSentenceWords bounds a segment of a SentenceSegmenter that meets no
// sentence end.
const maxSentenceWords = 48

// GenerateStream implements StageService: a request whose input arrives
// while it runs. The handler goroutine runs the engine segment by segment;
// a reader goroutine receives the input. The reader ends when the stream
// does, which gRPC ends when the handler returns, so a failed engine is
// reported at once even while the client is still sending.
func (svc *service) GenerateStream(stream grpc.BidiStreamingServer[stagepb.StreamInput, stagepb.GenerateChunk]) error {
	s := svc.s
	first, err := stream.Recv()
	if err != nil {
		return status.Errorf(codes.InvalidArgument, "GenerateStream ended before its request: %v", err)
	}
	req := first.GetRequest()
	if req == nil {
		return status.Error(codes.InvalidArgument, "the first message of GenerateStream must carry the request")
	}
	if err := s.checkInput(req); err != nil {
		return err
	}
	if !s.acquire() {
		return stagepb.DrainingError("worker: replica is draining and takes no new requests")
	}
	defer s.release()

	if sink := first.GetTensorSink(); sink != nil {
		return s.produce(stream, req, sink)
	}

	ctx, cancel := context.WithCancel(stream.Context())
	defer cancel()
	var tensors *inbox
	if s.inputRole == stagepb.RoleTensors {
		in, closeInbox, err := s.tensors.open(req.GetTensorTicket(), s.cfg.MaxRequestTensorBytes)
		if err != nil {
			return err
		}
		defer closeInbox()
		tensors = in
	}
	in := make(chan *stagepb.StreamInput)
	inErr := make(chan error, 1) // the reader's last word: nil at the end of input
	go func() {
		for {
			m, err := stream.Recv()
			if err != nil {
				if errors.Is(err, io.EOF) {
					err = nil
				}
				inErr <- err
				return
			}
			select {
			case in <- m:
			case <-ctx.Done():
				return
			}
		}
	}()

	seg := newSegmenter(req, first, s.cfg.Engine)
	seg.tensors = tensors
	seg.add(first)
	start := time.Now()
	var timings *stagepb.Timings
	obs := s.observe(req, start)
	send, flush := newOutputHolder(req, stream.Send)
	err = seg.run(ctx, in, inErr, func(r *stagepb.GenerateRequest, emit func(*stagepb.GenerateChunk) error) error {
		return s.cfg.Engine.Generate(ctx, r, emit)
	}, func(c *stagepb.GenerateChunk) error {
		if c.GetTimings() != nil {
			timings = c.GetTimings()
		}
		obs.chunk(c)
		return send(c)
	})
	if ferr := flush(); err == nil {
		err = ferr
	}
	if err == nil && tensors != nil {
		// Every output is out: the producer may forget the tensors.
		tensors.ack(tensors.receivedSeq())
	}
	obs.end(ctx, err)
	if timings != nil {
		recordPhases(ctx, start, timings)
	}
	return toStatus(err)
}

// produce runs a request whose engine's tensors go worker to worker:
// sink's attempt gets them (pusher), later messages of the stream each
// move it. The request's input is whole. Its final chunk goes to the head
// only once the consumer has acknowledged every push, so a consumer that
// fails before can be replaced and sent them again.
func (s *Server) produce(stream grpc.BidiStreamingServer[stagepb.StreamInput, stagepb.GenerateChunk], req *stagepb.GenerateRequest, sink *stagepb.TensorSink) error {
	ctx, cancel := context.WithCancel(stream.Context())
	p := newPusher(s.peers, sink, s.cfg.MaxTensorPushBytes, s.cfg.MaxRequestTensorBytes)
	pushed := make(chan struct{})
	go func() {
		defer close(pushed)
		p.run(ctx)
	}()
	defer func() { cancel(); <-pushed }()
	// The reader ends when the stream does, which gRPC ends when this
	// handler returns.
	go func() {
		for {
			m, err := stream.Recv()
			if err != nil {
				return
			}
			if sk := m.GetTensorSink(); sk != nil {
				p.setSink(sk)
			}
		}
	}()
	return s.generate(ctx, req, stream.Send, func(c *stagepb.GenerateChunk) error {
		if ts := c.GetTensors(); len(ts) > 0 {
			n, err := p.add(ts, false)
			if err != nil {
				return err
			}
			c.Tensors, c.TensorBytes = nil, uint64(n)
		}
		if c.GetFinishReason() != stagepb.FinishReason_FINISH_REASON_UNSPECIFIED {
			return p.finish(ctx)
		}
		return nil
	})
}

// segmenter gathers a streamed input and runs it through the engine one
// segment at a time. It is owned by one handler goroutine.
type segmenter struct {
	req       *stagepb.GenerateRequest
	codes     bool // codes input; otherwise text
	units     int  // words or codes per segment
	continues bool
	sentences bool // text segments end at sentence ends (SentenceSegmenter)
	ranAny    bool // a segment ran

	text     strings.Builder // text not yet run
	consumed strings.Builder // text already run: the next segment's context
	pending  []uint32        // codes not yet run
	ended    bool

	// tensors, for an engine that takes tensors, is where its input comes
	// from (worker to worker); the head's stream then carries none.
	tensors *inbox
	pushes  []*stagepb.TensorPush // received, not yet run

	segments int // segments run so far

	maxTokens int // 0: the engine's own limit per segment
	produced  int
	first     *stagepb.Timings
	prefill   float64
	t0        time.Time
}

func newSegmenter(req *stagepb.GenerateRequest, first *stagepb.StreamInput, eng Engine) *segmenter {
	g := &segmenter{req: req, maxTokens: int(req.GetSampling().GetMaxTokens())}
	_, g.codes = req.GetInput().(*stagepb.GenerateRequest_Codes)
	if c, ok := eng.(Continuer); ok {
		g.continues = c.ContinuesInput()
	}
	if s, ok := eng.(SentenceSegmenter); ok {
		g.sentences = s.SegmentsBySentence()
	}
	g.units = int(first.GetSegmentUnits())
	if g.units <= 0 {
		g.units = stagepb.DefaultSegmentWords
		if g.codes {
			g.units = stagepb.DefaultSegmentCodes
		}
	}
	return g
}

// add appends one message's input (the first message's request input too).
func (g *segmenter) add(m *stagepb.StreamInput) {
	if r := m.GetRequest(); r != nil {
		g.text.WriteString(r.GetText())
		g.pending = append(g.pending, r.GetCodes().GetCodes()...)
	}
	g.text.WriteString(m.GetText())
	g.pending = append(g.pending, m.GetCodes()...)
}

// next cuts the next segment off the pending input, or reports that none
// is ready yet. A segment is ready when it holds units words (cut at a
// word boundary) or codes, when a sentence ends, or when the input ended.
// An engine that cannot continue gets the whole input as one segment.
func (g *segmenter) next() (text string, codes []uint32, ok bool) {
	if !g.continues && !g.ended {
		return "", nil, false
	}
	if g.codes {
		if len(g.pending) == 0 || (!g.ended && len(g.pending) < g.units) {
			return "", nil, false
		}
		codes, g.pending = g.pending, nil
		return "", codes, true
	}
	pending := g.text.String()
	cut := len(pending)
	if !g.ended {
		units := g.units
		if g.sentences {
			units = maxSentenceWords
		}
		cut = textCut(pending, units)
	}
	if cut <= 0 || (g.ranAny && strings.TrimSpace(pending[:cut]) == "") {
		return "", nil, false // nothing, or only the whitespace after the last word
	}
	g.text.Reset()
	g.text.WriteString(pending[cut:])
	return pending[:cut], nil, true
}

// textCut returns where a text segment of pending ends: after the
// whitespace that follows the units-th word, or after the whitespace that
// follows a sentence end, whichever comes first; 0 when neither is there
// yet. A word is never split.
func textCut(pending string, units int) int {
	words := 0
	inWord := false
	var last rune
	for i, r := range pending {
		space := unicode.IsSpace(r)
		if space && inWord {
			words++
			inWord = false
			if words >= units || strings.ContainsRune(".!?;:", last) {
				return i + len(string(r))
			}
		}
		if !space {
			inWord = true
		}
		last = r
	}
	return 0
}

// run drives the segments until the input ends and the last segment ran,
// the output limit is reached, or something fails. generate runs one
// segment; send forwards a chunk to the client.
func (g *segmenter) run(ctx context.Context, in <-chan *stagepb.StreamInput, inErr <-chan error,
	generate func(*stagepb.GenerateRequest, func(*stagepb.GenerateChunk) error) error, send func(*stagepb.GenerateChunk) error) error {
	g.t0 = time.Now()
	for {
		if g.maxTokens > 0 && g.produced >= g.maxTokens {
			// The last segment stopped exactly at the limit: the rest of
			// the input is cut off.
			return send(&stagepb.GenerateChunk{FinishReason: stagepb.FinishReason_FINISH_REASON_LENGTH, Timings: g.timings()})
		}
		if g.tensors != nil {
			done, err := g.tensorStep(ctx, in, inErr, generate, send)
			if err != nil || done {
				return err
			}
			if !g.ended || len(g.pushes) > 0 {
				continue
			}
			break
		}
		text, cs, ok := g.next()
		if !ok {
			if g.ended {
				break
			}
			select {
			case m := <-in:
				g.add(m)
			case err := <-inErr:
				if err != nil {
					return status.Errorf(streamCode(err), "worker: input stream: %v", status.Convert(err).Message())
				}
				g.ended = true
			case <-ctx.Done():
				return ctx.Err()
			}
			continue
		}
		g.ranAny = true
		last := g.ended && strings.TrimSpace(g.text.String()) == "" && len(g.pending) == 0
		done, err := g.segment(text, cs, nil, last, generate, send)
		if err != nil || done {
			return err
		}
	}
	if !g.ranAny {
		// The input was empty: run it once, so the engine says what an
		// empty input makes (an error, or its natural output).
		done, err := g.segment("", nil, nil, true, generate, send)
		if err != nil || done {
			return err
		}
	}
	return send(&stagepb.GenerateChunk{FinishReason: stagepb.FinishReason_FINISH_REASON_STOP, Timings: g.timings()})
}

// tensorStep takes the pushes that arrived and runs them as one segment
// when the engine continues input (or when the last has come), or waits
// for a change: a push, the head's stream's end, or ctx. A segment's
// pushes are acknowledged once it ran, but for the last push, which the
// handler acknowledges once every output is out.
func (g *segmenter) tensorStep(ctx context.Context, in <-chan *stagepb.StreamInput, inErr <-chan error,
	generate func(*stagepb.GenerateRequest, func(*stagepb.GenerateChunk) error) error, send func(*stagepb.GenerateChunk) error) (done bool, err error) {
	ps, last, changed := g.tensors.take()
	g.pushes = append(g.pushes, ps...)
	g.ended = g.ended || last
	if len(g.pushes) == 0 || (!g.continues && !g.ended) {
		if g.ended {
			return false, nil
		}
		select {
		case <-changed:
		case <-in: // the head sends nothing more to a stage that takes tensors
		case err := <-inErr:
			if err != nil {
				return true, status.Errorf(streamCode(err), "worker: input stream: %v", status.Convert(err).Message())
			}
		case <-ctx.Done():
			return true, ctx.Err()
		}
		return false, nil
	}
	ts, err := concatTensors(g.pushes)
	if err != nil {
		return true, err
	}
	seq := g.pushes[len(g.pushes)-1].GetSeq()
	lastIn := g.pushes[len(g.pushes)-1].GetLast()
	g.pushes = nil
	if len(ts) > 0 || !g.ranAny && lastIn {
		g.ranAny = true
		if done, err := g.segment("", nil, ts, lastIn, generate, send); err != nil || done {
			return true, err
		}
	}
	if !lastIn {
		g.tensors.ack(seq)
	}
	return false, nil
}

// streamCode keeps a gRPC code of the client's stream, Canceled otherwise.
func streamCode(err error) codes.Code {
	if c := status.Code(err); c != codes.Unknown {
		return c
	}
	return codes.Canceled
}

// segment runs one segment. Its finish reason is held back unless it ends
// the request (the output limit); its counters and outputs pass through.
func (g *segmenter) segment(text string, codesIn []uint32, tensors []*stagepb.Tensor, last bool, generate func(*stagepb.GenerateRequest, func(*stagepb.GenerateChunk) error) error, send func(*stagepb.GenerateChunk) error) (done bool, err error) {
	g.segments++
	r := &stagepb.GenerateRequest{RequestId: g.req.GetRequestId(), Sampling: cloneSampling(g.req.GetSampling()), Voice: g.req.GetVoice(),
		Segment: uint32(g.segments), LastSegment: last}
	switch {
	case g.tensors != nil:
		r.Tensors = tensors
	case g.codes:
		r.Input = &stagepb.GenerateRequest_Codes{Codes: &stagepb.Codes{Codes: codesIn}}
	default:
		r.Input = &stagepb.GenerateRequest_Text{Text: text}
		r.Context = g.consumed.String()
		g.consumed.WriteString(text)
	}
	if g.maxTokens > 0 {
		r.Sampling.MaxTokens = uint32(g.maxTokens - g.produced)
	}
	var finish stagepb.FinishReason
	err = generate(r, func(c *stagepb.GenerateChunk) error {
		g.produced += int(c.GetStats().GetGenerationTokens())
		if t := c.GetTimings(); t != nil {
			if g.first == nil {
				g.first = t
			}
			g.prefill += t.GetPrefillSeconds()
		}
		finish = c.GetFinishReason()
		if finish == stagepb.FinishReason_FINISH_REASON_LENGTH {
			c.Timings = g.timings()
			return send(c) // a limit: this segment ends the request
		}
		c.FinishReason, c.Timings = stagepb.FinishReason_FINISH_REASON_UNSPECIFIED, nil
		return send(c)
	})
	if err != nil {
		return true, err
	}
	switch finish {
	case stagepb.FinishReason_FINISH_REASON_LENGTH:
		return true, nil
	case stagepb.FinishReason_FINISH_REASON_STOP:
		return false, nil
	}
	return true, status.Errorf(codes.Internal, "worker: engine ended a segment with finish reason %s", finish.Name())
}

// timings are the request's: the first segment's queue, every segment's
// prefill, and the rest of the time since the request started as decode.
func (g *segmenter) timings() *stagepb.Timings {
	t := &stagepb.Timings{PrefillSeconds: g.prefill}
	if g.first != nil {
		t.QueueSeconds = g.first.GetQueueSeconds()
	}
	t.DecodeSeconds = max(0, time.Since(g.t0).Seconds()-t.QueueSeconds-t.PrefillSeconds)
	return t
}

func cloneSampling(p *stagepb.SamplingParams) *stagepb.SamplingParams {
	if p == nil {
		return &stagepb.SamplingParams{}
	}
	c := &stagepb.SamplingParams{MaxTokens: p.GetMaxTokens(), Stop: p.GetStop(), IgnoreEos: p.GetIgnoreEos()}
	if p.Temperature != nil {
		t := p.GetTemperature()
		c.Temperature = &t
	}
	if p.Seed != nil {
		seed := p.GetSeed()
		c.Seed = &seed
	}
	return c
}
