package main

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/troupe-serving/troupe/membership/membershiptest"
	"github.com/troupe-serving/troupe/pkg/oippb"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// vocoderEngine is an OIP engine process for the CLI test: a model "voc"
// that takes codes and gives audio, each code one sample at 24 kHz.
type vocoderEngine struct {
	oippb.UnimplementedGRPCInferenceServiceServer
}

func (vocoderEngine) ServerReady(context.Context, *oippb.ServerReadyRequest) (*oippb.ServerReadyResponse, error) {
	return &oippb.ServerReadyResponse{Ready: true}, nil
}

func (vocoderEngine) ModelReady(_ context.Context, r *oippb.ModelReadyRequest) (*oippb.ModelReadyResponse, error) {
	return &oippb.ModelReadyResponse{Ready: r.GetName() == "voc"}, nil
}

func (vocoderEngine) ModelMetadata(context.Context, *oippb.ModelMetadataRequest) (*oippb.ModelMetadataResponse, error) {
	return &oippb.ModelMetadataResponse{Name: "voc",
		Inputs:  []*oippb.ModelMetadataResponse_TensorMetadata{{Name: "codes", Datatype: "INT32", Shape: []int64{-1}}},
		Outputs: []*oippb.ModelMetadataResponse_TensorMetadata{{Name: "audio", Datatype: "INT16", Shape: []int64{-1}}}}, nil
}

func (vocoderEngine) ModelStreamInfer(stream grpc.BidiStreamingServer[oippb.ModelInferRequest, oippb.ModelStreamInferResponse]) error {
	for {
		req, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		var pcm []byte
		for i, in := range req.GetInputs() {
			if in.GetName() != "codes" {
				continue
			}
			raw := req.GetRawInputContents()[i]
			for j := 0; j+4 <= len(raw); j += 4 {
				pcm = binary.LittleEndian.AppendUint16(pcm, uint16(binary.LittleEndian.Uint32(raw[j:])))
			}
		}
		if err := stream.Send(&oippb.ModelStreamInferResponse{InferResponse: &oippb.ModelInferResponse{
			ModelName:         "voc",
			Parameters:        map[string]*oippb.InferParameter{"triton_final_response": {ParameterChoice: &oippb.InferParameter_BoolParam{BoolParam: true}}},
			Outputs:           []*oippb.ModelInferResponse_InferOutputTensor{{Name: "audio", Datatype: "INT16", Shape: []int64{int64(len(pcm) / 2)}, Parameters: map[string]*oippb.InferParameter{"sample_rate": {ParameterChoice: &oippb.InferParameter_Int64Param{Int64Param: 24000}}}}},
			RawOutputContents: [][]byte{pcm},
		}}); err != nil {
			return err
		}
	}
}

// TestWorkerEngineOIP: the CLI wiring of --engine oip over a unix socket.
// The worker takes its roles from the model's metadata before it serves:
// it registers as codes → audio, and its gRPC port takes codes (a worker
// built before the metadata would take text) and answers the engine's
// audio.
func TestWorkerEngineOIP(t *testing.T) {
	dir, err := os.MkdirTemp("", "oip") // a short path: sockets have a limit of about 100 bytes
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "e.sock")
	lis, err := net.Listen("unix", sock)
	require.NoError(t, err)
	srv := grpc.NewServer()
	oippb.RegisterGRPCInferenceServiceServer(srv, vocoderEngine{})
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	t.Cleanup(func() { srv.Stop(); assert.NoError(t, <-served) })

	etcd := membershiptest.Start(t)
	w := background(t, "worker", runWorker, "--etcd-endpoints", strings.Join(etcd.Endpoints(), ","), "--stage", "vocoder",
		"--engine", "oip", "--upstream", "unix://"+sock, "--model", "voc", "--log-level", "error")
	line := w.wait(t, workRE)
	assert.Contains(t, line, "engine oip, role audio")
	addr := regexp.MustCompile(`addr (\S+) `).FindStringSubmatch(line)
	require.NotNil(t, addr, line)

	conn, err := grpc.NewClient(addr[1], grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer conn.Close()
	cli := stagepb.NewStageServiceClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	h, err := cli.Health(ctx, &stagepb.HealthRequest{})
	require.NoError(t, err)
	assert.Equal(t, "oip", h.GetEngine())
	assert.Equal(t, stagepb.RoleAudio, h.GetRole())
	assert.Equal(t, stagepb.RoleCodes, h.GetInputRole())
	stream, err := cli.Generate(ctx, &stagepb.GenerateRequest{RequestId: "r", Input: &stagepb.GenerateRequest_Codes{Codes: &stagepb.Codes{Codes: []uint32{1, 2}}}})
	require.NoError(t, err)
	c, err := stream.Recv()
	require.NoError(t, err)
	assert.Equal(t, []byte{1, 0, 2, 0}, c.GetAudioPcm16())
	assert.Equal(t, uint32(24000), c.GetSampleRate())
	assert.Equal(t, stagepb.FinishReason_FINISH_REASON_STOP, c.GetFinishReason())
}
