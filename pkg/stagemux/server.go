package stagemux

import (
	"context"
	"errors"
	"io"
	"math"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// GenerateFunc runs one call, as StageService.Generate does.
type GenerateFunc func(req *stagepb.GenerateRequest, stream grpc.ServerStreamingServer[stagepb.GenerateChunk]) error

// Serve runs one Multiplex stream on the worker. Each request frame is a
// call of generate in a goroutine of its own, whose stream's context ends
// with the call's cancel frame, its deadline (the frame's timeout_us) or
// the stream, and holds the trace context the frame carries; its chunks go
// out as chunk frames, then an end frame with the status generate
// returned. tp, when not nil, makes each call's server span, a child of
// the head's client span, as otelgrpc makes a Generate call's.
//
// Serve returns once the stream is over and every call it started has
// returned: when the head half-closes it (running calls finish first),
// when it breaks (running calls are cancelled), or when stop is closed
// (the worker stopped taking calls and none runs: ending the stream tells
// the head so). A frame the head should never send ends the stream with
// InvalidArgument.
func Serve(stream grpc.BidiStreamingServer[stagepb.MuxFrame, stagepb.MuxFrame], generate GenerateFunc, stop <-chan struct{}, tp trace.TracerProvider) error {
	var tracer trace.Tracer
	if tp != nil {
		tracer = tp.Tracer("github.com/troupe-serving/troupe/pkg/stagemux")
	}
	ctx, cancel := context.WithCancel(stream.Context())
	var sendMu sync.Mutex
	send := func(f *stagepb.MuxFrame) error {
		sendMu.Lock()
		defer sendMu.Unlock()
		return stream.Send(f)
	}

	var (
		calls   sync.WaitGroup
		mu      sync.Mutex // guards cancels
		cancels = map[uint64]context.CancelFunc{}
	)
	// Cancelling ctx cancels every call still running, then they are
	// waited for: no call sends once Serve has returned.
	defer func() {
		cancel()
		calls.Wait()
	}()

	// The receiver ends when the stream does, which happens once Serve has
	// returned (gRPC then cancels the stream, and Recv fails): nothing else
	// can interrupt a Recv.
	frames := make(chan *stagepb.MuxFrame)
	recvErr := make(chan error, 1)
	go func() {
		for {
			f, err := stream.Recv()
			if err != nil {
				recvErr <- err
				return
			}
			select {
			case frames <- f:
			case <-ctx.Done():
				return
			}
		}
	}()

	for {
		var f *stagepb.MuxFrame
		select {
		case f = <-frames:
		case err := <-recvErr:
			if errors.Is(err, io.EOF) {
				calls.Wait() // the head sends no more calls; let the running ones end
				return nil
			}
			return err
		case <-stop:
			return nil
		case <-ctx.Done():
			// The stream ended (the head went, the server stopped): the
			// receiver may have returned on ctx without a Recv error.
			return ctx.Err()
		}
		id := f.GetId()
		switch {
		case f.GetRequest() != nil && !f.GetCancel() && f.GetChunk() == nil && f.GetEnd() == nil:
			req := f.GetRequest()
			mu.Lock()
			_, dup := cancels[id]
			var callCtx context.Context
			var callCancel context.CancelFunc
			if !dup {
				callCtx, callCancel = callContext(ctx, f.GetTimeoutUs())
				cancels[id] = callCancel
			}
			mu.Unlock()
			if dup {
				return status.Errorf(codes.InvalidArgument, "stagemux: call %d started twice", id)
			}
			calls.Add(1)
			go func() {
				defer calls.Done()
				var span trace.Span
				if md := f.GetMetadata(); len(md) > 0 {
					callCtx = propagator.Extract(callCtx, propagation.MapCarrier(md))
				}
				if tracer != nil {
					callCtx, span = tracer.Start(callCtx, GenerateMethod, trace.WithSpanKind(trace.SpanKindServer), trace.WithAttributes(rpcAttributes...))
				}
				cs := &callStream{ctx: callCtx, id: id, send: send}
				err := generate(req, cs)
				mu.Lock()
				delete(cancels, id)
				mu.Unlock()
				callCancel()
				endSpan(span, err, serverSpanStatus)
				cs.end(err)
			}()
		case f.GetCancel() && f.GetRequest() == nil && f.GetChunk() == nil && f.GetEnd() == nil:
			mu.Lock()
			if callCancel := cancels[id]; callCancel != nil {
				callCancel() // a call that already ended is not there: nothing to do
			}
			mu.Unlock()
		default:
			return status.Errorf(codes.InvalidArgument, "stagemux: frame %d from the head is not one request or one cancel", id)
		}
	}
}

// callContext is the context of a call under the stream's ctx: cancelled
// by its cancel frame, and past its deadline timeoutUs microseconds from
// now (0, or more than a Duration holds: none).
func callContext(ctx context.Context, timeoutUs uint64) (context.Context, context.CancelFunc) {
	if timeoutUs == 0 || timeoutUs > math.MaxInt64/uint64(time.Microsecond) {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, time.Duration(timeoutUs)*time.Microsecond)
}

// callStream is the server stream generate sees for one call. A chunk
// with a finish reason, the last of a call, waits for the call's end to go
// out in one frame with it. A call has no headers or trailers of its own
// (the stream's are the head's): they are accepted and dropped.
type callStream struct {
	ctx  context.Context
	id   uint64
	send func(*stagepb.MuxFrame) error
	last *stagepb.GenerateChunk // a final chunk not sent yet
}

func (c *callStream) Send(chunk *stagepb.GenerateChunk) error {
	if c.last != nil { // a chunk after the final one: send them in order
		if err := c.send(&stagepb.MuxFrame{Id: c.id, Chunk: c.last}); err != nil {
			return err
		}
		c.last = nil
	}
	if chunk.GetFinishReason() != stagepb.FinishReason_FINISH_REASON_UNSPECIFIED {
		c.last = chunk
		return nil
	}
	return c.send(&stagepb.MuxFrame{Id: c.id, Chunk: chunk})
}

// end sends the call's end, with the final chunk if it waits.
func (c *callStream) end(err error) {
	_ = c.send(&stagepb.MuxFrame{Id: c.id, Chunk: c.last, End: endOf(err)})
}

// endOf is the MuxEnd of a call that returned err.
func endOf(err error) *stagepb.MuxEnd {
	st := status.Convert(err)
	end := &stagepb.MuxEnd{Code: uint32(st.Code()), Message: st.Message()}
	if p := st.Proto(); len(p.GetDetails()) > 0 {
		end.StatusDetails, _ = proto.Marshal(p) // a status always marshals
	}
	return end
}

func (c *callStream) SendMsg(m any) error {
	chunk, ok := m.(*stagepb.GenerateChunk)
	if !ok {
		return status.Errorf(codes.Internal, "stagemux: a call sends GenerateChunk, not %T", m)
	}
	return c.Send(chunk)
}

func (c *callStream) RecvMsg(any) error {
	return status.Error(codes.Internal, "stagemux: a Generate call receives no message")
}

func (c *callStream) Context() context.Context     { return c.ctx }
func (c *callStream) SetHeader(metadata.MD) error  { return nil }
func (c *callStream) SendHeader(metadata.MD) error { return nil }
func (c *callStream) SetTrailer(metadata.MD)       {}
