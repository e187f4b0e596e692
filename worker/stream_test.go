package worker_test

import (
	"errors"
	"io"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/sim"
)

// streamed sends msgs on GenerateStream (the first carries the request),
// closes the input and collects the output.
func streamed(t *testing.T, cli stagepb.StageServiceClient, msgs ...*stagepb.StreamInput) ([]*stagepb.GenerateChunk, error) {
	t.Helper()
	stream, err := cli.GenerateStream(testCtx(t))
	require.NoError(t, err)
	for _, m := range msgs {
		require.NoError(t, stream.Send(m))
	}
	require.NoError(t, stream.CloseSend())
	return recvBidi(stream)
}

func recvBidi(stream grpc.BidiStreamingClient[stagepb.StreamInput, stagepb.GenerateChunk]) ([]*stagepb.GenerateChunk, error) {
	var out []*stagepb.GenerateChunk
	for {
		c, err := stream.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				return out, nil
			}
			return out, err
		}
		out = append(out, c)
	}
}

func startSim(t *testing.T, stage string) stagepb.StageServiceClient {
	t.Helper()
	r := start(t, worker.Config{Stage: stage, Engine: newSim(t, sim.Config{Role: sim.RoleForStage(stage)})})
	r.waitRegistered(t)
	return dial(t, r.Advertise())
}

// TestStreamedTalkerEqualsWhole: a talker fed its text in pieces, cut in
// the middle of words, with segments of 2 words, makes exactly the codes it
// makes for the whole text at once; only the last chunk finishes.
func TestStreamedTalkerEqualsWhole(t *testing.T) {
	cli := startSim(t, "talker")
	const text = "the quick brown fox jumps over the lazy dog. and then it sleeps under an old tree"
	var msgs []*stagepb.StreamInput
	seed := proto.Int64(5)
	msgs = append(msgs, &stagepb.StreamInput{
		Request:      &stagepb.GenerateRequest{RequestId: "t", Input: &stagepb.GenerateRequest_Text{Text: text[:3]}, Sampling: &stagepb.SamplingParams{Seed: seed}},
		SegmentUnits: 2,
	})
	for i := 3; i < len(text); i += 5 {
		msgs = append(msgs, &stagepb.StreamInput{Text: text[i:min(i+5, len(text))]})
	}
	chunks, err := streamed(t, cli, msgs...)
	require.NoError(t, err)
	want, finish := sim.ExpectedCodes(text, 5, 0)
	var got []uint32
	for i, c := range chunks {
		got = append(got, c.GetCodes()...)
		if i < len(chunks)-1 {
			assert.Equal(t, stagepb.FinishReason_FINISH_REASON_UNSPECIFIED, c.GetFinishReason(), "chunk %d finishes early", i)
		}
	}
	assert.Equal(t, want, got)
	assert.Equal(t, finish, chunks[len(chunks)-1].GetFinishReason())
	assert.NotNil(t, chunks[len(chunks)-1].GetTimings())
}

// TestStreamedVocoderEqualsWhole: codes in pieces give the samples of the
// whole.
func TestStreamedVocoderEqualsWhole(t *testing.T) {
	cli := startSim(t, "vocoder")
	codesIn := []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}
	chunks, err := streamed(t, cli,
		&stagepb.StreamInput{Request: &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Codes{Codes: &stagepb.Codes{Codes: codesIn[:4]}}}, SegmentUnits: 3},
		&stagepb.StreamInput{Codes: codesIn[4:9]},
		&stagepb.StreamInput{Codes: codesIn[9:]},
	)
	require.NoError(t, err)
	var pcm []byte
	for _, c := range chunks {
		pcm = append(pcm, c.GetAudioPcm16()...)
	}
	assert.Equal(t, sim.ExpectedAudio(codesIn), pcm)
	assert.Equal(t, stagepb.FinishReason_FINISH_REASON_STOP, chunks[len(chunks)-1].GetFinishReason())
}

// TestStreamedTextStageWaitsForWholeInput: a text-role engine needs its
// whole prompt, so it runs once, on all of it.
func TestStreamedTextStageWaitsForWholeInput(t *testing.T) {
	cli := startSim(t, "thinker")
	chunks, err := streamed(t, cli,
		&stagepb.StreamInput{Request: &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Text{Text: "one two "}, Sampling: &stagepb.SamplingParams{Seed: proto.Int64(1)}}, SegmentUnits: 1},
		&stagepb.StreamInput{Text: "three four"},
	)
	require.NoError(t, err)
	want, _, _ := sim.ExpectedText("one two three four", 1, 0)
	assert.Equal(t, want, joinText(chunks))
}

// TestStreamedLimitCutsAcrossSegments: max_tokens bounds the whole request,
// not each segment, and the request says it was cut.
func TestStreamedLimitCutsAcrossSegments(t *testing.T) {
	cli := startSim(t, "talker")
	chunks, err := streamed(t, cli,
		&stagepb.StreamInput{Request: &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Text{Text: "a b c d e f g h i j k l"}, Sampling: &stagepb.SamplingParams{MaxTokens: 7}}, SegmentUnits: 2},
	)
	require.NoError(t, err)
	var got []uint32
	for _, c := range chunks {
		got = append(got, c.GetCodes()...)
	}
	want, _ := sim.ExpectedCodes("a b c d e f g h i j k l", 0, 0)
	assert.Equal(t, want[:7], got)
	assert.Equal(t, stagepb.FinishReason_FINISH_REASON_LENGTH, chunks[len(chunks)-1].GetFinishReason())
}

func TestStreamedBadInput(t *testing.T) {
	cli := startSim(t, "vocoder")
	_, err := streamed(t, cli, &stagepb.StreamInput{Codes: []uint32{1}})
	assert.Equal(t, codes.InvalidArgument, status.Code(err), "no request in the first message: %v", err)
	_, err = streamed(t, cli, &stagepb.StreamInput{Request: &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Text{Text: "x"}}})
	assert.Equal(t, codes.InvalidArgument, status.Code(err), "text into a vocoder: %v", err)
	_, err = streamed(t, cli, &stagepb.StreamInput{Request: &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Codes{Codes: &stagepb.Codes{Codes: []uint32{1}}}}}, &stagepb.StreamInput{Codes: []uint32{sim.CodebookSize}})
	assert.Equal(t, codes.InvalidArgument, status.Code(err), "a code out of range: %v", err)
}

// TestStreamedTalkerStartsBeforeInputEnds: output comes while the input is
// still open, from the first complete segment.
func TestStreamedTalkerStartsBeforeInputEnds(t *testing.T) {
	cli := startSim(t, "talker")
	stream, err := cli.GenerateStream(testCtx(t))
	require.NoError(t, err)
	require.NoError(t, stream.Send(&stagepb.StreamInput{
		Request:      &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Text{Text: "one two three "}},
		SegmentUnits: 2,
	}))
	first, err := stream.Recv() // the input is still open
	require.NoError(t, err)
	assert.NotEmpty(t, first.GetCodes(), "codes for the first segment before the input ended")
	require.NoError(t, stream.Send(&stagepb.StreamInput{Text: "four five"}))
	require.NoError(t, stream.CloseSend())
	rest, err := recvBidi(stream)
	require.NoError(t, err)
	got := first.GetCodes()
	for _, c := range rest {
		got = append(got, c.GetCodes()...)
	}
	want, _ := sim.ExpectedCodes("one two three four five", 0, 0)
	assert.Equal(t, want, got)
}
