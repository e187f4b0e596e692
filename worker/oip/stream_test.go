package oip_test

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"

	"github.com/troupe-serving/troupe/pkg/oippb"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/oip"
)

// serveWorker runs a worker (no etcd) in front of e, built once e is
// ready as troupe worker does, and returns a client of its StageService.
func serveWorker(t testing.TB, stage string, e *oip.Engine) stagepb.StageServiceClient {
	t.Helper()
	select {
	case <-e.Ready():
	case <-testCtx(t).Done():
		t.Fatal("engine never ready")
	}
	srv, err := worker.New(worker.Config{Stage: stage, Engine: e, Logger: quiet()})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	conn, err := grpc.NewClient(srv.Advertise(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	return stagepb.NewStageServiceClient(conn)
}

// wordCodes answers a segment with one code per word of its text (the
// word's length), in one final response.
func wordCodes(_ context.Context, req *oippb.ModelInferRequest, send func(*oippb.ModelStreamInferResponse) error) error {
	var vs []int32
	if _, raw := findInput(req, "text"); len(raw) >= 4 {
		for _, w := range strings.Fields(string(raw[4:])) {
			vs = append(vs, int32(len(w)))
		}
	}
	return send(respond(final(""), out{name: "codes", datatype: "INT32", shape: []int64{int64(len(vs))}, raw: int32Raw(vs...)}))
}

func seqParams(r *oippb.ModelInferRequest) (id string, start, end bool) {
	p := r.GetParameters()
	return p["sequence_id"].GetStringParam(), p["sequence_start"].GetBoolParam(), p["sequence_end"].GetBoolParam()
}

// TestFedSegments: a talker model with a context input continues its
// input, so a fed stage (GenerateStream) runs each segment as a request of
// its own, carrying the input before it as context and Triton's sequence
// parameters: the troupe request id, sequence_start on the first. A plain
// Generate carries none.
func TestFedSegments(t *testing.T) {
	te := &testEngine{meta: metadata(ins(tensor("text", "BYTES", 1), tensor("context", "BYTES", 1)), tensor("codes", "INT32")), infer: wordCodes}
	e := startEngine(t, "unix", te)
	h := e.Health()
	assert.Equal(t, stagepb.RoleCodes, h.GetRole())
	assert.Equal(t, stagepb.RoleText, h.GetInputRole())
	require.True(t, e.ContinuesInput(), "it declares context")
	cli := serveWorker(t, "talker", e)

	stream, err := cli.GenerateStream(testCtx(t))
	require.NoError(t, err)
	recv := func() *stagepb.GenerateChunk {
		t.Helper()
		c, err := stream.Recv()
		require.NoError(t, err)
		return c
	}
	// One segment at a time: each piece is two words, a whole segment.
	require.NoError(t, stream.Send(&stagepb.StreamInput{
		Request:      &stagepb.GenerateRequest{RequestId: "req-7", Input: &stagepb.GenerateRequest_Text{Text: "one two "}},
		SegmentUnits: 2,
	}))
	assert.Equal(t, []uint32{3, 3}, recv().GetCodes())
	require.NoError(t, stream.Send(&stagepb.StreamInput{Text: "three four "}))
	assert.Equal(t, []uint32{5, 4}, recv().GetCodes())
	require.NoError(t, stream.Send(&stagepb.StreamInput{Text: "sixteen"}))
	require.NoError(t, stream.CloseSend())
	var rest []*stagepb.GenerateChunk
	for {
		c, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err)
		rest = append(rest, c)
	}
	require.NotEmpty(t, rest)
	assert.Equal(t, []uint32{7}, rest[0].GetCodes())
	assert.Equal(t, stagepb.FinishReason_FINISH_REASON_STOP, rest[len(rest)-1].GetFinishReason())

	reqs := te.got()
	require.Len(t, reqs, 3)
	for i, want := range []struct{ text, context string }{{"one two ", ""}, {"three four ", "one two "}, {"sixteen", "one two three four "}} {
		assert.Equal(t, want.text, textOf(t, reqs[i], "text"), "segment %d", i)
		assert.Equal(t, want.context, textOf(t, reqs[i], "context"), "segment %d", i)
		id, start, end := seqParams(reqs[i])
		assert.Equal(t, "req-7", id, "segment %d", i)
		assert.Equal(t, i == 0, start, "sequence_start on the first segment only (segment %d)", i)
		assert.Equal(t, i == 2, end, "sequence_end on the last segment only (segment %d)", i)
	}

	// A plain Generate is no sequence.
	g, err := cli.Generate(testCtx(t), &stagepb.GenerateRequest{RequestId: "req-8", Input: &stagepb.GenerateRequest_Text{Text: "a bc"}})
	require.NoError(t, err)
	c, err := g.Recv()
	require.NoError(t, err)
	assert.Equal(t, []uint32{1, 2}, c.GetCodes())
	reqs = te.got()
	require.Len(t, reqs, 4)
	assert.NotContains(t, reqs[3].GetParameters(), "sequence_id")
	assert.NotContains(t, reqs[3].GetParameters(), "sequence_start")
}

// TestFedWhole: a model that does not continue its input runs a fed input
// as one segment once the input has ended: one request, the first and the
// last of its sequence.
func TestFedWhole(t *testing.T) {
	te := &testEngine{meta: textModel(), infer: echoWords("")}
	e := startEngine(t, "tcp", te)
	require.False(t, e.ContinuesInput())
	cli := serveWorker(t, "speech", e)
	stream, err := cli.GenerateStream(testCtx(t))
	require.NoError(t, err)
	require.NoError(t, stream.Send(&stagepb.StreamInput{
		Request: &stagepb.GenerateRequest{RequestId: "req-9", Input: &stagepb.GenerateRequest_Text{Text: "hello "}, Sampling: &stagepb.SamplingParams{Seed: proto.Int64(1)}},
	}))
	require.NoError(t, stream.Send(&stagepb.StreamInput{Text: "world"}))
	require.NoError(t, stream.CloseSend())
	text := ""
	for {
		c, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err)
		text += c.GetText()
	}
	assert.Equal(t, "hello world", text)
	reqs := te.got()
	require.Len(t, reqs, 1)
	assert.Equal(t, "hello world", textOf(t, reqs[0], "text"))
	id, start, end := seqParams(reqs[0])
	assert.Equal(t, "req-9", id)
	assert.True(t, start)
	assert.True(t, end)
	assert.True(t, proto.Equal(&oippb.InferParameter{ParameterChoice: &oippb.InferParameter_Int64Param{Int64Param: 1}}, reqs[0].GetParameters()["seed"]))
}
