// Package stagemux runs many stage calls over one StageService.Multiplex
// stream per connection (see pkg/stagepb/stage.proto): Client on the head,
// Serve on the worker. A call costs one message each way instead of an
// HTTP/2 stream of its own (headers, trailers, a stream's goroutines and
// state on both sides), which is most of what a short call costs the head.
//
// A call carries what a Generate call's headers would: its deadline and,
// from a head that traces, its trace context; a traced call has the client
// and server spans otelgrpc would give a Generate call, named as it names
// them (GenerateMethod). A call ends with the status a Generate call would.
package stagemux

import (
	"context"
	"errors"
	"io"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// maxQueuedBytes bounds the output a call's frames may hold while its
// Recv does not take them (a client that reads slowly): past it the call
// fails with ResourceExhausted, and the stream goes on for the others.
const maxQueuedBytes = 32 << 20

// maxStreamQueuedBytes bounds the output queued across all the calls of
// one stream (one connection to a replica): when a frame would take it
// past, the running call that holds the most fails as a call past
// maxQueuedBytes does, until the frame fits.
const maxStreamQueuedBytes = 128 << 20

// GenerateMethod names a call's spans and its rpc.method, as otelgrpc
// names those of a Generate call.
const GenerateMethod = "troupe.stage.v1.StageService/Generate"

// propagator carries a call's trace context in its request frame: W3C
// trace context and baggage, as the head's and workers' otelgrpc do.
var propagator = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})

// rpcAttributes are the attributes otelgrpc gives a Generate call's spans.
var rpcAttributes = []attribute.KeyValue{attribute.String("rpc.system.name", "grpc"), attribute.String("rpc.method", GenerateMethod)}

// statusCodeAttribute is a call's rpc.response.status_code, as otelgrpc
// records it: the code's canonical name.
func statusCodeAttribute(code codes.Code) attribute.KeyValue {
	name := "CODE(" + strconv.FormatUint(uint64(code), 10) + ")"
	if int(code) < len(canonicalCodes) {
		name = canonicalCodes[code]
	}
	return attribute.String("rpc.response.status_code", name)
}

// canonicalCodes are the gRPC codes' canonical names, by code.
var canonicalCodes = [...]string{"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
	"PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
	"UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"}

// errClosed fails the calls of a Client that was closed.
var errClosed = status.Error(codes.Canceled, "stagemux: client closed")

// Client sends Generate calls to one replica, all over one Multiplex
// stream at a time: opened by the first call, and again by the first call
// after it ended. Safe for concurrent use.
//
// Every frame of a stream is read by one goroutine, which queues each
// call's frames, in order, for its Recv. It never waits for a call: one
// that reads slowly (its client, the next stage) holds up no other, and
// fails once maxQueuedBytes of its output wait (the worker is not slowed
// down for it, as a stream of its own would be); all of a stream's calls
// together hold at most maxStreamQueuedBytes.
//
// Close ends the stream and waits for its reader; calls still running
// fail.
type Client struct {
	client stagepb.StageServiceClient
	limits limits

	mu     sync.Mutex // guards cur and closed
	cur    *muxStream // nil: none open
	closed bool
	wg     sync.WaitGroup // readers

	lastFrame atomic.Int64 // unix nanoseconds of the latest chunk or end read; 0: none
}

// LastFrame is when the client last read a chunk or a call's end from the
// worker, for any of its calls (zero: never): a sign that the worker is
// alive and working, whether or not the calls' callers read what came.
// The head's stall clock asks it (orchestrator's stallWatch).
func (c *Client) LastFrame() time.Time {
	if ns := c.lastFrame.Load(); ns != 0 {
		return time.Unix(0, ns)
	}
	return time.Time{}
}

// NewClient returns a Client over client; it opens no stream until the
// first call.
func NewClient(client stagepb.StageServiceClient) *Client {
	return &Client{client: client, limits: limits{call: maxQueuedBytes, stream: maxStreamQueuedBytes, decoded: compactAfter}}
}

// limits are the output a stream's calls may hold queued: each
// (maxQueuedBytes), and all together (maxStreamQueuedBytes), and how many
// frames a call's queue holds decoded (compactAfter); tests change them.
type limits struct{ call, stream, decoded int }

// muxStream is one Multiplex stream and its running calls.
type muxStream struct {
	s      grpc.BidiStreamingClient[stagepb.MuxFrame, stagepb.MuxFrame]
	limits limits
	last   *atomic.Int64   // the Client's lastFrame
	ctx    context.Context // the stream's; done once it is closed or broken
	cancel context.CancelFunc
	sendMu sync.Mutex // serializes Send

	queued atomic.Int64 // output held by all its calls' queues

	mu     sync.Mutex // guards the fields below
	nextID uint64
	calls  map[uint64]*Call // nil once the stream ended
	err    error            // why it ended, once calls is nil
}

// Generate starts req as a call, as StageServiceClient.Generate would:
// the returned Call's Recv gives its chunks, then io.EOF. ctx's deadline
// goes to the worker with the request. tracer, when not nil, makes the
// call's client span, whose context goes with the request; nil: the call
// carries no trace context (a head that sends no trace to workers). opts
// are used when the call opens the stream. ctx ending makes Recv return
// ctx's error as a gRPC status; the caller must Close every call it got,
// which tells the worker to abort one that has not ended.
func (c *Client) Generate(ctx context.Context, req *stagepb.GenerateRequest, tracer trace.Tracer, opts ...grpc.CallOption) (*Call, error) {
	var span trace.Span
	if tracer != nil {
		ctx, span = tracer.Start(ctx, GenerateMethod, trace.WithSpanKind(trace.SpanKindClient), trace.WithAttributes(rpcAttributes...))
	}
	call, err := c.start(ctx, req, span, opts)
	if err != nil {
		endSpan(span, err, clientSpanStatus)
		return nil, err
	}
	return call, nil
}

// start is Generate once the call's span, if any, is started.
func (c *Client) start(ctx context.Context, req *stagepb.GenerateRequest, span trace.Span, opts []grpc.CallOption) (*Call, error) {
	f := &stagepb.MuxFrame{Request: req}
	if err := ctx.Err(); err != nil {
		return nil, status.FromContextError(err).Err()
	}
	if deadline, ok := ctx.Deadline(); ok {
		left := time.Until(deadline)
		if left <= 0 {
			return nil, status.FromContextError(context.DeadlineExceeded).Err()
		}
		f.TimeoutUs = uint64((left + time.Microsecond - 1) / time.Microsecond)
	}
	if span != nil {
		f.Metadata = map[string]string{}
		propagator.Inject(ctx, propagation.MapCarrier(f.Metadata))
	}
	st, err := c.stream(opts)
	if err != nil {
		return nil, err
	}
	call := &Call{st: st, ctx: ctx, span: span, ready: make(chan struct{}, 1)}
	st.mu.Lock()
	if st.calls == nil {
		err := st.err
		st.mu.Unlock()
		return nil, err
	}
	st.nextID++
	call.id = st.nextID
	f.Id = call.id
	st.calls[call.id] = call
	st.mu.Unlock()
	if err := st.send(f); err != nil {
		call.span = nil // ended by Generate, with err
		call.Close()
		return nil, streamError(st, err)
	}
	return call, nil
}

// stream returns the open stream, opening one if there is none.
func (c *Client) stream(opts []grpc.CallOption) (*muxStream, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, errClosed
	}
	if st := c.cur; st != nil && st.ctx.Err() == nil {
		return st, nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	s, err := c.client.Multiplex(ctx, opts...)
	if err != nil {
		cancel()
		return nil, err
	}
	st := &muxStream{s: s, limits: c.limits, last: &c.lastFrame, ctx: ctx, cancel: cancel, calls: map[uint64]*Call{}}
	c.cur = st
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		st.read()
	}()
	return st, nil
}

// Close ends the open stream, fails its calls and waits for its reader.
// Calls after Close fail. Calling it again, or on nil, is harmless.
func (c *Client) Close() {
	if c == nil {
		return
	}
	c.mu.Lock()
	c.closed = true
	st := c.cur
	c.mu.Unlock()
	if st != nil {
		st.cancel()
	}
	c.wg.Wait()
}

// read hands each frame to its call until the stream ends, then fails the
// calls still running with the stream's error.
func (st *muxStream) read() {
	defer st.cancel()
	var err error
	for {
		var f *stagepb.MuxFrame
		if f, err = st.s.Recv(); err != nil {
			break
		}
		if f.GetChunk() == nil && f.GetEnd() == nil {
			continue // says nothing
		}
		st.last.Store(time.Now().UnixNano())
		st.mu.Lock()
		call := st.calls[f.GetId()]
		st.mu.Unlock()
		if call == nil {
			continue // closed, or failed: its frames are dropped
		}
		n := queuedBytes(f)
		if st.queued.Load()+int64(n) > int64(st.limits.stream) && !st.shed(call, n) {
			continue // the call itself fell furthest behind, and failed
		}
		if f.GetEnd() != nil {
			st.mu.Lock()
			delete(st.calls, f.GetId())
			st.mu.Unlock()
		}
		if !call.queue(f, n) {
			st.abort(call)
		}
	}
	if errors.Is(err, io.EOF) {
		// The worker ends the stream only once it takes no new calls and
		// none of its runs (stagemux.Serve): every call still waiting
		// here was refused, not started, as by a draining replica.
		err = stagepb.DrainingError("stagemux: the worker ended the stream")
	}
	st.mu.Lock()
	st.calls, st.err = nil, err
	st.mu.Unlock()
}

// errQueueFull is the error of a call that fell too far behind its
// output: past limit bytes of its own (of what), or of its connection's.
func errQueueFull(limit int, of string) error {
	return status.Errorf(codes.ResourceExhausted, "stagemux: more than %d bytes of %s output wait to be read", limit, of)
}

// shed fails the running calls that hold the most output until n more
// bytes fit in maxStreamQueuedBytes; false when call, the frame's own, was
// one of them (or nothing else held enough).
func (st *muxStream) shed(call *Call, n int) bool {
	for st.queued.Load()+int64(n) > int64(st.limits.stream) {
		var worst *Call
		most := -1
		st.mu.Lock()
		for _, c := range st.calls {
			if b := c.queuedBytes(); b > most {
				worst, most = c, b
			}
		}
		st.mu.Unlock()
		full := errQueueFull(st.limits.stream, "the connection's")
		if worst == nil || worst == call || most == 0 {
			call.fail(full)
			st.abort(call)
			return false
		}
		worst.fail(full)
		st.abort(worst)
	}
	return true
}

// abort forgets a call that failed and tells the worker to stop it, as
// for a cancelled call.
func (st *muxStream) abort(call *Call) {
	st.mu.Lock()
	_, running := st.calls[call.id]
	delete(st.calls, call.id)
	st.mu.Unlock()
	if running {
		_ = st.send(&stagepb.MuxFrame{Id: call.id, Cancel: true})
	}
}

func (st *muxStream) send(f *stagepb.MuxFrame) error {
	st.sendMu.Lock()
	defer st.sendMu.Unlock()
	return st.s.Send(f)
}

// streamError is the error of a call whose frame could not be sent: Send
// reports io.EOF when the stream ended, whose error Recv has.
func streamError(st *muxStream, err error) error {
	if !errors.Is(err, io.EOF) {
		return err
	}
	<-st.ctx.Done()
	return st.endError()
}

// endError is why the stream ended, once its context is done; the reader
// may not have stored it yet, Unavailable then.
func (st *muxStream) endError() error {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.err != nil {
		return st.err
	}
	return status.Error(codes.Unavailable, "stagemux: stream ended")
}

// Call is one Generate call on a Multiplex stream. Its Recv and Close are
// for one goroutine at a time; Close must be called once it is no longer
// read.
type Call struct {
	st    *muxStream
	id    uint64
	ctx   context.Context
	span  trace.Span    // the client span of a traced call, ended with the call; else nil
	ready chan struct{} // a token when frames were queued since Recv last looked

	mu     sync.Mutex // guards the queue, from the reader to Recv
	frames []queuedFrame
	bytes  int   // output held by frames, counted in st.queued too
	failed error // set when the call fell too far behind: Recv returns it after the queue
	gone   bool  // Close was called: frames are dropped

	end    *stagepb.MuxEnd // an end that came with the last chunk, for the next Recv
	closed bool
}

// queuedFrame is a frame waiting for Recv: decoded (f), or past
// compactAfter frames in the queue, encoded (raw), which takes a few
// times less memory than the decoded chunk and its stats. n is what it
// counts (queuedBytes).
type queuedFrame struct {
	f   *stagepb.MuxFrame
	raw []byte
	n   int
}

// compactAfter is how many frames a call's queue holds decoded; the later
// ones wait encoded until Recv takes them. A call read as its frames come
// never has that many waiting; one whose reader waits (the head's attempt
// blocked on the next stage or the client) may queue the rest of its
// answer, a frame a token, and its memory is then mostly that of the
// encoded frames.
const compactAfter = 32

// queue adds f, counting n bytes, for Recv; false when that takes the
// call past its limit, which fails it.
func (c *Call) queue(f *stagepb.MuxFrame, n int) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gone || c.failed != nil {
		return true
	}
	if c.bytes+n > c.st.limits.call {
		c.failLocked(errQueueFull(c.st.limits.call, "the call's"))
	} else {
		q := queuedFrame{f: f, n: n}
		if len(c.frames) >= c.st.limits.decoded {
			if raw, err := proto.Marshal(f); err == nil {
				q = queuedFrame{raw: raw, n: n}
			}
		}
		c.frames = append(c.frames, q)
		c.bytes += n
		c.st.queued.Add(int64(n))
	}
	c.signal()
	return c.failed == nil
}

// fail fails the call with err once Recv has taken nothing more: its
// queue is dropped.
func (c *Call) fail(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gone || c.failed != nil {
		return
	}
	c.failLocked(err)
	c.signal()
}

func (c *Call) failLocked(err error) {
	c.failed = err
	c.dropLocked()
}

// dropLocked empties the queue.
func (c *Call) dropLocked() {
	c.st.queued.Add(-int64(c.bytes))
	c.frames, c.bytes = nil, 0
}

// signal wakes Recv; c.mu is held.
func (c *Call) signal() {
	select {
	case c.ready <- struct{}{}:
	default: // a token is there already
	}
}

// queuedBytes is the output the call's queue holds.
func (c *Call) queuedBytes() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.bytes
}

// queuedBytes is what a queued frame counts against maxQueuedBytes: its
// output, and a little for the frame itself.
func queuedBytes(f *stagepb.MuxFrame) int { return 64 + stagepb.OutputBytes(f.GetChunk()) }

// next takes the first queued frame, or the failure; nil, nil when none.
func (c *Call) next() (*stagepb.MuxFrame, error) {
	c.mu.Lock()
	if len(c.frames) == 0 {
		defer c.mu.Unlock()
		return nil, c.failed
	}
	q := c.frames[0]
	c.frames[0] = queuedFrame{}
	c.frames = c.frames[1:]
	c.bytes -= q.n
	c.st.queued.Add(-int64(q.n))
	c.mu.Unlock()
	if q.f != nil {
		return q.f, nil
	}
	f := &stagepb.MuxFrame{}
	if err := proto.Unmarshal(q.raw, f); err != nil {
		// It was marshalled by this process from a frame that decoded.
		return nil, status.Errorf(codes.Internal, "stagemux: decode a queued frame: %v", err)
	}
	return f, nil
}

// Recv returns the call's next chunk, io.EOF after the last, or the error
// it ended with: the worker's status, ctx's error as a status, or the
// stream's error. What came is delivered before ctx's error.
func (c *Call) Recv() (*stagepb.GenerateChunk, error) {
	chunk, err := c.recv()
	if err != nil {
		c.endSpan(err)
	}
	return chunk, err
}

func (c *Call) recv() (*stagepb.GenerateChunk, error) {
	if end := c.end; end != nil {
		c.end = nil
		return nil, endError(end)
	}
	for {
		f, err := c.next()
		if err != nil {
			return nil, err
		}
		if f != nil {
			return c.deliver(f)
		}
		select {
		case <-c.ready:
		case <-c.ctx.Done():
			return nil, status.FromContextError(c.ctx.Err()).Err()
		case <-c.st.ctx.Done():
			// What the reader queued before the end goes first.
			if f, err := c.next(); err != nil {
				return nil, err
			} else if f != nil {
				return c.deliver(f)
			}
			return nil, c.st.endError()
		}
	}
}

// deliver is what Recv returns for frame f.
func (c *Call) deliver(f *stagepb.MuxFrame) (*stagepb.GenerateChunk, error) {
	if chunk := f.GetChunk(); chunk != nil {
		c.end = f.GetEnd()
		return chunk, nil
	}
	return nil, endError(f.GetEnd())
}

// endError is the error of a call that ended with end: nil becomes
// io.EOF; a status with details comes back whole.
func endError(end *stagepb.MuxEnd) error {
	code := codes.Code(end.GetCode())
	if code == codes.OK {
		return io.EOF
	}
	if b := end.GetStatusDetails(); len(b) > 0 {
		var p spb.Status
		if proto.Unmarshal(b, &p) == nil && codes.Code(p.GetCode()) == code {
			return status.ErrorProto(&p)
		}
	}
	return status.Error(code, end.GetMessage())
}

// endSpan ends a traced call's span, once, with how the call ended.
func (c *Call) endSpan(err error) {
	endSpan(c.span, err, clientSpanStatus)
	c.span = nil
}

// endSpan ends span, if not nil, as otelgrpc ends a call's: with its
// status code, and its span status by rule (io.EOF and nil are OK).
func endSpan(span trace.Span, err error, rule func(*status.Status) (otelcodes.Code, string)) {
	if span == nil {
		return
	}
	if !span.IsRecording() { // nobody reads its status: spare the work
		span.End()
		return
	}
	st := status.New(codes.OK, "")
	if err != nil && !errors.Is(err, io.EOF) {
		st = status.Convert(err)
	}
	if st.Code() != codes.OK {
		span.SetStatus(rule(st))
	}
	span.SetAttributes(statusCodeAttribute(st.Code()))
	span.End()
}

// clientSpanStatus is otelgrpc's rule on the client: every code but OK is
// an error.
func clientSpanStatus(st *status.Status) (otelcodes.Code, string) {
	return otelcodes.Error, st.Message()
}

// serverSpanStatus is otelgrpc's rule on the server: only the codes that
// say the server failed are errors.
func serverSpanStatus(st *status.Status) (otelcodes.Code, string) {
	switch st.Code() {
	case codes.Unknown, codes.DeadlineExceeded, codes.Unimplemented, codes.Internal, codes.Unavailable, codes.DataLoss:
		return otelcodes.Error, st.Message()
	}
	return otelcodes.Unset, ""
}

// Close ends the call: the reader drops its frames from now on, and a call
// that has not ended is aborted on the worker. Calling it again is
// harmless.
func (c *Call) Close() {
	if c.closed {
		return
	}
	c.closed = true
	c.endSpan(status.Error(codes.Canceled, "stagemux: call closed before it ended"))
	c.st.mu.Lock()
	_, running := c.st.calls[c.id]
	delete(c.st.calls, c.id)
	c.st.mu.Unlock()
	c.mu.Lock()
	c.gone = true
	c.dropLocked()
	c.mu.Unlock()
	if running { // the reader forgets a call at its end: this one has not ended
		_ = c.st.send(&stagepb.MuxFrame{Id: c.id, Cancel: true})
	}
}
