package stagemux

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/baggage"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/goleak"
	"golang.org/x/sync/errgroup"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// service serves Multiplex with generate, over real gRPC on loopback, and
// counts the Multiplex streams it was opened.
type service struct {
	stagepb.UnimplementedStageServiceServer
	generate GenerateFunc
	stop     chan struct{}
	streams  atomic.Int32
	tp       trace.TracerProvider // makes the calls' server spans; nil: none
}

func (s *service) Multiplex(stream grpc.BidiStreamingServer[stagepb.MuxFrame, stagepb.MuxFrame]) error {
	s.streams.Add(1)
	return Serve(stream, s.generate, s.stop, s.tp)
}

// start serves svc and returns a client of it; both end with the test.
func start(t *testing.T, svc *service) stagepb.StageServiceClient {
	client, _ := startServer(t, svc)
	return client
}

// startServer is start that also returns a stop of the server (waiting for
// it), for a test that stops it first.
func startServer(t testing.TB, svc *service) (stagepb.StageServiceClient, func()) {
	t.Helper()
	if svc.stop == nil {
		svc.stop = make(chan struct{})
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer()
	stagepb.RegisterStageServiceServer(srv, svc)
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(lis)
	}()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	stop := func() {
		srv.Stop()
		<-served
	}
	t.Cleanup(func() {
		_ = conn.Close()
		stop()
	})
	return stagepb.NewStageServiceClient(conn), stop
}

func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// echo sends the request's text back as n chunks "text/0" ... "text/n-1",
// n being sampling.max_tokens, the last with a finish reason.
func echo(req *stagepb.GenerateRequest, stream grpc.ServerStreamingServer[stagepb.GenerateChunk]) error {
	n := int(req.GetSampling().GetMaxTokens())
	for i := range n {
		c := &stagepb.GenerateChunk{Text: fmt.Sprintf("%s/%d", req.GetText(), i)}
		if i == n-1 {
			c.FinishReason = stagepb.FinishReason_FINISH_REASON_LENGTH
		}
		if err := stream.Send(c); err != nil {
			return err
		}
	}
	return nil
}

func request(text string, chunks int) *stagepb.GenerateRequest {
	return &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Text{Text: text}, Sampling: &stagepb.SamplingParams{MaxTokens: uint32(chunks)}}
}

// drain reads a call to its end and returns its texts and final error
// (nil at io.EOF).
func drain(call *Call) ([]string, error) {
	defer call.Close()
	var texts []string
	for {
		c, err := call.Recv()
		if errors.Is(err, io.EOF) {
			return texts, nil
		}
		if err != nil {
			return texts, err
		}
		texts = append(texts, c.GetText())
	}
}

func TestConcurrentCallsShareOneStreamAndKeepTheirOrder(t *testing.T) {
	svc := &service{generate: echo}
	mux := NewClient(start(t, svc))
	defer mux.Close()
	ctx := testContext(t)

	const calls, chunks = 64, 40 // more chunks than a call's buffer
	var g errgroup.Group
	for i := range calls {
		g.Go(func() error {
			name := "call" + strconv.Itoa(i)
			call, err := mux.Generate(ctx, request(name, chunks), nil)
			if err != nil {
				return err
			}
			texts, err := drain(call)
			if err != nil {
				return err
			}
			if len(texts) != chunks {
				return fmt.Errorf("%s: %d chunks, want %d", name, len(texts), chunks)
			}
			for j, text := range texts {
				if want := fmt.Sprintf("%s/%d", name, j); text != want {
					return fmt.Errorf("%s: chunk %d is %q, want %q", name, j, text, want)
				}
			}
			return nil
		})
	}
	require.NoError(t, g.Wait())
	assert.EqualValues(t, 1, svc.streams.Load(), "every call on one Multiplex stream")
}

// A call whose reader waits (a slow client) holds up no other call; once
// more output than maxQueuedBytes waits for it, it fails, and the worker
// is told to stop it.
func TestACallThatIsNotReadHoldsUpNoOther(t *testing.T) {
	audio := make([]byte, 1<<20)
	stopped := make(chan struct{})
	svc := &service{generate: func(req *stagepb.GenerateRequest, stream grpc.ServerStreamingServer[stagepb.GenerateChunk]) error {
		if req.GetText() != "flood" {
			return echo(req, stream)
		}
		defer close(stopped)
		for {
			if err := stream.Send(&stagepb.GenerateChunk{AudioPcm16: audio}); err != nil {
				return err
			}
			select {
			case <-stream.Context().Done():
				return stream.Context().Err()
			default:
			}
		}
	}}
	mux := NewClient(start(t, svc))
	defer mux.Close()
	ctx := testContext(t)

	flood, err := mux.Generate(ctx, request("flood", 0), nil)
	require.NoError(t, err)
	defer flood.Close()
	for i := range 5 { // while flood's output piles up unread
		call, err := mux.Generate(ctx, request("quick", 3), nil)
		require.NoError(t, err)
		texts, err := drain(call)
		require.NoError(t, err, "call %d", i)
		assert.Len(t, texts, 3)
	}
	select {
	case <-stopped: // the worker was told to stop the flood
	case <-ctx.Done():
		t.Fatal("the unread call was never stopped")
	}
	var received int
	for {
		c, err := flood.Recv()
		if err != nil {
			assert.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
			break
		}
		received += len(c.GetAudioPcm16())
	}
	assert.LessOrEqual(t, received, maxQueuedBytes, "never more than the limit held for it")
}

func TestCallEndsWithTheWorkersStatus(t *testing.T) {
	svc := &service{generate: func(req *stagepb.GenerateRequest, stream grpc.ServerStreamingServer[stagepb.GenerateChunk]) error {
		if err := stream.Send(&stagepb.GenerateChunk{Text: "partial"}); err != nil {
			return err
		}
		return status.Error(codes.ResourceExhausted, "engine: queue full")
	}}
	mux := NewClient(start(t, svc))
	defer mux.Close()

	call, err := mux.Generate(testContext(t), request("x", 1), nil)
	require.NoError(t, err)
	texts, err := drain(call)
	assert.Equal(t, []string{"partial"}, texts)
	st, ok := status.FromError(err)
	require.True(t, ok, "a status error: %v", err)
	assert.Equal(t, codes.ResourceExhausted, st.Code())
	assert.Equal(t, "engine: queue full", st.Message())
}

// A refusal's details (a google.rpc.ErrorInfo) reach the head as gRPC
// would carry them: the head answers some refusals by their reason.
func TestCallEndsWithTheStatusDetails(t *testing.T) {
	info := &errdetails.ErrorInfo{Domain: "troupe.stage", Reason: "CONTEXT_LENGTH_EXCEEDED", Metadata: map[string]string{"max_model_len": "8"}}
	svc := &service{generate: func(*stagepb.GenerateRequest, grpc.ServerStreamingServer[stagepb.GenerateChunk]) error {
		st, err := status.New(codes.InvalidArgument, "prompt too long").WithDetails(info)
		if err != nil {
			return err
		}
		return st.Err()
	}}
	mux := NewClient(start(t, svc))
	defer mux.Close()
	call, err := mux.Generate(testContext(t), request("x", 1), nil)
	require.NoError(t, err)
	_, err = drain(call)
	st := status.Convert(err)
	assert.Equal(t, codes.InvalidArgument, st.Code())
	assert.Equal(t, "prompt too long", st.Message())
	require.Len(t, st.Details(), 1)
	got, ok := st.Details()[0].(*errdetails.ErrorInfo)
	require.True(t, ok, "%T", st.Details()[0])
	assert.True(t, proto.Equal(info, got), "%v", got)
}

func TestCancellingACallCancelsItOnTheWorker(t *testing.T) {
	started := make(chan struct{})
	cancelled := make(chan error, 1)
	svc := &service{generate: func(req *stagepb.GenerateRequest, stream grpc.ServerStreamingServer[stagepb.GenerateChunk]) error {
		if req.GetText() == "quick" {
			return echo(req, stream)
		}
		close(started)
		<-stream.Context().Done()
		cancelled <- stream.Context().Err()
		return stream.Context().Err()
	}}
	mux := NewClient(start(t, svc))
	defer mux.Close()
	ctx := testContext(t)

	callCtx, cancel := context.WithCancel(ctx)
	call, err := mux.Generate(callCtx, request("slow", 1), nil)
	require.NoError(t, err)
	select {
	case <-started:
	case <-ctx.Done():
		t.Fatal("the call never reached the worker")
	}
	cancel()
	_, err = call.Recv()
	assert.Equal(t, codes.Canceled, status.Code(err), "Recv after the call's context ended: %v", err)
	call.Close()
	select {
	case err := <-cancelled:
		assert.ErrorIs(t, err, context.Canceled)
	case <-ctx.Done():
		t.Fatal("the worker's call was not cancelled")
	}

	// The stream outlives the cancelled call.
	call, err = mux.Generate(ctx, request("quick", 2), nil)
	require.NoError(t, err)
	texts, err := drain(call)
	require.NoError(t, err)
	assert.Equal(t, []string{"quick/0", "quick/1"}, texts)
	assert.EqualValues(t, 1, svc.streams.Load())
}

func TestAWorkerThatStopsEndsTheStreamAndTheNextCallOpensAnother(t *testing.T) {
	svc := &service{generate: echo}
	mux := NewClient(start(t, svc))
	defer mux.Close()
	ctx := testContext(t)

	call, err := mux.Generate(ctx, request("a", 1), nil)
	require.NoError(t, err)
	_, err = drain(call)
	require.NoError(t, err)

	close(svc.stop) // the worker drained: nothing runs
	// Calls sent before the client sees the end fail as unavailable
	// (nothing ran: the head retries them); once the reader has seen it,
	// the next call opens a new stream, which this worker ends at once too.
	var last error
	for i := 0; svc.streams.Load() < 2; i++ {
		require.NoError(t, ctx.Err(), "no second stream opened")
		call, err := mux.Generate(ctx, request("b", 1), nil)
		if err == nil {
			_, err = drain(call)
		}
		if err != nil {
			last = err
			assert.Equal(t, codes.Unavailable, status.Code(err), "call %d: %v", i, err)
		}
	}
	require.Error(t, last)
}

func TestAStreamThatBreaksFailsItsCallsAsUnavailable(t *testing.T) {
	release := make(chan struct{})
	started := make(chan struct{}, 1)
	svc := &service{generate: func(req *stagepb.GenerateRequest, stream grpc.ServerStreamingServer[stagepb.GenerateChunk]) error {
		started <- struct{}{}
		select {
		case <-release:
		case <-stream.Context().Done():
		}
		return nil
	}}
	client, stop := startServer(t, svc)
	mux := NewClient(client)
	defer mux.Close()
	ctx := testContext(t)

	call, err := mux.Generate(ctx, request("x", 1), nil)
	require.NoError(t, err)
	<-started
	stop() // the worker's process is gone: its connections close
	close(release)
	_, err = drain(call)
	assert.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
}

func TestCloseFailsRunningCallsAndLaterOnes(t *testing.T) {
	started := make(chan struct{})
	svc := &service{generate: func(req *stagepb.GenerateRequest, stream grpc.ServerStreamingServer[stagepb.GenerateChunk]) error {
		close(started)
		<-stream.Context().Done()
		return stream.Context().Err()
	}}
	mux := NewClient(start(t, svc))
	ctx := testContext(t)
	call, err := mux.Generate(ctx, request("x", 1), nil)
	require.NoError(t, err)
	<-started
	mux.Close()
	_, err = drain(call)
	require.Error(t, err)
	_, err = mux.Generate(ctx, request("y", 1), nil)
	assert.Equal(t, codes.Canceled, status.Code(err), "a call after Close: %v", err)
	mux.Close() // again: harmless
}

func TestAFrameTheHeadShouldNotSendEndsTheStream(t *testing.T) {
	for name, frames := range map[string][]*stagepb.MuxFrame{
		"no kind":        {{Id: 1}},
		"a chunk":        {{Id: 1, Chunk: &stagepb.GenerateChunk{}}},
		"duplicate call": {{Id: 1, Request: request("a", 0)}, {Id: 1, Request: request("a", 0)}},
	} {
		t.Run(name, func(t *testing.T) {
			block := make(chan struct{})
			defer close(block)
			svc := &service{generate: func(req *stagepb.GenerateRequest, stream grpc.ServerStreamingServer[stagepb.GenerateChunk]) error {
				select { // hold call 1 so that a second start is a duplicate
				case <-block:
				case <-stream.Context().Done():
				}
				return nil
			}}
			client := start(t, svc)
			ctx := testContext(t)
			s, err := client.Multiplex(ctx)
			require.NoError(t, err)
			for _, f := range frames {
				require.NoError(t, s.Send(f))
			}
			for {
				_, err = s.Recv()
				if err != nil {
					break
				}
			}
			assert.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
		})
	}
}

func TestHalfClosingLetsRunningCallsFinish(t *testing.T) {
	svc := &service{generate: echo}
	client := start(t, svc)
	ctx := testContext(t)
	s, err := client.Multiplex(ctx)
	require.NoError(t, err)
	require.NoError(t, s.Send(&stagepb.MuxFrame{Id: 7, Request: request("a", 3)}))
	require.NoError(t, s.CloseSend())
	var frames []*stagepb.MuxFrame
	for {
		f, err := s.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err)
		assert.EqualValues(t, 7, f.GetId())
		frames = append(frames, f)
	}
	var got []string
	for _, f := range frames {
		got = append(got, f.GetChunk().GetText())
	}
	assert.Equal(t, []string{"a/0", "a/1", "a/2"}, got, "a chunk a frame")
	last := frames[len(frames)-1]
	require.NotNil(t, last.GetEnd(), "the final chunk and the end in one frame")
	assert.EqualValues(t, codes.OK, last.GetEnd().GetCode())
	assert.Equal(t, stagepb.FinishReason_FINISH_REASON_LENGTH, last.GetChunk().GetFinishReason())
}

// TestCallsThatEndAnyWayLeakNothing races call ends, cancellations and
// Close; goleak (TestMain) checks no goroutine is left, -race the rest.
func TestCallsThatEndAnyWayLeakNothing(t *testing.T) {
	svc := &service{generate: echo}
	mux := NewClient(start(t, svc))
	ctx := testContext(t)
	var wg sync.WaitGroup
	for i := range 100 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			callCtx, cancel := context.WithCancel(ctx)
			defer cancel()
			call, err := mux.Generate(callCtx, request("x", 1+i%5), nil)
			if err != nil {
				return
			}
			switch i % 3 {
			case 0:
				_, _ = drain(call)
			case 1:
				cancel()
				_, _ = call.Recv()
				call.Close()
			case 2:
				call.Close() // abandoned unread
			}
		}()
	}
	wg.Wait()
	mux.Close()
}

// A call's deadline reaches the worker as gRPC's grpc-timeout would: the
// call's context there ends with it, and the call ends DeadlineExceeded.
func TestACallCarriesItsDeadlineToTheWorker(t *testing.T) {
	deadlines := make(chan time.Time, 1)
	svc := &service{generate: func(req *stagepb.GenerateRequest, stream grpc.ServerStreamingServer[stagepb.GenerateChunk]) error {
		dl, ok := stream.Context().Deadline()
		if !ok {
			return status.Error(codes.Internal, "no deadline")
		}
		deadlines <- dl
		<-stream.Context().Done()
		return status.FromContextError(stream.Context().Err()).Err()
	}}
	mux := NewClient(start(t, svc))
	defer mux.Close()
	ctx, cancel := context.WithTimeout(testContext(t), 300*time.Millisecond)
	defer cancel()
	want, _ := ctx.Deadline()
	call, err := mux.Generate(ctx, request("x", 1), nil)
	require.NoError(t, err)
	_, err = drain(call)
	assert.Equal(t, codes.DeadlineExceeded, status.Code(err), "%v", err)
	got := <-deadlines
	assert.WithinDuration(t, want, got, 100*time.Millisecond, "the worker's deadline is the head's")

	// A call whose deadline passed is not sent, as gRPC sends none.
	_, err = mux.Generate(ctx, request("late", 1), nil)
	assert.Equal(t, codes.DeadlineExceeded, status.Code(err), "%v", err)
}

// A traced call has the spans otelgrpc gives a Generate call: the head's
// client span under the caller's, the worker's server span under it, and
// the call's context (its baggage too) on the worker. An untraced one
// carries no trace context.
func TestATracedCallsWorkerSpanIsAChildOfItsClientSpan(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	headTP := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()), sdktrace.WithSpanProcessor(rec))
	workerTP := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.NeverSample())), sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() {
		_ = headTP.Shutdown(context.Background())
		_ = workerTP.Shutdown(context.Background())
	})
	type seen struct {
		span    trace.SpanContext
		baggage string
	}
	calls := make(chan seen, 2)
	svc := &service{tp: workerTP, generate: func(req *stagepb.GenerateRequest, stream grpc.ServerStreamingServer[stagepb.GenerateChunk]) error {
		ctx := stream.Context()
		calls <- seen{trace.SpanContextFromContext(ctx), baggage.FromContext(ctx).Member("tenant").Value()}
		if req.GetText() == "refused" {
			return status.Error(codes.InvalidArgument, "engine: no")
		}
		return echo(req, stream)
	}}
	mux := NewClient(start(t, svc))
	defer mux.Close()

	member, err := baggage.NewMember("tenant", "acme")
	require.NoError(t, err)
	bag, err := baggage.New(member)
	require.NoError(t, err)
	ctx, parent := headTP.Tracer("test").Start(baggage.ContextWithBaggage(testContext(t), bag), "stage")
	tracer := headTP.Tracer("stagemux")
	for _, text := range []string{"ok", "refused"} {
		call, err := mux.Generate(ctx, request(text, 2), tracer)
		require.NoError(t, err)
		_, _ = drain(call)
		got := <-calls
		assert.Equal(t, "acme", got.baggage, "%s: the baggage went with the call", text)
		assert.Equal(t, parent.SpanContext().TraceID(), got.span.TraceID(), "%s: the worker is in the head's trace", text)
	}
	parent.End()

	call, err := mux.Generate(testContext(t), request("untraced", 1), nil)
	require.NoError(t, err)
	_, err = drain(call)
	require.NoError(t, err)
	untraced := <-calls
	assert.False(t, untraced.span.IsSampled(), "an untraced call's worker span follows no sampled parent")

	byID := map[trace.SpanID]sdktrace.ReadOnlySpan{}
	var clients, servers []sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		byID[s.SpanContext().SpanID()] = s
		switch s.SpanKind() {
		case trace.SpanKindClient:
			clients = append(clients, s)
		case trace.SpanKindServer:
			servers = append(servers, s)
		}
	}
	require.Len(t, clients, 2, "a client span per traced call")
	require.Len(t, servers, 2, "a server span per traced call, none for the untraced one")
	for _, s := range append(clients, servers...) {
		assert.Equal(t, GenerateMethod, s.Name())
	}
	for _, srv := range servers {
		client := byID[srv.Parent().SpanID()]
		require.NotNil(t, client, "the server span's parent is a client span")
		assert.Equal(t, trace.SpanKindClient, client.SpanKind())
		assert.Equal(t, parent.SpanContext().SpanID(), client.Parent().SpanID(), "the client span is under the caller's")
	}
	statuses := map[string]string{}
	for _, s := range append(clients, servers...) {
		for _, a := range s.Attributes() {
			if a.Key == "rpc.response.status_code" {
				statuses[s.SpanKind().String()+" "+a.Value.AsString()+" "+s.Status().Code.String()] = ""
			}
		}
	}
	assert.Equal(t, map[string]string{
		"client OK Unset": "", "client INVALID_ARGUMENT Error": "",
		"server OK Unset": "", "server INVALID_ARGUMENT Unset": "", // otelgrpc's server rule: the client's fault
	}, statuses)
}

// All of a connection's calls together hold at most its budget of unread
// output: past it the call holding the most fails, the others go on.
func TestACallsOfAConnectionHoldAtMostItsBudget(t *testing.T) {
	chunk := make([]byte, 256<<10)
	const chunks = 5 // 1.25 MiB a call: under the call's limit, two over the connection's
	svc := &service{generate: func(req *stagepb.GenerateRequest, stream grpc.ServerStreamingServer[stagepb.GenerateChunk]) error {
		if req.GetText() != "flood" {
			return echo(req, stream)
		}
		for range chunks {
			if err := stream.Send(&stagepb.GenerateChunk{AudioPcm16: chunk}); err != nil {
				return err
			}
		}
		return nil
	}}
	mux := NewClient(start(t, svc))
	mux.limits = limits{call: 2 << 20, stream: 2 << 20}
	defer mux.Close()
	ctx := testContext(t)

	floods := make([]*Call, 2)
	for i := range floods {
		call, err := mux.Generate(ctx, request("flood", 0), nil)
		require.NoError(t, err)
		defer call.Close()
		floods[i] = call
	}
	// Neither is read: wait until the reader has seen each end, or failed
	// the call.
	ended := func(c *Call) bool {
		c.st.mu.Lock()
		defer c.st.mu.Unlock()
		_, running := c.st.calls[c.id]
		return !running
	}
	require.Eventually(t, func() bool { return ended(floods[0]) && ended(floods[1]) }, 10*time.Second, time.Millisecond)
	assert.LessOrEqual(t, mux.cur.queued.Load(), int64(2<<20))

	var failed, whole int
	for _, c := range floods {
		var got int
		var err error
		for {
			var ch *stagepb.GenerateChunk
			if ch, err = c.Recv(); err != nil {
				break
			}
			got += len(ch.GetAudioPcm16())
		}
		switch {
		case errors.Is(err, io.EOF):
			assert.Equal(t, chunks*len(chunk), got)
			whole++
		default:
			assert.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
			assert.Contains(t, err.Error(), "connection's output wait to be read")
			failed++
		}
	}
	assert.Equal(t, 1, failed, "one call failed for the connection's budget")
	assert.Equal(t, 1, whole, "the other had all its output")

	call, err := mux.Generate(ctx, request("quick", 2), nil)
	require.NoError(t, err)
	texts, err := drain(call)
	require.NoError(t, err)
	assert.Len(t, texts, 2)
	for _, c := range floods {
		c.Close()
	}
	assert.Zero(t, mux.cur.queued.Load(), "closed calls hold nothing")
}

// TestLastFrameSaysTheWorkerWorksWhetherOrNotACallIsRead: LastFrame is
// zero before any frame, and moves on as the worker's frames arrive, also
// when nobody reads the call they belong to (the head's stall clock asks
// it about a replica whose other calls wait on their readers).
func TestLastFrameSaysTheWorkerWorksWhetherOrNotACallIsRead(t *testing.T) {
	svc := &service{generate: echo}
	mux := NewClient(start(t, svc))
	defer mux.Close()
	ctx := testContext(t)
	assert.True(t, mux.LastFrame().IsZero(), "no frame yet")

	before := time.Now()
	unread, err := mux.Generate(ctx, request("unread", 3), nil)
	require.NoError(t, err)
	defer unread.Close()
	require.Eventually(t, func() bool { return !mux.LastFrame().Before(before) }, 10*time.Second, time.Millisecond,
		"a frame of a call nobody reads counts")

	first := mux.LastFrame()
	call, err := mux.Generate(ctx, request("read", 2), nil)
	require.NoError(t, err)
	texts, err := drain(call)
	require.NoError(t, err)
	assert.Len(t, texts, 2)
	assert.False(t, mux.LastFrame().Before(first), "later frames move it on")
}

// TestAQueueThatGrowsIsKeptEncodedAndDeliveredWhole: the frames of a call
// nobody reads wait, past compactAfter, encoded; read later, every chunk
// comes whole and in order, and the end after them.
func TestAQueueThatGrowsIsKeptEncodedAndDeliveredWhole(t *testing.T) {
	svc := &service{generate: echo}
	mux := NewClient(start(t, svc))
	defer mux.Close()
	ctx := testContext(t)
	const n = 5 * compactAfter
	call, err := mux.Generate(ctx, request("later", n), nil)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		call.mu.Lock()
		defer call.mu.Unlock()
		return len(call.frames) == n // the last chunk comes with the end, in one frame
	}, 10*time.Second, time.Millisecond, "every frame queued, unread")
	call.mu.Lock()
	encoded := 0
	for _, q := range call.frames {
		if q.raw != nil {
			encoded++
		}
	}
	call.mu.Unlock()
	assert.Equal(t, n-compactAfter, encoded, "frames past compactAfter wait encoded")

	texts, err := drain(call)
	require.NoError(t, err)
	require.Len(t, texts, n)
	for i, text := range texts {
		assert.Equal(t, fmt.Sprintf("later/%d", i), text)
	}
	assert.Zero(t, call.queuedBytes(), "nothing counted once read")
}
