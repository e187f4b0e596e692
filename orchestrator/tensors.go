package orchestrator

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"sync"

	"google.golang.org/protobuf/proto"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// Tensors between stages go worker to worker (docs/contracts.md,
// "Tensors between stages"); the head only says where. A stage that takes
// tensors is opened with a ticket, and the stage before it (its producer,
// the request's first stage) is told the attempt's address and ticket, and
// told again whenever the consuming stage's attempt moves to another
// replica. The head sees the producer's text and the consumer's output,
// never the tensors.

// tensorRoute is where a producing stage's tensors go now: the sink of the
// consuming stage's current attempt. The consumer's attempts set it; the
// producer's attempts read it and follow its changes. Safe for concurrent
// use.
type tensorRoute struct {
	mu      sync.Mutex
	sink    *stagepb.TensorSink
	changed chan struct{} // closed and replaced on every change
}

func newTensorRoute() *tensorRoute { return &tensorRoute{changed: make(chan struct{})} }

// set makes sink the route's.
func (r *tensorRoute) set(sink *stagepb.TensorSink) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sink = sink
	close(r.changed)
	r.changed = make(chan struct{})
}

// current is the sink now (nil before the consumer's first attempt) and a
// channel closed at the next change.
func (r *tensorRoute) current() (*stagepb.TensorSink, <-chan struct{}) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.sink, r.changed
}

// await returns the first sink, waiting for the consumer's first attempt.
func (r *tensorRoute) await(ctx context.Context) (*stagepb.TensorSink, <-chan struct{}, error) {
	for {
		sink, ch := r.current()
		if sink != nil {
			return sink, ch, nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		}
	}
}

// newTicket names one consuming attempt: random, so that no other
// request's producer can reach it by chance or by guessing.
func newTicket() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// takesTensors reports whether the routable replicas of stage take tensors
// from the stage before (input role tensors).
func takesTensors(snap *router.Snapshot, stage int) bool {
	for rep := range snap.Stage(stage).All() {
		return rep.Engine.InputRole == stagepb.RoleTensors
	}
	return false
}

// openProducer opens the attempt of a stage whose tensors go to the next
// stage: a GenerateStream whose first message is the stage's whole request
// and the consumer's sink (waiting for the consumer's first attempt), and
// then a new sink each time the consumer's attempt moves. The returned
// wait waits for the goroutine that sends them, which ends with ctx.
func (h *Head) openProducer(ctx context.Context, a *attemptRun) (chunkStream, func(), error) {
	route := a.sr.tensorsOut
	sink, changed, err := route.await(ctx)
	if err != nil {
		return nil, func() {}, err
	}
	stream, err := a.rep.Client.GenerateStream(ctx, h.callOptions()...)
	if err != nil {
		return nil, func() {}, err
	}
	// As in open: this attempt's routed blocks go with its request.
	a.in.RoutedBlocks = a.d.RoutedBlocks
	if err := stream.Send(&stagepb.StreamInput{Request: a.in, TensorSink: sink}); err != nil {
		return stream, func() {}, nil // Recv reports why
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-changed:
			case <-ctx.Done():
				return
			}
			var next *stagepb.TensorSink
			next, changed = route.current()
			if proto.Equal(next, sink) {
				continue
			}
			sink = next
			if err := stream.Send(&stagepb.StreamInput{TensorSink: sink}); err != nil {
				return
			}
		}
	}()
	return stream, func() { <-done }, nil
}

// sendTicket is the input sender of a stage that takes tensors: its
// request goes at once with a new ticket, the route then points the
// producer at this attempt, and the stream's input ends when the stage
// before has ended. Pieces never come: the producer's output reaches this
// stage worker to worker.
func (h *Head) sendTicket(ctx context.Context, a *attemptRun, stream stagepb.StageService_GenerateStreamClient) {
	r := proto.Clone(a.sr.in).(*stagepb.GenerateRequest)
	r.TensorTicket = newTicket()
	r.OutputCodesPerChunk = h.segmentUnits(a.sr.stage, a.sr.n, stagepb.RoleCodes)
	if err := stream.Send(&stagepb.StreamInput{Request: r}); err != nil {
		return
	}
	a.span.AddEvent("first_input")
	a.call.InputSent()
	a.sr.tensorsIn.set(&stagepb.TensorSink{Addr: a.rep.Addr, Ticket: r.TensorTicket})
	if _, _, err := a.sr.input.next(ctx, 0); err != nil {
		return
	}
	_ = stream.CloseSend()
}
