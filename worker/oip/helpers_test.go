package oip_test

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"

	"github.com/troupe-serving/troupe/pkg/oippb"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker/oip"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// wait bounds every wait on a condition; generous for a loaded machine.
const wait = 30 * time.Second

func testCtx(t testing.TB) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

// inferFunc answers one request of a ModelStreamInfer stream with any
// number of responses (a decoupled model), sent through send; ctx is the
// stream's. An error ends the stream with it.
type inferFunc func(ctx context.Context, req *oippb.ModelInferRequest, send func(*oippb.ModelStreamInferResponse) error) error

// testEngine is an OIP engine process written for the tests: the
// GRPCInferenceService over real gRPC, serving one model whose metadata
// the test gives and whose answers its infer writes. It records every
// request it gets.
type testEngine struct {
	oippb.UnimplementedGRPCInferenceServiceServer
	name string
	meta *oippb.ModelMetadataResponse

	mu          sync.Mutex
	infer       inferFunc
	serverReady bool
	modelReady  bool
	requests    []*oippb.ModelInferRequest
}

func (s *testEngine) ServerReady(context.Context, *oippb.ServerReadyRequest) (*oippb.ServerReadyResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return &oippb.ServerReadyResponse{Ready: s.serverReady}, nil
}

func (s *testEngine) ModelReady(_ context.Context, r *oippb.ModelReadyRequest) (*oippb.ModelReadyResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return &oippb.ModelReadyResponse{Ready: s.modelReady && r.GetName() == s.name}, nil
}

func (s *testEngine) ModelMetadata(_ context.Context, r *oippb.ModelMetadataRequest) (*oippb.ModelMetadataResponse, error) {
	return s.meta, nil
}

func (s *testEngine) ModelStreamInfer(stream grpc.BidiStreamingServer[oippb.ModelInferRequest, oippb.ModelStreamInferResponse]) error {
	for {
		req, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		s.mu.Lock()
		s.requests = append(s.requests, req)
		infer := s.infer
		s.mu.Unlock()
		if err := infer(stream.Context(), req, stream.Send); err != nil {
			return err
		}
	}
}

// setInfer changes how the engine answers, from its next request on.
func (s *testEngine) setInfer(f inferFunc) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.infer = f
}

func (s *testEngine) setReady(server, model bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.serverReady, s.modelReady = server, model
}

// got is every request the engine got so far.
func (s *testEngine) got() []*oippb.ModelInferRequest {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*oippb.ModelInferRequest(nil), s.requests...)
}

// serve serves te over network ("tcp": loopback; "unix": a socket) until
// the test ends, ready, and returns the address the worker dials.
func serve(t testing.TB, network string, te *testEngine) string {
	t.Helper()
	if te.name == "" {
		te.name = "m"
	}
	if te.meta.GetName() == "" {
		te.meta.Name = te.name
	}
	te.setReady(true, true)
	var lis net.Listener
	var addr string
	var err error
	switch network {
	case "unix":
		// A short path: a socket's path has a limit of about 100 bytes.
		dir, derr := os.MkdirTemp("", "oip")
		require.NoError(t, derr)
		t.Cleanup(func() { os.RemoveAll(dir) })
		path := filepath.Join(dir, "e.sock")
		lis, err = net.Listen("unix", path)
		addr = "unix://" + path
	default:
		lis, err = net.Listen("tcp", "127.0.0.1:0")
		if err == nil {
			addr = lis.Addr().String()
		}
	}
	require.NoError(t, err)
	srv := grpc.NewServer()
	oippb.RegisterGRPCInferenceServiceServer(srv, te)
	done := make(chan error, 1)
	go func() { done <- srv.Serve(lis) }()
	t.Cleanup(func() {
		srv.Stop()
		require.NoError(t, <-done)
	})
	return addr
}

// monitor is an engine's Run, owned by the test.
type monitor struct{ done chan error }

// runEngine builds an engine, runs it until the test ends (then closes
// it) and returns it with its Run.
func runEngine(t testing.TB, cfg oip.Config) (*oip.Engine, *monitor) {
	t.Helper()
	if cfg.Model == "" {
		cfg.Model = "m"
	}
	if cfg.Logger == nil {
		cfg.Logger = quiet()
	}
	e, err := oip.New(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	m := &monitor{done: make(chan error, 1)}
	go func() { m.done <- e.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-m.done:
		case <-time.After(wait):
			t.Error("engine monitor did not stop")
		}
		require.NoError(t, e.Close())
	})
	return e, m
}

// result waits for Run to return on its own.
func (m *monitor) result(t testing.TB) error {
	t.Helper()
	select {
	case err := <-m.done:
		m.done <- err // for the cleanup
		return err
	case <-time.After(wait):
		t.Fatal("engine monitor did not return")
		return nil
	}
}

// startEngine serves te, runs an engine in front of it and waits until it
// is available.
func startEngine(t testing.TB, network string, te *testEngine) *oip.Engine {
	t.Helper()
	e, _ := runEngine(t, oip.Config{Upstream: serve(t, network, te), Model: te.name})
	waitAvailable(t, e, true)
	return e
}

// waitAvailable waits until the engine's availability is want.
func waitAvailable(t testing.TB, e *oip.Engine, want bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	for {
		ok, changed := e.Available()
		if ok == want {
			return
		}
		select {
		case <-changed:
		case <-ctx.Done():
			t.Fatalf("engine never became available=%v", want)
		}
	}
}

// collect runs one request and returns its chunks.
func collect(ctx context.Context, e *oip.Engine, req *stagepb.GenerateRequest) ([]*stagepb.GenerateChunk, error) {
	var chunks []*stagepb.GenerateChunk
	err := e.Generate(ctx, req, func(c *stagepb.GenerateChunk) error {
		chunks = append(chunks, c)
		return nil
	})
	return chunks, err
}

func joinText(chunks []*stagepb.GenerateChunk) string {
	s := ""
	for _, c := range chunks {
		s += c.GetText()
	}
	return s
}

func textReq(text string) *stagepb.GenerateRequest {
	return &stagepb.GenerateRequest{RequestId: "r1", Input: &stagepb.GenerateRequest_Text{Text: text}}
}

// The model's metadata.

type tm = *oippb.ModelMetadataResponse_TensorMetadata

func tensor(name, datatype string, shape ...int64) tm {
	if len(shape) == 0 {
		shape = []int64{-1}
	}
	return &oippb.ModelMetadataResponse_TensorMetadata{Name: name, Datatype: datatype, Shape: shape}
}

func metadata(inputs []tm, outputs ...tm) *oippb.ModelMetadataResponse {
	return &oippb.ModelMetadataResponse{Platform: "python", Inputs: inputs, Outputs: outputs}
}

func ins(ts ...tm) []tm { return ts }

// Wire forms, written here from the protocol, not with the package's code.

// bytesRaw is a BYTES tensor's raw contents: each element a 4-byte
// little-endian length, then its bytes.
func bytesRaw(elems ...string) []byte {
	var out []byte
	for _, e := range elems {
		out = binary.LittleEndian.AppendUint32(out, uint32(len(e)))
		out = append(out, e...)
	}
	return out
}

// input finds a request's input by name, with its raw contents.
func input(t testing.TB, req *oippb.ModelInferRequest, name string) (*oippb.ModelInferRequest_InferInputTensor, []byte) {
	t.Helper()
	require.Len(t, req.GetRawInputContents(), len(req.GetInputs()), "raw contents, one per input")
	in, raw := findInput(req, name)
	require.NotNil(t, in, "request has no input %q", name)
	return in, raw
}

// findInput is input for the engine's side, which must not fail a test
// from its goroutine: nil when absent.
func findInput(req *oippb.ModelInferRequest, name string) (*oippb.ModelInferRequest_InferInputTensor, []byte) {
	for i, in := range req.GetInputs() {
		if in.GetName() == name && i < len(req.GetRawInputContents()) {
			return in, req.GetRawInputContents()[i]
		}
	}
	return nil, nil
}

// textOf reads a [1] BYTES input, checking its encoding.
func textOf(t testing.TB, req *oippb.ModelInferRequest, name string) string {
	t.Helper()
	in, raw := input(t, req, name)
	require.Equal(t, "BYTES", in.GetDatatype())
	require.Equal(t, []int64{1}, in.GetShape())
	require.GreaterOrEqual(t, len(raw), 4)
	n := binary.LittleEndian.Uint32(raw)
	require.Equal(t, int(n), len(raw)-4, "one element: its length prefix covers the rest")
	return string(raw[4:])
}

func names(req *oippb.ModelInferRequest) []string {
	var out []string
	for _, in := range req.GetInputs() {
		out = append(out, in.GetName())
	}
	return out
}

// out is one output tensor of a response: raw contents, or typed ones.
type out struct {
	name, datatype string
	shape          []int64
	raw            []byte
	contents       *oippb.InferTensorContents
	params         map[string]*oippb.InferParameter
}

// respond is a response with outputs (raw contents when every output has
// them) and parameters.
func respond(params map[string]*oippb.InferParameter, outs ...out) *oippb.ModelStreamInferResponse {
	r := &oippb.ModelInferResponse{ModelName: "m", Parameters: params}
	raw := len(outs) > 0
	for _, o := range outs {
		raw = raw && o.raw != nil
	}
	for _, o := range outs {
		t := &oippb.ModelInferResponse_InferOutputTensor{Name: o.name, Datatype: o.datatype, Shape: o.shape, Parameters: o.params}
		if raw {
			r.RawOutputContents = append(r.RawOutputContents, o.raw)
		} else {
			t.Contents = o.contents
		}
		r.Outputs = append(r.Outputs, t)
	}
	return &oippb.ModelStreamInferResponse{InferResponse: r}
}

func textOut(s string) out {
	return out{name: "text", datatype: "BYTES", shape: []int64{1}, raw: bytesRaw(s)}
}

// more marks a response that is not the last; final the last, with its
// finish reason ("" for none).
func more() map[string]*oippb.InferParameter {
	return map[string]*oippb.InferParameter{"triton_final_response": boolP(false)}
}

func final(finish string) map[string]*oippb.InferParameter {
	p := map[string]*oippb.InferParameter{"triton_final_response": boolP(true)}
	if finish != "" {
		p["finish_reason"] = stringP(finish)
	}
	return p
}

func boolP(v bool) *oippb.InferParameter {
	return &oippb.InferParameter{ParameterChoice: &oippb.InferParameter_BoolParam{BoolParam: v}}
}

func stringP(v string) *oippb.InferParameter {
	return &oippb.InferParameter{ParameterChoice: &oippb.InferParameter_StringParam{StringParam: v}}
}

func int64P(v int64) *oippb.InferParameter {
	return &oippb.InferParameter{ParameterChoice: &oippb.InferParameter_Int64Param{Int64Param: v}}
}

func doubleP(v float64) *oippb.InferParameter {
	return &oippb.InferParameter{ParameterChoice: &oippb.InferParameter_DoubleParam{DoubleParam: v}}
}

func int32Raw(vs ...int32) []byte {
	var out []byte
	for _, v := range vs {
		out = binary.LittleEndian.AppendUint32(out, uint32(v))
	}
	return out
}
