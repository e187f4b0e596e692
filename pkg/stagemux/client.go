// Package stagemux runs many stage calls over one StageService.Multiplex
// stream per connection (see pkg/stagepb/stage.proto): Client on the head,
// Serve on the worker. A call costs one message each way instead of an
// HTTP/2 stream of its own (headers, trailers, a stream's goroutines and
// state on both sides), which is most of what a short call costs the head.
package stagemux

import (
	"context"
	"errors"
	"io"
	"sync"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// maxQueuedBytes bounds the output a call's frames may hold while its
// Recv does not take them (a client that reads slowly): past it the call
// fails with ResourceExhausted, and the stream goes on for the others.
const maxQueuedBytes = 32 << 20

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
// down for it, as a stream of its own would be).
//
// Close ends the stream and waits for its reader; calls still running
// fail.
type Client struct {
	client stagepb.StageServiceClient

	mu     sync.Mutex // guards cur and closed
	cur    *muxStream // nil: none open
	closed bool
	wg     sync.WaitGroup // readers
}

// NewClient returns a Client over client; it opens no stream until the
// first call.
func NewClient(client stagepb.StageServiceClient) *Client {
	return &Client{client: client}
}

// muxStream is one Multiplex stream and its running calls.
type muxStream struct {
	s      grpc.BidiStreamingClient[stagepb.MuxFrame, stagepb.MuxFrame]
	ctx    context.Context // the stream's; done once it is closed or broken
	cancel context.CancelFunc
	sendMu sync.Mutex // serializes Send

	mu     sync.Mutex // guards the fields below
	nextID uint64
	calls  map[uint64]*Call // nil once the stream ended
	err    error            // why it ended, once calls is nil
}

// Generate starts req as a call, as StageServiceClient.Generate would:
// the returned Call's Recv gives its chunks, then io.EOF. opts are used
// when the call opens the stream. ctx ending makes Recv return ctx's error
// as a gRPC status; the caller must Close every call it got, which tells
// the worker to abort one that has not ended.
func (c *Client) Generate(ctx context.Context, req *stagepb.GenerateRequest, opts ...grpc.CallOption) (*Call, error) {
	st, err := c.stream(opts)
	if err != nil {
		return nil, err
	}
	call := &Call{st: st, ctx: ctx, ready: make(chan struct{}, 1)}
	st.mu.Lock()
	if st.calls == nil {
		err := st.err
		st.mu.Unlock()
		return nil, err
	}
	st.nextID++
	call.id = st.nextID
	st.calls[call.id] = call
	st.mu.Unlock()
	if err := st.send(&stagepb.MuxFrame{Id: call.id, Request: req}); err != nil {
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
	st := &muxStream{s: s, ctx: ctx, cancel: cancel, calls: map[uint64]*Call{}}
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
		st.mu.Lock()
		call := st.calls[f.GetId()]
		if call != nil && f.GetEnd() != nil {
			delete(st.calls, f.GetId())
		}
		st.mu.Unlock()
		if call != nil && !call.queue(f) {
			// Too far behind: the worker is told to stop, as for a
			// cancelled call.
			st.mu.Lock()
			delete(st.calls, f.GetId())
			st.mu.Unlock()
			_ = st.send(&stagepb.MuxFrame{Id: f.GetId(), Cancel: true})
		}
	}
	if errors.Is(err, io.EOF) {
		// The worker stopped; no call of its can still be running.
		err = status.Error(codes.Unavailable, "stagemux: the worker ended the stream")
	}
	st.mu.Lock()
	st.calls, st.err = nil, err
	st.mu.Unlock()
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
	ready chan struct{} // a token when frames were queued since Recv last looked

	mu     sync.Mutex // guards the queue, from the reader to Recv
	frames []*stagepb.MuxFrame
	bytes  int   // output held by frames
	failed error // set when the call fell too far behind: Recv returns it after the queue
	gone   bool  // Close was called: frames are dropped

	end    *stagepb.MuxEnd // an end that came with the last chunk, for the next Recv
	closed bool
}

// queue adds f for Recv; false when the call is too far behind, which
// fails it.
func (c *Call) queue(f *stagepb.MuxFrame) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gone || c.failed != nil {
		return true
	}
	if n := queuedBytes(f); c.bytes+n > maxQueuedBytes {
		c.failed = status.Errorf(codes.ResourceExhausted, "stagemux: more than %d bytes of output wait to be read", maxQueuedBytes)
		c.frames = nil
	} else {
		c.frames = append(c.frames, f)
		c.bytes += n
	}
	select {
	case c.ready <- struct{}{}:
	default: // a token is there already
	}
	return c.failed == nil
}

// queuedBytes is what a queued frame counts against maxQueuedBytes: its
// output, and a little for the frame itself.
func queuedBytes(f *stagepb.MuxFrame) int { return 64 + stagepb.OutputBytes(f.GetChunk()) }

// next takes the first queued frame, or the failure; nil, nil when none.
func (c *Call) next() (*stagepb.MuxFrame, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.frames) == 0 {
		return nil, c.failed
	}
	f := c.frames[0]
	c.frames[0] = nil
	c.frames = c.frames[1:]
	c.bytes -= queuedBytes(f)
	return f, nil
}

// Recv returns the call's next chunk, io.EOF after the last, or the error
// it ended with: the worker's status, ctx's error as a status, or the
// stream's error. What came is delivered before ctx's error.
func (c *Call) Recv() (*stagepb.GenerateChunk, error) {
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

// Close ends the call: the reader drops its frames from now on, and a call
// that has not ended is aborted on the worker. Calling it again is
// harmless.
func (c *Call) Close() {
	if c.closed {
		return
	}
	c.closed = true
	c.st.mu.Lock()
	_, running := c.st.calls[c.id]
	delete(c.st.calls, c.id)
	c.st.mu.Unlock()
	c.mu.Lock()
	c.gone, c.frames = true, nil
	c.mu.Unlock()
	if running { // the reader forgets a call at its end: this one has not ended
		_ = c.st.send(&stagepb.MuxFrame{Id: c.id, Cancel: true})
	}
}
