package worker_test

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/pkg/clusterauth"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/telemetry"
	"github.com/troupe-serving/troupe/pkg/tlsconfig"
	"github.com/troupe-serving/troupe/pkg/tlsconfig/tlsconfigtest"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/omnisim"
)

const hiddenWidth = 64

// direct is what the thinker and talker make chained in one process: the
// text, and the talker's codes for every hidden row.
func direct(t *testing.T, prompt string, tokens int) (string, []uint32) {
	t.Helper()
	var text strings.Builder
	var rows []*stagepb.Tensor
	th := &omnisim.Thinker{Width: hiddenWidth, MaxTokens: tokens}
	require.NoError(t, th.Generate(context.Background(), textReq(prompt, nil), func(c *stagepb.GenerateChunk) error {
		text.WriteString(c.GetText())
		rows = append(rows, c.GetTensors()...)
		return nil
	}))
	var codes []uint32
	for _, r := range rows {
		codes = append(codes, omnisim.CodesOf(r.GetData(), 2, 1024)...)
	}
	return text.String(), codes
}

type pipelineEnd = grpc.BidiStreamingClient[stagepb.StreamInput, stagepb.GenerateChunk]

// consume opens a consuming attempt with ticket, as the head does.
func consume(t *testing.T, ctx context.Context, cli stagepb.StageServiceClient, ticket string) pipelineEnd {
	t.Helper()
	s, err := cli.GenerateStream(ctx)
	require.NoError(t, err)
	require.NoError(t, s.Send(&stagepb.StreamInput{Request: &stagepb.GenerateRequest{RequestId: "r1", TensorTicket: ticket}}))
	return s
}

// produce opens the producing request with its first sink, as the head does.
func produce(t *testing.T, ctx context.Context, cli stagepb.StageServiceClient, prompt string, sink *stagepb.TensorSink) pipelineEnd {
	t.Helper()
	s, err := cli.GenerateStream(ctx)
	require.NoError(t, err)
	req := textReq(prompt, nil)
	req.RequestId = "r1"
	require.NoError(t, s.Send(&stagepb.StreamInput{Request: req, TensorSink: sink}))
	return s
}

func codesOf(chunks []*stagepb.GenerateChunk) []uint32 {
	var out []uint32
	for _, c := range chunks {
		out = append(out, c.GetCodes()...)
	}
	return out
}

// TestTensorsGoWorkerToWorker: the thinker's hidden rows reach the talker
// over PushTensors, never on the thinker's chunks (which count their
// bytes), and the talker's codes are those of the rows chained directly.
func TestTensorsGoWorkerToWorker(t *testing.T) {
	ctx := testCtx(t)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	thinker := start(t, worker.Config{Stage: "thinker", Engine: &omnisim.Thinker{Width: hiddenWidth},
		ServerOptions: []grpc.ServerOption{grpc.StatsHandler(otelgrpc.NewServerHandler(otelgrpc.WithTracerProvider(tp)))}})
	talker := start(t, worker.Config{Stage: "talker", Engine: &omnisim.Talker{}})
	thinker.waitRegistered(t)
	talker.waitRegistered(t)

	cons := consume(t, ctx, dial(t, talker.Advertise()), "ticket-1")
	prod := produce(t, ctx, dial(t, thinker.Advertise()), "say hello", &stagepb.TensorSink{Addr: talker.Advertise(), Ticket: "ticket-1"})
	thought, err := recvBidi(prod)
	require.NoError(t, err)
	require.NoError(t, cons.CloseSend()) // the head closes a consumer once its producer ended
	spoken, err := recvBidi(cons)
	require.NoError(t, err)

	wantText, wantCodes := direct(t, "say hello", 16)
	assert.Equal(t, wantText, joinText(thought))
	var bytes uint64
	for _, c := range thought {
		assert.Empty(t, c.GetTensors(), "tensors never travel to the head")
		bytes += c.GetTensorBytes()
	}
	assert.Equal(t, uint64(16*hiddenWidth*4), bytes)
	assert.Equal(t, wantCodes, codesOf(spoken))
	assert.Equal(t, stagepb.FinishReason_FINISH_REASON_STOP, spoken[len(spoken)-1].GetFinishReason())

	// The transfer is its own span, under the producer's RPC, with its bytes.
	var push sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == telemetry.SpanTensorPush {
			push = s
		}
	}
	require.NotNil(t, push, "a %s span", telemetry.SpanTensorPush)
	attrs := map[string]int64{}
	for _, kv := range push.Attributes() {
		attrs[string(kv.Key)] = kv.Value.AsInt64()
	}
	assert.Equal(t, int64(bytes), attrs[string(telemetry.KeyTensorBytes)])
	assert.Equal(t, int64(17), attrs[string(telemetry.KeyTensorPushes)], "16 rows and the last push")
	assert.True(t, push.Parent().IsValid(), "under the producer's GenerateStream span")
}

// TestTensorConsumerReplaced: a talker that dies mid-request is replaced by
// another replica, which the producer sends every push again: its codes
// are the whole request's, and the producer ends only once they are out.
func TestTensorConsumerReplaced(t *testing.T) {
	ctx := testCtx(t)
	thinker := start(t, worker.Config{Stage: "thinker", Engine: &omnisim.Thinker{Width: hiddenWidth, MaxTokens: 40}})
	gated := &gatedTalker{Talker: &omnisim.Talker{}, held: make(chan struct{}, 64), gate: make(chan struct{})}
	first := start(t, worker.Config{Stage: "talker", Engine: gated, DrainTimeout: 1})
	second := start(t, worker.Config{Stage: "talker", ReplicaID: 1, Engine: &omnisim.Talker{}})
	thinker.waitRegistered(t)
	first.waitRegistered(t)
	second.waitRegistered(t)

	cons1 := consume(t, ctx, dial(t, first.Advertise()), "ticket-1")
	prod := produce(t, ctx, dial(t, thinker.Advertise()), "a longer answer", &stagepb.TensorSink{Addr: first.Advertise(), Ticket: "ticket-1"})
	c, err := cons1.Recv()
	require.NoError(t, err)
	require.NotEmpty(t, c.GetCodes(), "the first talker answered part of the request")
	<-gated.held
	_ = first.stop(t) // the talker's replica goes away mid-request

	cons2 := consume(t, ctx, dial(t, second.Advertise()), "ticket-2")
	require.NoError(t, prod.Send(&stagepb.StreamInput{TensorSink: &stagepb.TensorSink{Addr: second.Advertise(), Ticket: "ticket-2"}}))
	thought, err := recvBidi(prod)
	require.NoError(t, err)
	require.NoError(t, cons2.CloseSend())
	spoken, err := recvBidi(cons2)
	require.NoError(t, err)

	wantText, wantCodes := direct(t, "a longer answer", 40)
	assert.Equal(t, wantText, joinText(thought))
	assert.Equal(t, wantCodes, codesOf(spoken), "the new talker rebuilt the whole request from the first push")
}

// gatedTalker holds its first segment's answer until the test is done
// with it: a talker that is mid-request.
type gatedTalker struct {
	*omnisim.Talker
	held chan struct{}
	gate chan struct{}
	once bool
}

func (g *gatedTalker) Generate(ctx context.Context, req *stagepb.GenerateRequest, emit func(*stagepb.GenerateChunk) error) error {
	if err := g.Talker.Generate(ctx, req, emit); err != nil || g.once {
		return err
	}
	g.once = true
	g.held <- struct{}{}
	select {
	case <-g.gate:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// TestTensorLimits: a request whose tensors pass the producer's limit fails
// with a message that names the flag; a consumer's request without a ticket
// is refused.
func TestTensorLimits(t *testing.T) {
	ctx := testCtx(t)
	thinker := start(t, worker.Config{Stage: "thinker", Engine: &omnisim.Thinker{Width: hiddenWidth}, MaxRequestTensorBytes: 3 * hiddenWidth * 4})
	talker := start(t, worker.Config{Stage: "talker", Engine: &omnisim.Talker{}})
	thinker.waitRegistered(t)
	talker.waitRegistered(t)

	cons := consume(t, ctx, dial(t, talker.Advertise()), "ticket-1")
	prod := produce(t, ctx, dial(t, thinker.Advertise()), "say hello", &stagepb.TensorSink{Addr: talker.Advertise(), Ticket: "ticket-1"})
	_, err := recvBidi(prod)
	require.Error(t, err)
	assert.Equal(t, codes.ResourceExhausted, status.Code(err))
	assert.Contains(t, err.Error(), "--max-request-tensor-bytes")
	require.NoError(t, cons.CloseSend())

	_, err = streamed(t, dial(t, talker.Advertise()), &stagepb.StreamInput{Request: &stagepb.GenerateRequest{RequestId: "r2"}})
	assert.Equal(t, codes.InvalidArgument, status.Code(err))
	assert.Contains(t, err.Error(), "tensor_ticket")
}

// TestTensorsOverMutualTLS: between workers that require mutual TLS and the
// cluster token, the producer's pushes go with its certificate and the
// token (PeerDialOptions, as troupe worker sets them); without them the
// consumer refuses them and the request fails, nothing reaching the talker.
func TestTensorsOverMutualTLS(t *testing.T) {
	ca := tlsconfigtest.NewCA(t, "troupe")
	files := ca.Issue(t, "worker")
	srvTLS, err := tlsconfig.Server(files)
	require.NoError(t, err)
	creds, err := tlsconfig.ClientCredentials(files)
	require.NoError(t, err)
	token := clusterauth.NewToken()
	peer := []grpc.DialOption{grpc.WithTransportCredentials(creds), clusterauth.DialOption(token)}
	ctx := testCtx(t)
	for _, tc := range []struct {
		name string
		peer []grpc.DialOption
		ok   bool
	}{
		{"certificate and token", peer, true},
		{"certificate, no token", peer[:1], false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			thinker := start(t, worker.Config{Stage: "thinker", Engine: &omnisim.Thinker{Width: hiddenWidth}, TLS: srvTLS, ClusterToken: token, PeerDialOptions: tc.peer})
			talker := start(t, worker.Config{Stage: "talker", Engine: &omnisim.Talker{}, TLS: srvTLS, ClusterToken: token})
			thinker.waitRegistered(t)
			talker.waitRegistered(t)
			cli := func(addr string) stagepb.StageServiceClient {
				return stagepb.NewStageServiceClient(dialWith(t, addr, creds))
			}
			tctx := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
			cctx, cancel := context.WithTimeout(tctx, wait)
			defer cancel()
			cons := consume(t, cctx, cli(talker.Advertise()), "ticket-1")
			prod := produce(t, cctx, cli(thinker.Advertise()), "say hello", &stagepb.TensorSink{Addr: talker.Advertise(), Ticket: "ticket-1"})
			_, perr := recvBidi(prod)
			if !tc.ok {
				assert.Equal(t, codes.Unauthenticated, status.Code(perr), "the producer fails at once: %v", perr)
				cancel() // as the head's errgroup ends the consumer once its producer failed
			}
			require.NoError(t, cons.CloseSend())
			spoken, cerr := recvBidi(cons)
			if tc.ok {
				require.NoError(t, perr)
				require.NoError(t, cerr)
				_, want := direct(t, "say hello", 16)
				assert.Equal(t, want, codesOf(spoken))
				return
			}
			assert.Empty(t, codesOf(spoken), "nothing reached the talker")
		})
	}
}
