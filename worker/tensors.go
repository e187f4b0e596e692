package worker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/telemetry"
)

// Tensors go worker to worker (docs/contracts.md, "Tensors between
// stages"): a producing stage's worker pushes its engine's output tensors
// (pusher) to the attempt of the consuming stage that holds a ticket
// (inbox), over the consumer's PushTensors. The head only says where the
// consumer's attempt is.
//
// What survives a failure: the producer keeps every push of a request
// until the consumer acknowledges the last one, and a new sink (the
// consumer's attempt moved to another replica) gets them all again from the
// first, because a consumer's engine state (a talker's context) is gone
// with it and the replacement rebuilds it from the first tensor; the head
// skips the output the replaced attempt already forwarded, as for every
// retried stage. A consumer drops pushes whose seq it has had, so a
// producer that reconnects, or is retried from the start on another
// replica, repeats nothing.

// Default tensor limits (Config.MaxTensorPushBytes, MaxRequestTensorBytes).
const (
	DefaultMaxTensorPushBytes    = 16 << 20
	DefaultMaxRequestTensorBytes = 256 << 20
)

// ticketWait bounds how long a push waits for the consumer's attempt to
// hold its ticket: the head sends the consumer's request before it tells
// the producer where it is, so only a reordering within one worker's
// handling waits.
const ticketWait = 10 * time.Second

// tensorBytes is the payload of ts.
func tensorBytes(ts []*stagepb.Tensor) int64 {
	var n int64
	for _, t := range ts {
		n += int64(len(t.GetData()))
	}
	return n
}

// dtypeSize is the size of one element of d; 0 for an unknown type.
func dtypeSize(d stagepb.DType) int {
	switch d {
	case stagepb.DType_DTYPE_FLOAT32, stagepb.DType_DTYPE_INT32:
		return 4
	case stagepb.DType_DTYPE_FLOAT16, stagepb.DType_DTYPE_BFLOAT16:
		return 2
	case stagepb.DType_DTYPE_INT64:
		return 8
	case stagepb.DType_DTYPE_UINT8:
		return 1
	}
	return 0
}

// CheckTensor reports what is wrong with t: an unknown type, a negative
// dimension, or data that does not hold exactly its shape's elements.
func CheckTensor(t *stagepb.Tensor) error {
	size := dtypeSize(t.GetDtype())
	if size == 0 {
		return fmt.Errorf("worker: tensor %q has unknown dtype %v", t.GetName(), t.GetDtype())
	}
	elems := int64(1)
	for _, d := range t.GetShape() {
		if d < 0 {
			return fmt.Errorf("worker: tensor %q has a negative dimension in shape %v", t.GetName(), t.GetShape())
		}
		elems *= d
		if elems > 1<<40 {
			return fmt.Errorf("worker: tensor %q's shape %v is too large", t.GetName(), t.GetShape())
		}
	}
	if want := elems * int64(size); int64(len(t.GetData())) != want {
		return fmt.Errorf("worker: tensor %q of shape %v and dtype %v needs %d bytes, has %d", t.GetName(), t.GetShape(), t.GetDtype(), want, len(t.GetData()))
	}
	return nil
}

// concatTensors joins the tensors of several pushes by name along their
// first dimension, in order, so a segment of many pushes is one input per
// name. Tensors of one name must agree in dtype and in every dimension but
// the first.
func concatTensors(pushes []*stagepb.TensorPush) ([]*stagepb.Tensor, error) {
	if len(pushes) == 1 {
		return pushes[0].GetTensors(), nil // nothing to join: no copy
	}
	var out []*stagepb.Tensor
	byName := map[string]*stagepb.Tensor{}
	for _, p := range pushes {
		for _, t := range p.GetTensors() {
			prev, ok := byName[t.GetName()]
			if !ok {
				c := &stagepb.Tensor{Name: t.GetName(), Dtype: t.GetDtype(), Shape: slices.Clone(t.GetShape()), Data: slices.Clone(t.GetData())}
				byName[t.GetName()] = c
				out = append(out, c)
				continue
			}
			if prev.GetDtype() != t.GetDtype() || len(prev.GetShape()) == 0 || len(t.GetShape()) != len(prev.GetShape()) || !slices.Equal(prev.GetShape()[1:], t.GetShape()[1:]) {
				return nil, status.Errorf(codes.InvalidArgument, "worker: tensor %q changes dtype or shape between pushes (%v %v, then %v %v): they cannot be joined along the first dimension",
					t.GetName(), prev.GetDtype(), prev.GetShape(), t.GetDtype(), t.GetShape())
			}
			prev.Shape[0] += t.GetShape()[0]
			prev.Data = append(prev.Data, t.GetData()...)
		}
	}
	return out, nil
}

// tensorHub holds the inboxes of this worker's consuming attempts, by
// ticket. Safe for concurrent use.
type tensorHub struct {
	mu      sync.Mutex
	inboxes map[string]*inbox
	changed chan struct{} // closed and replaced when an inbox opens
}

func newTensorHub() *tensorHub {
	return &tensorHub{inboxes: map[string]*inbox{}, changed: make(chan struct{})}
}

// open registers the inbox of a consuming attempt; the attempt calls the
// returned close when it ends.
func (h *tensorHub) open(ticket string, maxBytes int64) (*inbox, func(), error) {
	if ticket == "" {
		return nil, nil, status.Error(codes.InvalidArgument, "worker: this stage takes tensors: its request needs a tensor_ticket")
	}
	in := &inbox{ticket: ticket, maxBytes: maxBytes, changed: make(chan struct{})}
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, dup := h.inboxes[ticket]; dup {
		return nil, nil, status.Errorf(codes.AlreadyExists, "worker: tensor ticket %q is in use", ticket)
	}
	h.inboxes[ticket] = in
	close(h.changed)
	h.changed = make(chan struct{})
	return in, func() {
		h.mu.Lock()
		delete(h.inboxes, ticket)
		h.mu.Unlock()
		in.close()
	}, nil
}

// await returns the inbox of ticket, waiting while it is not open yet.
func (h *tensorHub) await(ctx context.Context, ticket string) (*inbox, error) {
	ctx, cancel := context.WithTimeout(ctx, ticketWait)
	defer cancel()
	for {
		h.mu.Lock()
		in, ok := h.inboxes[ticket]
		ch := h.changed
		h.mu.Unlock()
		if ok {
			return in, nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return nil, status.Errorf(codes.NotFound, "worker: no attempt here holds tensor ticket %q", ticket)
		}
	}
}

// inbox is one consuming attempt's tensor input: pushes received and not
// yet taken, and what the attempt has acknowledged. PushTensors handlers
// put, the attempt's segmenter takes and acknowledges. Safe for
// concurrent use.
type inbox struct {
	ticket   string
	maxBytes int64

	mu       sync.Mutex
	pending  []*stagepb.TensorPush
	received uint64 // highest seq put
	bytes    int64  // tensor bytes put
	last     bool   // the push marked last was put
	acked    uint64 // highest seq acknowledged
	closed   bool
	changed  chan struct{} // closed and replaced on every change
}

func (in *inbox) notifyLocked() {
	close(in.changed)
	in.changed = make(chan struct{})
}

// put adds a push unless its seq was had already (a replay).
func (in *inbox) put(p *stagepb.TensorPush) error {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.closed {
		return status.Error(codes.Aborted, "worker: the consuming attempt has ended")
	}
	if p.GetSeq() <= in.received {
		return nil
	}
	if p.GetSeq() != in.received+1 {
		return status.Errorf(codes.InvalidArgument, "worker: tensor push %d follows push %d: pushes must come in order", p.GetSeq(), in.received)
	}
	for _, t := range p.GetTensors() {
		if err := CheckTensor(t); err != nil {
			return status.Error(codes.InvalidArgument, err.Error())
		}
	}
	in.bytes += tensorBytes(p.GetTensors())
	if in.bytes > in.maxBytes {
		return status.Errorf(codes.ResourceExhausted, "worker: the request's tensors reached %d bytes, over the limit of %d (--max-request-tensor-bytes)", in.bytes, in.maxBytes)
	}
	in.received = p.GetSeq()
	in.last = in.last || p.GetLast()
	in.pending = append(in.pending, p)
	in.notifyLocked()
	return nil
}

// take returns the pushes put since the last take, whether the last push
// is among everything put, and a channel closed at the next change.
func (in *inbox) take() (ps []*stagepb.TensorPush, last bool, changed <-chan struct{}) {
	in.mu.Lock()
	defer in.mu.Unlock()
	ps, in.pending = in.pending, nil
	return ps, in.last, in.changed
}

// ack records that pushes up to seq were consumed and answered.
func (in *inbox) ack(seq uint64) {
	in.mu.Lock()
	defer in.mu.Unlock()
	if seq > in.acked {
		in.acked = seq
		in.notifyLocked()
	}
}

// acks returns the acknowledged seq, whether the inbox closed, and a
// channel closed at the next change.
func (in *inbox) acks() (uint64, bool, <-chan struct{}) {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.acked, in.closed, in.changed
}

func (in *inbox) close() {
	in.mu.Lock()
	defer in.mu.Unlock()
	if !in.closed {
		in.closed = true
		in.notifyLocked()
	}
}

// PushTensors implements StageService: a producer's pushes for the
// consuming attempt that holds the first message's ticket. The handler's
// reader puts pushes into the attempt's inbox; the handler itself sends
// the acknowledgements, until the last push is acknowledged or the
// attempt ends.
func (svc *service) PushTensors(stream grpc.BidiStreamingServer[stagepb.TensorPush, stagepb.TensorAck]) error {
	s := svc.s
	ctx, cancel := context.WithCancel(stream.Context())
	defer cancel()
	first, err := stream.Recv()
	if err != nil {
		return status.Errorf(codes.InvalidArgument, "worker: PushTensors ended before its first push: %v", err)
	}
	in, err := s.tensors.await(ctx, first.GetTicket())
	if err != nil {
		return err
	}
	readErr := make(chan error, 1)
	go func() {
		err := in.put(first)
		for err == nil {
			var p *stagepb.TensorPush
			if p, err = stream.Recv(); err == nil {
				err = in.put(p)
			}
		}
		if errors.Is(err, io.EOF) {
			err = nil
		}
		readErr <- err
	}()
	var sent uint64
	for {
		acked, closed, changed := in.acks()
		if acked > sent {
			if err := stream.Send(&stagepb.TensorAck{Seq: acked}); err != nil {
				return err
			}
			sent = acked
		}
		if closed {
			return nil
		}
		select {
		case <-changed:
		case err := <-readErr:
			if err != nil {
				return err
			}
			readErr = nil // the producer sent all it had; acks still go back
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// peerDialer connects this worker to other workers (the consumers of its
// tensors), one connection per address, closed by Close. Safe for
// concurrent use.
type peerDialer struct {
	opts  []grpc.DialOption
	mu    sync.Mutex
	conns map[string]*grpc.ClientConn
}

func newPeerDialer(opts []grpc.DialOption) *peerDialer {
	if len(opts) == 0 {
		opts = []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	}
	return &peerDialer{opts: opts, conns: map[string]*grpc.ClientConn{}}
}

func (d *peerDialer) client(addr string) (stagepb.StageServiceClient, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if cc, ok := d.conns[addr]; ok {
		return stagepb.NewStageServiceClient(cc), nil
	}
	cc, err := grpc.NewClient(addr, d.opts...)
	if err != nil {
		return nil, fmt.Errorf("worker: dial tensor sink %s: %w", addr, err)
	}
	d.conns[addr] = cc
	return stagepb.NewStageServiceClient(cc), nil
}

func (d *peerDialer) Close() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for addr, cc := range d.conns {
		_ = cc.Close()
		delete(d.conns, addr)
	}
}

// pusher is one producing request's side of the tensor path: every push it
// made, in order, kept until the consumer acknowledges the last, and the
// sink they go to. The request's handler adds and finishes; run, owned by
// the handler, sends. Safe for concurrent use.
type pusher struct {
	peers    *peerDialer
	maxPush  int64
	maxBytes int64

	mu      sync.Mutex
	pushes  []*stagepb.TensorPush
	bytes   int64
	sink    *stagepb.TensorSink
	acked   uint64
	failed  error         // a sink refused the pushes for good: the request fails
	changed chan struct{} // closed and replaced on every change
}

func newPusher(peers *peerDialer, sink *stagepb.TensorSink, maxPush, maxBytes int64) *pusher {
	return &pusher{peers: peers, sink: sink, maxPush: maxPush, maxBytes: maxBytes, changed: make(chan struct{})}
}

func (p *pusher) notifyLocked() {
	close(p.changed)
	p.changed = make(chan struct{})
}

// setSink sends every push from now on to sink, the first ones again.
func (p *pusher) setSink(sink *stagepb.TensorSink) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.sink = sink
	p.notifyLocked()
}

// add keeps a push of ts and returns its size in bytes.
func (p *pusher) add(ts []*stagepb.Tensor, last bool) (int64, error) {
	for _, t := range ts {
		if err := CheckTensor(t); err != nil {
			return 0, status.Error(codes.Internal, "worker: the engine made a bad tensor: "+err.Error())
		}
	}
	n := tensorBytes(ts)
	if n > p.maxPush {
		return 0, status.Errorf(codes.ResourceExhausted, "worker: one chunk's tensors hold %d bytes, over the limit of %d (--max-tensor-push-bytes)", n, p.maxPush)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.failed != nil {
		return 0, p.failed
	}
	if p.bytes+n > p.maxBytes {
		return 0, status.Errorf(codes.ResourceExhausted, "worker: the request's tensors reached %d bytes, over the limit of %d (--max-request-tensor-bytes)", p.bytes+n, p.maxBytes)
	}
	p.bytes += n
	p.pushes = append(p.pushes, &stagepb.TensorPush{Seq: uint64(len(p.pushes) + 1), Tensors: ts, Last: last})
	p.notifyLocked()
	return n, nil
}

// finish adds the last push and waits until the consumer acknowledges it.
func (p *pusher) finish(ctx context.Context) error {
	if _, err := p.add(nil, true); err != nil {
		return err
	}
	for {
		p.mu.Lock()
		done, failed, ch := p.acked >= uint64(len(p.pushes)), p.failed, p.changed
		p.mu.Unlock()
		if failed != nil {
			return failed
		}
		if done {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// run sends the pushes to the current sink until ctx ends: from the first
// on every new sink, and on a broken stream again to the same sink after a
// pause (the head sends a new sink when the consumer's attempt moved). Each
// connection to a sink is a span with the bytes it carried.
func (p *pusher) run(ctx context.Context) {
	for ctx.Err() == nil {
		p.mu.Lock()
		sink, ch := p.sink, p.changed
		p.mu.Unlock()
		if sink == nil {
			select {
			case <-ch:
			case <-ctx.Done():
			}
			continue
		}
		err := p.pushTo(ctx, sink)
		if err == nil {
			return // the last push is acknowledged
		}
		if refused(err) {
			p.mu.Lock()
			p.failed = status.Errorf(status.Code(err), "worker: the tensor sink %s refused this request's tensors: %v", sink.GetAddr(), status.Convert(err).Message())
			p.notifyLocked()
			p.mu.Unlock()
			return
		}
		p.mu.Lock()
		moved := p.sink != sink
		ch = p.changed
		p.mu.Unlock()
		if moved {
			continue
		}
		t := time.NewTimer(100 * time.Millisecond)
		select {
		case <-t.C:
		case <-ch:
		case <-ctx.Done():
		}
		t.Stop()
	}
}

// pushTo sends every push to sink, from the first, until the last is
// acknowledged (nil), the stream fails, or the sink changes.
func (p *pusher) pushTo(ctx context.Context, sink *stagepb.TensorSink) (err error) {
	tracer := trace.SpanFromContext(ctx).TracerProvider().Tracer("github.com/troupe-serving/troupe/worker")
	ctx, span := tracer.Start(ctx, telemetry.SpanTensorPush, trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(attribute.String("server.address", sink.GetAddr())))
	var sentBytes int64
	var sentPushes int
	defer func() {
		span.SetAttributes(telemetry.KeyTensorBytes.Int64(sentBytes), telemetry.KeyTensorPushes.Int(sentPushes))
		if err != nil && !errors.Is(err, errSinkMoved) {
			span.RecordError(err)
		}
		span.End()
	}()
	client, err := p.peers.client(sink.GetAddr())
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stream, err := client.PushTensors(ctx, grpc.MaxCallSendMsgSize(int(p.maxPush/15*16+16)))
	if err != nil {
		return err
	}
	go func() { // acknowledgements
		for {
			ack, err := stream.Recv()
			if err != nil {
				cancel(fmt.Errorf("worker: tensor sink %s: %w", sink.GetAddr(), err))
				return
			}
			p.mu.Lock()
			if ack.GetSeq() > p.acked {
				p.acked = ack.GetSeq()
				p.notifyLocked()
			}
			p.mu.Unlock()
		}
	}()
	next := 0
	for {
		p.mu.Lock()
		moved := p.sink != sink
		todo := p.pushes[next:len(p.pushes):len(p.pushes)]
		done := len(p.pushes) > 0 && p.pushes[len(p.pushes)-1].GetLast() && p.acked >= uint64(len(p.pushes))
		ch := p.changed
		p.mu.Unlock()
		if done {
			_ = stream.CloseSend()
			return nil
		}
		if moved {
			return errSinkMoved
		}
		for _, push := range todo {
			if next == 0 {
				push = &stagepb.TensorPush{Ticket: sink.GetTicket(), Seq: push.GetSeq(), Tensors: push.GetTensors(), Last: push.GetLast()}
			}
			if err := stream.Send(push); err != nil {
				return context.Cause(ctx)
			}
			sentBytes += tensorBytes(push.GetTensors())
			sentPushes++
			next++
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}
}

var errSinkMoved = errors.New("worker: the tensor sink moved")

// refused reports whether a sink's error will not go away by sending again:
// the credentials or the pushes themselves were refused. A sink that is
// down or gone (Unavailable, NotFound, Aborted) is replaced by the head.
func refused(err error) bool {
	switch status.Code(err) {
	case codes.Unauthenticated, codes.PermissionDenied, codes.InvalidArgument, codes.ResourceExhausted:
		return true
	}
	return false
}

// receivedSeq is the highest seq put.
func (in *inbox) receivedSeq() uint64 {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.received
}
