package oip_test

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/troupe-serving/troupe/pkg/oippb"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/oip"
)

// The engine is a worker engine, and says so at compile time.
var (
	_ worker.Engine       = (*oip.Engine)(nil)
	_ worker.Availability = (*oip.Engine)(nil)
	_ worker.Continuer    = (*oip.Engine)(nil)
)

// echoWords answers with one response per word of the request's text
// input (each a [1] BYTES text output, raw), then a final response with
// no output and the finish reason.
func echoWords(finish string) inferFunc {
	return func(_ context.Context, req *oippb.ModelInferRequest, send func(*oippb.ModelStreamInferResponse) error) error {
		in := ""
		if _, raw := findInput(req, "text"); len(raw) >= 4 {
			in = string(raw[4:])
		}
		for _, w := range strings.SplitAfter(in, " ") {
			if err := send(respond(more(), textOut(w))); err != nil {
				return err
			}
		}
		return send(respond(final(finish)))
	}
}

func textModel() *oippb.ModelMetadataResponse {
	return metadata(ins(tensor("text", "BYTES", 1)), tensor("text", "BYTES", 1))
}

// TestTextInOut: a text request is one ModelInferRequest on its own
// stream, over loopback TCP and over a unix socket: the text as a [1]
// BYTES input in raw contents (a 4-byte little-endian length, then the
// UTF-8), no parameters when the client set none. Each response is one
// chunk of one token; the final one finishes with stop and timings.
func TestTextInOut(t *testing.T) {
	for _, network := range []string{"tcp", "unix"} {
		t.Run(network, func(t *testing.T) {
			te := &testEngine{meta: textModel(), infer: echoWords("")}
			e := startEngine(t, network, te)
			h := e.Health()
			assert.Equal(t, stagepb.ServingStatus_SERVING_STATUS_SERVING, h.GetStatus())
			assert.Equal(t, "oip", h.GetEngine())
			assert.Equal(t, stagepb.RoleText, h.GetRole())
			assert.Equal(t, stagepb.RoleText, h.GetInputRole())
			assert.Empty(t, h.GetOutputTensors())
			assert.False(t, e.ContinuesInput(), "text in, no context: the whole input at once")

			chunks, err := collect(testCtx(t), e, textReq("the quick brown fox"))
			require.NoError(t, err)
			require.Len(t, chunks, 5, "four words and the final response")
			assert.Equal(t, "the quick brown fox", joinText(chunks))
			for _, c := range chunks[:4] {
				assert.Equal(t, uint64(1), c.GetStats().GetGenerationTokens(), "one token per response with text")
				assert.Equal(t, stagepb.FinishReason_FINISH_REASON_UNSPECIFIED, c.GetFinishReason())
				assert.Nil(t, c.GetTimings())
			}
			last := chunks[4]
			assert.Equal(t, stagepb.FinishReason_FINISH_REASON_STOP, last.GetFinishReason())
			assert.Zero(t, last.GetStats().GetGenerationTokens())
			require.NotNil(t, last.GetTimings())
			assert.GreaterOrEqual(t, last.GetTimings().GetDecodeSeconds(), 0.0)

			reqs := te.got()
			require.Len(t, reqs, 1)
			r := reqs[0]
			assert.Equal(t, "m", r.GetModelName())
			assert.Equal(t, "r1", r.GetId())
			assert.Equal(t, map[string]*oippb.InferParameter{oip.ParamEnableEmptyFinal: boolP(true)}, r.GetParameters(),
				"nothing the client did not set; Triton's final flag asked for")
			assert.Equal(t, []string{"text"}, names(r))
			_, raw := input(t, r, "text")
			assert.Equal(t, append([]byte{19, 0, 0, 0}, "the quick brown fox"...), raw, "BYTES: a 4-byte little-endian length, then the bytes")
			assert.Nil(t, r.GetInputs()[0].GetContents(), "raw contents, not typed ones")
		})
	}
}

// TestChatInput: a chat goes as the messages tensor's JSON to a model that
// declares messages, and as role: content lines to one that declares only
// text.
func TestChatInput(t *testing.T) {
	chat := &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Chat{Chat: &stagepb.Chat{Messages: []*stagepb.ChatMessage{
		{Role: "system", Content: "be brief"}, {Role: "user", Content: `a <b> & "c"`},
	}}}}
	reply := func(_ context.Context, _ *oippb.ModelInferRequest, send func(*oippb.ModelStreamInferResponse) error) error {
		return send(respond(final("stop"), textOut("ok")))
	}

	te := &testEngine{meta: metadata(ins(tensor("messages", "BYTES", 1), tensor("text", "BYTES", 1)), tensor("text", "BYTES", 1)), infer: reply}
	e := startEngine(t, "tcp", te)
	chunks, err := collect(testCtx(t), e, chat)
	require.NoError(t, err)
	assert.Equal(t, "ok", joinText(chunks))
	r := te.got()[0]
	assert.Equal(t, []string{"messages"}, names(r), "a chat is messages only")
	msgs := textOf(t, r, "messages")
	assert.Equal(t, `[{"role":"system","content":"be brief"},{"role":"user","content":"a <b> & \"c\""}]`, msgs)
	var decoded []map[string]string
	require.NoError(t, json.Unmarshal([]byte(msgs), &decoded))
	assert.Equal(t, `a <b> & "c"`, decoded[1]["content"])

	te = &testEngine{meta: textModel(), infer: reply}
	e = startEngine(t, "tcp", te)
	_, err = collect(testCtx(t), e, chat)
	require.NoError(t, err)
	assert.Equal(t, "system: be brief\nuser: a <b> & \"c\"", textOf(t, te.got()[0], "text"))

	// Text to a model that takes only messages: one user message.
	te = &testEngine{meta: metadata(ins(tensor("messages", "BYTES", 1)), tensor("text", "BYTES", 1)), infer: reply}
	e = startEngine(t, "tcp", te)
	_, err = collect(testCtx(t), e, textReq("hi"))
	require.NoError(t, err)
	assert.Equal(t, `[{"role":"user","content":"hi"}]`, textOf(t, te.got()[0], "messages"))
}

// TestRequestParameters: every sampling parameter the client set goes as
// the mapping's parameter, with its type; a float arrives as the decimal
// the client wrote.
func TestRequestParameters(t *testing.T) {
	te := &testEngine{meta: textModel(), infer: echoWords("")}
	e := startEngine(t, "tcp", te)
	req := textReq("hi")
	req.Sampling = &stagepb.SamplingParams{
		MaxTokens: 7, TopK: proto.Int32(40), Seed: proto.Int64(-3), MinTokens: 2,
		Temperature: proto.Float32(0.7), TopP: proto.Float32(0.9), MinP: proto.Float32(0.05),
		FrequencyPenalty: proto.Float32(0.5), PresencePenalty: proto.Float32(-0.5), RepetitionPenalty: proto.Float32(1.1),
		Stop: []string{"\n", "END"}, IgnoreEos: true,
		LogitBias: map[string]float32{"5": 1}, // not in the mapping: not sent
	}
	req.Voice, req.Language, req.Continuation = "alloy", "en", "so far"
	_, err := collect(testCtx(t), e, req)
	require.NoError(t, err)
	want := map[string]*oippb.InferParameter{
		"max_tokens": int64P(7), "top_k": int64P(40), "seed": int64P(-3), "min_tokens": int64P(2),
		"temperature": doubleP(0.7), "top_p": doubleP(0.9), "min_p": doubleP(0.05),
		"frequency_penalty": doubleP(0.5), "presence_penalty": doubleP(-0.5), "repetition_penalty": doubleP(1.1),
		"stop": stringP(`["\n","END"]`), "ignore_eos": boolP(true),
		"voice": stringP("alloy"), "language": stringP("en"), "continuation": stringP("so far"),
		oip.ParamEnableEmptyFinal: boolP(true),
	}
	got := te.got()[0].GetParameters()
	require.Len(t, got, len(want))
	for k, v := range want {
		assert.True(t, proto.Equal(v, got[k]), "%s: got %v, want %v", k, got[k], v)
	}
}

// TestFinishReason: the final response's finish_reason, stop when absent;
// a response without triton_final_response is the last (a model that is
// not decoupled).
func TestFinishReason(t *testing.T) {
	for _, tc := range []struct {
		name   string
		params map[string]*oippb.InferParameter
		want   stagepb.FinishReason
	}{
		{"length", final("length"), stagepb.FinishReason_FINISH_REASON_LENGTH},
		{"stop", final("stop"), stagepb.FinishReason_FINISH_REASON_STOP},
		{"absent", final(""), stagepb.FinishReason_FINISH_REASON_STOP},
		{"not decoupled", nil, stagepb.FinishReason_FINISH_REASON_STOP},
		{"not decoupled, length", map[string]*oippb.InferParameter{"finish_reason": stringP("length")}, stagepb.FinishReason_FINISH_REASON_LENGTH},
	} {
		t.Run(tc.name, func(t *testing.T) {
			te := &testEngine{meta: textModel(), infer: func(_ context.Context, _ *oippb.ModelInferRequest, send func(*oippb.ModelStreamInferResponse) error) error {
				if err := send(respond(tc.params, textOut("all of it"))); err != nil {
					return err
				}
				// Never read: the first response was the last.
				return send(respond(final("length"), textOut(" and more")))
			}}
			e := startEngine(t, "tcp", te)
			chunks, err := collect(testCtx(t), e, textReq("x"))
			require.NoError(t, err)
			require.Len(t, chunks, 1)
			assert.Equal(t, "all of it", chunks[0].GetText())
			assert.Equal(t, tc.want, chunks[0].GetFinishReason())
			assert.Equal(t, uint64(1), chunks[0].GetStats().GetGenerationTokens())
		})
	}
}

// TestTokenIDs: token ids in (INT32) and out: a response's token ids are
// its token count.
func TestTokenIDs(t *testing.T) {
	te := &testEngine{meta: metadata(ins(tensor("token_ids", "INT32")), tensor("text", "BYTES", 1), tensor("token_ids", "INT32")),
		infer: func(_ context.Context, _ *oippb.ModelInferRequest, send func(*oippb.ModelStreamInferResponse) error) error {
			if err := send(respond(more(), textOut("ab"), out{name: "token_ids", datatype: "INT32", shape: []int64{3}, raw: int32Raw(7, 8, 9)})); err != nil {
				return err
			}
			// Typed contents this time.
			return send(respond(final("length"),
				out{name: "text", datatype: "BYTES", shape: []int64{1}, contents: &oippb.InferTensorContents{BytesContents: [][]byte{[]byte("c")}}},
				out{name: "token_ids", datatype: "INT32", shape: []int64{1}, contents: &oippb.InferTensorContents{IntContents: []int32{10}}}))
		}}
	e := startEngine(t, "tcp", te)
	chunks, err := collect(testCtx(t), e, &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_TokenIds{TokenIds: &stagepb.TokenIds{Ids: []uint32{1, 2, 300000}}}})
	require.NoError(t, err)
	require.Len(t, chunks, 2)
	assert.Equal(t, []uint32{7, 8, 9}, chunks[0].GetTokenIds())
	assert.Equal(t, uint64(3), chunks[0].GetStats().GetGenerationTokens(), "len(token_ids)")
	assert.Equal(t, []uint32{10}, chunks[1].GetTokenIds())
	assert.Equal(t, uint64(1), chunks[1].GetStats().GetGenerationTokens())
	assert.Equal(t, "abc", joinText(chunks))
	assert.Equal(t, stagepb.FinishReason_FINISH_REASON_LENGTH, chunks[1].GetFinishReason())

	in, raw := input(t, te.got()[0], "token_ids")
	assert.Equal(t, "INT32", in.GetDatatype())
	assert.Equal(t, []int64{3}, in.GetShape())
	assert.Equal(t, int32Raw(1, 2, 300000), raw)

	// A text request to this model has nowhere to go.
	_, err = collect(testCtx(t), e, textReq("hi"))
	require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
	assert.Contains(t, err.Error(), "takes no text input")
}

// TestTensorsRoundTrip: named tensors go to the model as they are (FP16
// raw, byte for byte) and come back on chunks, from raw and typed
// contents; the model's metadata makes the stage take tensors and lists
// them.
func TestTensorsRoundTrip(t *testing.T) {
	hidden := &stagepb.Tensor{Name: "hidden", Dtype: stagepb.DType_DTYPE_FLOAT16, Shape: []int64{2, 3},
		Data: []byte{0x00, 0x3c, 0x00, 0xc0, 0xff, 0x7b, 0x01, 0x00, 0x00, 0x80, 0x55, 0x35}} // 1, -2, 65504, a subnormal, -0, 0.333
	te := &testEngine{
		meta: metadata(ins(tensor("text", "BYTES", 1), tensor("hidden", "FP16", -1, 3)),
			tensor("text", "BYTES", 1), tensor("hidden", "FP16", -1, 3), tensor("embedding", "FP32", 2),
			tensor("ids", "INT64", 2), tensor("mask", "UINT8", 2), tensor("flags", "BOOL", 1)),
		infer: func(_ context.Context, req *oippb.ModelInferRequest, send func(*oippb.ModelStreamInferResponse) error) error {
			in, raw := findInput(req, "hidden")
			// The same tensor back, raw; then the typed forms.
			if err := send(respond(more(), out{name: "hidden", datatype: in.GetDatatype(), shape: in.GetShape(), raw: raw})); err != nil {
				return err
			}
			return send(respond(final(""),
				out{name: "embedding", datatype: "FP32", shape: []int64{2}, contents: &oippb.InferTensorContents{Fp32Contents: []float32{1.5, -2}}},
				out{name: "ids", datatype: "INT64", shape: []int64{2}, contents: &oippb.InferTensorContents{Int64Contents: []int64{-1, 1 << 40}}},
				out{name: "mask", datatype: "UINT8", shape: []int64{2}, contents: &oippb.InferTensorContents{UintContents: []uint32{0, 255}}},
				out{name: "flags", datatype: "BOOL", shape: []int64{1}, contents: &oippb.InferTensorContents{BoolContents: []bool{true}}}))
		}}
	e := startEngine(t, "unix", te)
	h := e.Health()
	assert.Equal(t, stagepb.RoleTensors, h.GetInputRole())
	assert.Equal(t, []string{"hidden"}, h.GetInputTensors())
	assert.Equal(t, stagepb.RoleText, h.GetRole())
	assert.Equal(t, []string{"hidden", "embedding", "ids", "mask"}, h.GetOutputTensors(), "not flags: BOOL is not carried")
	assert.True(t, e.ContinuesInput(), "a tensor-input model runs in segments")

	req := textReq("")
	req.Tensors = []*stagepb.Tensor{hidden}
	chunks, err := collect(testCtx(t), e, req)
	require.NoError(t, err)
	require.Len(t, chunks, 2)
	require.Len(t, chunks[0].GetTensors(), 1)
	got := chunks[0].GetTensors()[0]
	assert.Equal(t, "hidden", got.GetName())
	assert.Equal(t, stagepb.DType_DTYPE_FLOAT16, got.GetDtype())
	assert.Equal(t, []int64{2, 3}, got.GetShape())
	assert.Equal(t, hidden.GetData(), got.GetData(), "byte-exact")
	assert.Zero(t, chunks[0].GetStats().GetGenerationTokens(), "tensors are not tokens")

	typed := chunks[1].GetTensors()
	require.Len(t, typed, 3, "flags dropped")
	f32 := make([]byte, 8)
	binary.LittleEndian.PutUint32(f32, math.Float32bits(1.5))
	binary.LittleEndian.PutUint32(f32[4:], math.Float32bits(-2))
	assert.Equal(t, &stagepb.Tensor{Name: "embedding", Dtype: stagepb.DType_DTYPE_FLOAT32, Shape: []int64{2}, Data: f32}, typed[0])
	i64 := binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint64(nil, math.MaxUint64), 1<<40)
	assert.Equal(t, &stagepb.Tensor{Name: "ids", Dtype: stagepb.DType_DTYPE_INT64, Shape: []int64{2}, Data: i64}, typed[1])
	assert.Equal(t, &stagepb.Tensor{Name: "mask", Dtype: stagepb.DType_DTYPE_UINT8, Shape: []int64{2}, Data: []byte{0, 255}}, typed[2])

	r := te.got()[0]
	assert.Equal(t, []string{"text", "hidden"}, names(r))
	in, raw := input(t, r, "hidden")
	assert.Equal(t, "FP16", in.GetDatatype())
	assert.Equal(t, []int64{2, 3}, in.GetShape())
	assert.Equal(t, hidden.GetData(), raw)
}

// TestSizeValidation: a tensor whose data does not fill its shape exactly,
// or that the model cannot take, is refused (InvalidArgument) before
// anything reaches the engine; one the engine sends back wrong fails the
// request (Internal), as do malformed BYTES.
func TestSizeValidation(t *testing.T) {
	te := &testEngine{
		meta:  metadata(ins(tensor("text", "BYTES", 1), tensor("hidden", "FP16", -1, 3)), tensor("text", "BYTES", 1), tensor("hidden", "FP16", -1, 3)),
		infer: echoWords("")}
	e := startEngine(t, "tcp", te)
	for _, tc := range []struct {
		name   string
		tensor *stagepb.Tensor
		want   string
	}{
		{"short", &stagepb.Tensor{Name: "hidden", Dtype: stagepb.DType_DTYPE_FLOAT16, Shape: []int64{2, 3}, Data: make([]byte, 10)}, `tensor "hidden": 10 bytes of data, want 12 (shape [2 3] of FP16, 2 bytes each)`},
		{"long", &stagepb.Tensor{Name: "hidden", Dtype: stagepb.DType_DTYPE_FLOAT16, Shape: []int64{2, 3}, Data: make([]byte, 14)}, "14 bytes of data, want 12"},
		{"negative", &stagepb.Tensor{Name: "hidden", Dtype: stagepb.DType_DTYPE_FLOAT16, Shape: []int64{-2, 3}}, "negative dimension"},
		{"huge", &stagepb.Tensor{Name: "hidden", Dtype: stagepb.DType_DTYPE_FLOAT16, Shape: []int64{1 << 30, 1 << 30, 1 << 30}}, "more than"},
		{"no dtype", &stagepb.Tensor{Name: "hidden", Shape: []int64{1}, Data: []byte{0, 0}}, "DTYPE_UNSPECIFIED is not one troupe carries"},
		{"other dtype", &stagepb.Tensor{Name: "hidden", Dtype: stagepb.DType_DTYPE_FLOAT32, Shape: []int64{1, 3}, Data: make([]byte, 12)}, `tensor "hidden" is FP32; the model takes FP16`},
		{"undeclared", &stagepb.Tensor{Name: "nope", Dtype: stagepb.DType_DTYPE_UINT8, Shape: []int64{1}, Data: []byte{1}}, `tensor "nope": the model declares no such input`},
		{"a mapping name", &stagepb.Tensor{Name: "codes", Dtype: stagepb.DType_DTYPE_INT32, Shape: []int64{1}, Data: make([]byte, 4)}, "the mapping's own input"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := textReq("")
			req.Tensors = []*stagepb.Tensor{tc.tensor}
			_, err := collect(testCtx(t), e, req)
			require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
			assert.Contains(t, status.Convert(err).Message(), tc.want)
			assert.True(t, strings.HasPrefix(status.Convert(err).Message(), "oip: model m: "), status.Convert(err).Message())
		})
	}
	assert.Empty(t, te.got(), "nothing refused reached the engine")

	for _, tc := range []struct {
		name string
		resp *oippb.ModelStreamInferResponse
		want string
	}{
		{"short output", respond(final(""), out{name: "hidden", datatype: "FP16", shape: []int64{2, 3}, raw: make([]byte, 6)}), `output "hidden": 6 bytes of data, want 12`},
		{"malformed BYTES", respond(final(""), out{name: "text", datatype: "BYTES", shape: []int64{1}, raw: []byte{9, 0, 0, 0, 'a'}}), "malformed BYTES contents: element 0: length prefix 9 at offset 0, but 1 bytes follow"},
		{"BYTES count", respond(final(""), out{name: "text", datatype: "BYTES", shape: []int64{2}, raw: bytesRaw("a")}), "1 elements, the shape says 2"},
		{"wrong type", respond(final(""), out{name: "text", datatype: "INT32", shape: []int64{1}, raw: int32Raw(1)}), `output "text" is INT32, want BYTES`},
		{"negative id", respond(final(""), out{name: "token_ids", datatype: "INT32", shape: []int64{1}, raw: int32Raw(-1)}), "negative"},
		{"FP16 typed", respond(final(""), out{name: "hidden", datatype: "FP16", shape: []int64{1}, contents: &oippb.InferTensorContents{Fp32Contents: []float32{1}}}), "FP16 travels only as raw contents"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			te.setInfer(func(_ context.Context, _ *oippb.ModelInferRequest, send func(*oippb.ModelStreamInferResponse) error) error {
				return send(tc.resp)
			})
			_, err := collect(testCtx(t), e, textReq("x"))
			require.Equal(t, codes.Internal, status.Code(err), "%v", err)
			assert.Contains(t, status.Convert(err).Message(), tc.want)
		})
	}
}

// TestTextAcrossResponses: BYTES elements of a response are its text, in
// order; a UTF-8 character cut between two responses reaches the client
// whole, in the later chunk.
func TestTextAcrossResponses(t *testing.T) {
	te := &testEngine{meta: textModel(), infer: func(_ context.Context, _ *oippb.ModelInferRequest, send func(*oippb.ModelStreamInferResponse) error) error {
		for _, r := range []*oippb.ModelStreamInferResponse{
			respond(more(), out{name: "text", datatype: "BYTES", shape: []int64{2}, raw: bytesRaw("caf", "\xc3")}),
			respond(more(), textOut("\xa9 ok")),
			respond(final(""), textOut("\xff")),
		} {
			if err := send(r); err != nil {
				return err
			}
		}
		return nil
	}}
	e := startEngine(t, "tcp", te)
	chunks, err := collect(testCtx(t), e, textReq("x"))
	require.NoError(t, err)
	require.Len(t, chunks, 3)
	assert.Equal(t, "caf", chunks[0].GetText())
	assert.Equal(t, "é ok", chunks[1].GetText())
	assert.Equal(t, "\uFFFD", chunks[2].GetText(), "an invalid byte is replaced, not sent")
}

// TestAudioOut: a vocoder (codes in, audio out): codes go as INT32, the
// audio (INT16, raw or typed) comes back as PCM16 with the sample rate of
// its output parameter, else of the response's.
func TestAudioOut(t *testing.T) {
	pcm := []byte{0x01, 0x00, 0xff, 0x7f, 0x00, 0x80} // 1, 32767, -32768
	te := &testEngine{meta: metadata(ins(tensor("codes", "INT32")), tensor("audio", "INT16")),
		infer: func(_ context.Context, _ *oippb.ModelInferRequest, send func(*oippb.ModelStreamInferResponse) error) error {
			a := out{name: "audio", datatype: "INT16", shape: []int64{3}, raw: pcm, params: map[string]*oippb.InferParameter{"sample_rate": int64P(24000)}}
			if err := send(respond(more(), a)); err != nil {
				return err
			}
			p := more()
			p["sample_rate"] = int64P(16000)
			if err := send(respond(p, out{name: "audio", datatype: "INT16", shape: []int64{2}, contents: &oippb.InferTensorContents{IntContents: []int32{-2, 300}}})); err != nil {
				return err
			}
			return send(respond(final("")))
		}}
	e := startEngine(t, "tcp", te)
	h := e.Health()
	assert.Equal(t, stagepb.RoleAudio, h.GetRole())
	assert.Equal(t, stagepb.RoleCodes, h.GetInputRole())
	assert.True(t, e.ContinuesInput(), "a codes-input model runs in segments")

	chunks, err := collect(testCtx(t), e, &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Codes{Codes: &stagepb.Codes{Codes: []uint32{5, 0, 1023}}}})
	require.NoError(t, err)
	require.Len(t, chunks, 3)
	assert.Equal(t, pcm, chunks[0].GetAudioPcm16())
	assert.Equal(t, uint32(24000), chunks[0].GetSampleRate())
	assert.Equal(t, []byte{0xfe, 0xff, 0x2c, 0x01}, chunks[1].GetAudioPcm16())
	assert.Equal(t, uint32(16000), chunks[1].GetSampleRate(), "the response's parameter")
	assert.Equal(t, uint32(16000), chunks[2].GetSampleRate(), "the final chunk keeps the rate")
	for _, c := range chunks {
		assert.Zero(t, c.GetStats().GetGenerationTokens())
	}
	in, raw := input(t, te.got()[0], "codes")
	assert.Equal(t, "INT32", in.GetDatatype())
	assert.Equal(t, []int64{3}, in.GetShape())
	assert.Equal(t, int32Raw(5, 0, 1023), raw)

	// Audio without any sample rate is an error.
	te2 := &testEngine{meta: te.meta, infer: func(_ context.Context, _ *oippb.ModelInferRequest, send func(*oippb.ModelStreamInferResponse) error) error {
		return send(respond(final(""), out{name: "audio", datatype: "INT16", shape: []int64{3}, raw: pcm}))
	}}
	e2 := startEngine(t, "tcp", te2)
	_, err = collect(testCtx(t), e2, &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Codes{Codes: &stagepb.Codes{Codes: []uint32{1}}}})
	require.Equal(t, codes.Internal, status.Code(err), "%v", err)
	assert.Contains(t, err.Error(), "audio without a sample_rate parameter")
}

// TestAudioIn: a speech recognizer (audio in): the conversation's audio
// part goes as INT16 samples with its sample rate as the tensor's
// sample_rate parameter, beside the messages.
func TestAudioIn(t *testing.T) {
	te := &testEngine{meta: metadata(ins(tensor("audio", "INT16"), tensor("messages", "BYTES", 1)), tensor("text", "BYTES", 1)),
		infer: func(_ context.Context, _ *oippb.ModelInferRequest, send func(*oippb.ModelStreamInferResponse) error) error {
			return send(respond(final(""), textOut("hello")))
		}}
	e := startEngine(t, "tcp", te)
	h := e.Health()
	assert.Equal(t, stagepb.RoleAudio, h.GetInputRole())
	assert.Equal(t, []string{stagepb.PartAudio}, h.GetInputParts())
	samples := []byte{1, 0, 2, 0, 3, 0, 4, 0}
	wavFile := append([]byte("RIFF"), binary.LittleEndian.AppendUint32(nil, uint32(36+len(samples)))...)
	wavFile = append(wavFile, "WAVEfmt "...)
	wavFile = binary.LittleEndian.AppendUint32(wavFile, 16)
	wavFile = binary.LittleEndian.AppendUint16(wavFile, 1)     // PCM
	wavFile = binary.LittleEndian.AppendUint16(wavFile, 1)     // mono
	wavFile = binary.LittleEndian.AppendUint32(wavFile, 16000) // Hz
	wavFile = binary.LittleEndian.AppendUint32(wavFile, 32000) // bytes a second
	wavFile = binary.LittleEndian.AppendUint16(wavFile, 2)     // block align
	wavFile = binary.LittleEndian.AppendUint16(wavFile, 16)    // bits
	wavFile = append(wavFile, "data"...)
	wavFile = binary.LittleEndian.AppendUint32(wavFile, uint32(len(samples)))
	wavFile = append(wavFile, samples...)
	req := &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Chat{Chat: &stagepb.Chat{Messages: []*stagepb.ChatMessage{{
		Role: "user", Content: "transcribe",
		Parts: []*stagepb.ContentPart{{Kind: "text", Text: "transcribe"}, {Kind: "audio", Data: wavFile, Format: "wav"}},
	}}}}}
	chunks, err := collect(testCtx(t), e, req)
	require.NoError(t, err)
	assert.Equal(t, "hello", joinText(chunks))
	r := te.got()[0]
	in, raw := input(t, r, "audio")
	assert.Equal(t, "INT16", in.GetDatatype())
	assert.Equal(t, []int64{4}, in.GetShape())
	assert.Equal(t, samples, raw)
	assert.True(t, proto.Equal(int64P(16000), in.GetParameters()["sample_rate"]))
	assert.Equal(t, `[{"role":"user","content":"transcribe"}]`, textOf(t, r, "messages"))

	// No audio: refused.
	_, err = collect(testCtx(t), e, &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Chat{Chat: &stagepb.Chat{Messages: []*stagepb.ChatMessage{{Role: "user", Content: "hi"}}}}})
	require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
	assert.Contains(t, err.Error(), "no audio part")
}

// TestEngineError: a response's error_message fails the request as an
// engine error, after the chunks before it.
func TestEngineError(t *testing.T) {
	te := &testEngine{meta: textModel(), infer: func(_ context.Context, _ *oippb.ModelInferRequest, send func(*oippb.ModelStreamInferResponse) error) error {
		if err := send(respond(more(), textOut("partial"))); err != nil {
			return err
		}
		return send(&oippb.ModelStreamInferResponse{ErrorMessage: "CUDA out of memory"})
	}}
	e := startEngine(t, "tcp", te)
	chunks, err := collect(testCtx(t), e, textReq("x"))
	require.Equal(t, codes.Internal, status.Code(err), "%v", err)
	assert.Contains(t, status.Convert(err).Message(), "oip: model m failed after 1 responses: CUDA out of memory")
	require.Len(t, chunks, 1)
	assert.Equal(t, "partial", chunks[0].GetText())

	// The engine refusing the request: InvalidArgument, its words.
	te.setInfer(func(context.Context, *oippb.ModelInferRequest, func(*oippb.ModelStreamInferResponse) error) error {
		return status.Error(codes.InvalidArgument, "prompt too long")
	})
	_, err = collect(testCtx(t), e, textReq("x"))
	require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
	assert.Equal(t, "prompt too long", status.Convert(err).Message())

	// A stream that ends without a final response is Unavailable.
	te.setInfer(func(_ context.Context, _ *oippb.ModelInferRequest, send func(*oippb.ModelStreamInferResponse) error) error {
		return send(respond(more(), textOut("cut")))
	})
	_, err = collect(testCtx(t), e, textReq("x"))
	require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
	assert.Contains(t, err.Error(), "without a final one")
}

// TestCancelReachesEngine: cancelling the request cancels its stream: the
// engine's stream context ends.
func TestCancelReachesEngine(t *testing.T) {
	cancelled := make(chan struct{})
	te := &testEngine{meta: textModel(), infer: func(ctx context.Context, _ *oippb.ModelInferRequest, send func(*oippb.ModelStreamInferResponse) error) error {
		if err := send(respond(more(), textOut("first"))); err != nil {
			return err
		}
		<-ctx.Done() // a long generation, until the stream is cancelled
		close(cancelled)
		return ctx.Err()
	}}
	e := startEngine(t, "tcp", te)
	ctx, cancel := context.WithCancel(testCtx(t))
	defer cancel()
	got := 0
	err := e.Generate(ctx, textReq("x"), func(*stagepb.GenerateChunk) error {
		got++
		cancel()
		return nil
	})
	require.ErrorIs(t, err, context.Canceled)
	assert.Equal(t, 1, got)
	wctx, wcancel := context.WithTimeout(context.Background(), wait)
	defer wcancel()
	select {
	case <-cancelled:
	case <-wctx.Done():
		t.Fatal("the engine never saw the cancellation")
	}
	assert.Zero(t, e.Health().GetGauges().GetNumRequestsRunning(), "nothing in flight")
}

// TestNotReady: an engine whose model is not ready is NOT_SERVING with the
// reason, refuses requests, and makes Run fail after the ready timeout;
// one that stops being ready leaves rotation after the failures in a row
// and comes back.
func TestNotReady(t *testing.T) {
	te := &testEngine{meta: textModel(), infer: echoWords("")}
	addr := serve(t, "tcp", te)
	te.setReady(true, false)
	e, m := runEngine(t, oip.Config{Upstream: addr, ReadyTimeout: 300 * time.Millisecond})
	err := m.result(t)
	require.Error(t, err)
	assert.Contains(t, err.Error(), `not ready after 300ms (--upstream-ready-timeout): model "m" not ready`)
	h := e.Health()
	assert.Equal(t, stagepb.ServingStatus_SERVING_STATUS_NOT_SERVING, h.GetStatus())
	assert.Equal(t, `not ready: model "m" not ready`, h.GetStatusMessage())
	assert.Empty(t, h.GetRole(), "no roles before the metadata")
	select {
	case <-e.Ready():
		t.Fatal("Ready closed without a ready model")
	default:
	}
	_, err = collect(testCtx(t), e, textReq("x"))
	require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)

	// Ready, then not: out of rotation after two failed checks.
	te.setReady(true, true)
	e, _ = runEngine(t, oip.Config{Upstream: addr, HealthInterval: 20 * time.Millisecond, HealthFailures: 2})
	waitAvailable(t, e, true)
	<-e.Ready()
	te.setReady(false, true)
	waitAvailable(t, e, false)
	h = e.Health()
	assert.Equal(t, stagepb.ServingStatus_SERVING_STATUS_NOT_SERVING, h.GetStatus())
	assert.Equal(t, "2 health checks failed in a row: server not ready", h.GetStatusMessage())
	assert.Equal(t, stagepb.RoleText, h.GetRole(), "the roles stay")
	te.setReady(true, true)
	waitAvailable(t, e, true)
	assert.Equal(t, stagepb.ServingStatus_SERVING_STATUS_SERVING, e.Health().GetStatus())
}

// TestUnmappableModel: a model whose tensor of the mapping has another
// datatype fails Run at once: waiting would not help.
func TestUnmappableModel(t *testing.T) {
	te := &testEngine{meta: metadata(ins(tensor("codes", "INT64")), tensor("audio", "INT16")), infer: echoWords("")}
	_, m := runEngine(t, oip.Config{Upstream: serve(t, "tcp", te)})
	err := m.result(t)
	require.Error(t, err)
	assert.Equal(t, `oip: model "m": input "codes" is INT64; troupe sends it as INT32`, err.Error())
}

// TestSleepUnsupported: the protocol has no sleep mode.
func TestSleepUnsupported(t *testing.T) {
	e, err := oip.New(oip.Config{Upstream: "127.0.0.1:1", Model: "m"})
	require.NoError(t, err)
	defer e.Close()
	_, err = e.Sleep(testCtx(t), 1)
	require.Equal(t, codes.Unimplemented, status.Code(err))
	st, err := e.WakeUp(testCtx(t))
	require.NoError(t, err)
	assert.Equal(t, stagepb.SleepState_SLEEP_STATE_AWAKE, st)
}

func TestCheckAddr(t *testing.T) {
	for addr, want := range map[string]string{
		"unix:///run/engine.sock": "",
		"127.0.0.1:8001":          "",
		"localhost:8001":          "",
		"[::1]:8001":              "",
		"unix://relative.sock":    "want unix:///absolute/path",
		"unix:///":                "want unix:///absolute/path",
		"http://h:8000":           "want unix:///path/engine.sock or host:port",
		"localhost":               "want unix:///path/engine.sock or host:port",
		":8001":                   "no host",
		"h:0":                     "port must be 1 to 65535",
		"h:65536":                 "port must be 1 to 65535",
	} {
		err := oip.CheckAddr(addr)
		if want == "" {
			assert.NoError(t, err, addr)
			continue
		}
		assert.ErrorContains(t, err, want, addr)
	}
	_, err := oip.New(oip.Config{Upstream: "127.0.0.1:1"})
	assert.EqualError(t, err, "oip: no model name")
}
