package oip

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/pkg/oippb"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker/internal/wav"
)

// Sequence parameters (Triton's) on a fed stage's segments.
const (
	ParamSequenceID    = "sequence_id"
	ParamSequenceStart = "sequence_start"
	ParamSequenceEnd   = "sequence_end"
)

// rawAudioRate is the sample rate of headerless PCM16 input (pcm16): the
// API's, 24 kHz.
const rawAudioRate = 24000

// Generate runs one request (or one segment of a fed stage's input) as one
// ModelInferRequest on a ModelStreamInfer stream of its own, opened with
// ctx: cancelling ctx cancels the stream, and with it the request in the
// engine. It sends the request, closes its side, and emits one chunk per
// response until the final one (triton_final_response, or a response
// without that parameter), which carries the finish reason (its
// finish_reason, stop when absent) and timings (prefill: until the first
// response; decode: from the first to the last). Then it cancels the
// stream. Each chunk counts its tokens: len(token_ids) when the response
// has token ids, else len(codes) when it has codes, else one when it has
// text. A response's error_message fails the request (Internal); a
// stream that ends without a final response is Unavailable.
func (e *Engine) Generate(ctx context.Context, req *stagepb.GenerateRequest, emit func(*stagepb.GenerateChunk) error) error {
	m, err := e.admit()
	if err != nil {
		return err
	}
	in, err := e.inferRequest(ctx, m, req)
	if err != nil {
		return err
	}
	untrack := e.track()
	defer untrack()
	sctx, cancel := context.WithCancel(ctx)
	defer cancel() // ends the stream once the final response is in
	start := time.Now()
	stream, err := e.client.ModelStreamInfer(sctx)
	if err != nil {
		return e.streamError(ctx, err, 0)
	}
	// A Send that fails with io.EOF means the stream ended: Recv says how.
	if err := stream.Send(in); err != nil && !errors.Is(err, io.EOF) {
		return e.streamError(ctx, err, 0)
	}
	_ = stream.CloseSend() // fails only when the stream has ended, which Recv reports
	rd := responseReader{model: m}
	var first, last time.Time
	for n := 0; ; n++ {
		r, err := stream.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) && ctx.Err() == nil {
				return status.Errorf(codes.Unavailable, "oip: engine %s ended the stream after %d responses without a final one", e.cfg.Upstream, n)
			}
			return e.streamError(ctx, err, n)
		}
		if msg := r.GetErrorMessage(); msg != "" {
			return status.Errorf(codes.Internal, "oip: model %s failed after %d responses: %s", m.name, n, msg)
		}
		chunk, final, err := rd.read(r.GetInferResponse())
		if err != nil {
			return status.Errorf(codes.Internal, "oip: model %s: response %d: %v", m.name, n, err)
		}
		last = time.Now()
		if first.IsZero() {
			first = last
		}
		if final {
			untrack() // the final chunk's load no longer holds this request
			chunk.Timings = &stagepb.Timings{PrefillSeconds: first.Sub(start).Seconds(), DecodeSeconds: last.Sub(first).Seconds()}
		}
		chunk.Stats = e.gauges()
		chunk.Stats.GenerationTokens = rd.tokens
		if err := emit(chunk); err != nil {
			return err
		}
		if final {
			return nil
		}
	}
}

// admit refuses a request the engine cannot run now, and returns the
// model it runs on.
func (e *Engine) admit() (*model, error) {
	m := e.model.Load()
	if st, msg := e.state(); st != stagepb.ServingStatus_SERVING_STATUS_SERVING || m == nil {
		return nil, status.Errorf(codes.Unavailable, "oip: engine %s is unavailable: %s", e.cfg.Upstream, msg)
	}
	return m, nil
}

// track counts a request in flight until the returned func is first
// called (it may be called again).
func (e *Engine) track() func() {
	e.inFlight.Add(1)
	var once sync.Once
	return func() { once.Do(func() { e.inFlight.Add(-1) }) }
}

// streamError classifies a failed stream: the caller's own cancellation
// or deadline as it is; the engine's refusal of the input as
// InvalidArgument with its words (shown to the client); a transport
// failure or an overloaded engine as Unavailable (another replica may
// serve it); anything else as Internal.
func (e *Engine) streamError(ctx context.Context, err error, responses int) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	st := status.Convert(err)
	switch st.Code() {
	case codes.InvalidArgument:
		return status.Error(codes.InvalidArgument, st.Message())
	case codes.Unavailable, codes.ResourceExhausted, codes.Canceled, codes.DeadlineExceeded, codes.Aborted:
		return status.Errorf(codes.Unavailable, "oip: engine %s: stream failed after %d responses: %s: %s", e.cfg.Upstream, responses, st.Code(), st.Message())
	case codes.Unimplemented:
		return status.Errorf(codes.Internal, "oip: engine %s does not serve ModelStreamInfer (Triton's streaming call): %s", e.cfg.Upstream, st.Message())
	}
	return status.Errorf(codes.Internal, "oip: engine %s: stream failed after %d responses: %s: %s", e.cfg.Upstream, responses, st.Code(), st.Message())
}

// inferRequest maps a troupe request onto the model's inputs
// (docs/contracts.md, "Engine protocol"): the input (text, messages,
// token_ids, codes, audio) under the name the model declares, the context
// when it declares one, the request's named tensors, the sampling
// parameters the client set, and on a fed stage's segment the sequence
// parameters. Input the model has no tensor for is InvalidArgument.
func (e *Engine) inferRequest(ctx context.Context, m *model, req *stagepb.GenerateRequest) (*oippb.ModelInferRequest, error) {
	r := &oippb.ModelInferRequest{ModelName: m.name, Id: req.GetRequestId(), Parameters: requestParams(req)}
	add := func(name, datatype string, shape []int64, raw []byte) *oippb.ModelInferRequest_InferInputTensor {
		t := &oippb.ModelInferRequest_InferInputTensor{Name: name, Datatype: datatype, Shape: shape}
		r.Inputs = append(r.Inputs, t)
		r.RawInputContents = append(r.RawInputContents, raw)
		return t
	}
	addText := func(name, s string) { add(name, typeBytes, []int64{1}, encodeBytes([]byte(s))) }
	refuse := func(format string, args ...any) error {
		return status.Errorf(codes.InvalidArgument, "oip: model %s: "+format, append([]any{m.name}, args...)...)
	}
	switch in := req.GetInput().(type) {
	case *stagepb.GenerateRequest_Text:
		switch {
		case m.hasInput(TensorText):
			addText(TensorText, in.Text)
		case m.hasInput(TensorMessages):
			addText(TensorMessages, messagesJSON([]*stagepb.ChatMessage{{Role: "user", Content: in.Text}}))
		case in.Text != "":
			return nil, refuse("takes no text input (it declares neither %q nor %q)", TensorText, TensorMessages)
		}
	case *stagepb.GenerateRequest_Chat:
		msgs := in.Chat.GetMessages()
		switch {
		case m.hasInput(TensorMessages):
			addText(TensorMessages, messagesJSON(msgs))
		case m.hasInput(TensorText):
			addText(TensorText, chatLines(msgs))
		case m.inputRole != stagepb.RoleAudio:
			return nil, refuse("takes no chat input (it declares neither %q nor %q)", TensorMessages, TensorText)
		}
		if m.inputRole == stagepb.RoleAudio {
			pcm, rate, err := chatAudio(msgs)
			if err != nil {
				return nil, refuse("%v", err)
			}
			t := add(TensorAudio, typeInt16, []int64{int64(len(pcm) / 2)}, pcm)
			t.Parameters = map[string]*oippb.InferParameter{ParamSampleRate: int64Param(int64(rate))}
		}
	case *stagepb.GenerateRequest_TokenIds:
		if !m.hasInput(TensorTokenIDs) {
			return nil, refuse("takes no token ids (it declares no %q input)", TensorTokenIDs)
		}
		raw, err := rawInt32s(in.TokenIds.GetIds())
		if err != nil {
			return nil, refuse("token ids: %v", err)
		}
		add(TensorTokenIDs, typeInt32, []int64{int64(len(in.TokenIds.GetIds()))}, raw)
	case *stagepb.GenerateRequest_Codes:
		if !m.hasInput(TensorCodes) {
			return nil, refuse("takes no codes (it declares no %q input)", TensorCodes)
		}
		raw, err := rawInt32s(in.Codes.GetCodes())
		if err != nil {
			return nil, refuse("codes: %v", err)
		}
		add(TensorCodes, typeInt32, []int64{int64(len(in.Codes.GetCodes()))}, raw)
	}
	if m.hasInput(TensorContext) {
		addText(TensorContext, req.GetContext())
	}
	for _, t := range req.GetTensors() {
		if err := checkInputTensor(m, t); err != nil {
			return nil, refuse("%v", err)
		}
		tt, _ := typeOfDType(t.GetDtype())
		add(t.GetName(), tt.oip, slices.Clone(t.GetShape()), t.GetData())
	}
	e.sequenceParams(m, req, r.Parameters)
	return r, nil
}

// checkInputTensor checks a request's named tensor: a type troupe
// carries, a shape its data fills exactly, and a name the model declares
// as an input of that type that is not one of the mapping's.
func checkInputTensor(m *model, t *stagepb.Tensor) error {
	name := t.GetName()
	tt, ok := typeOfDType(t.GetDtype())
	if !ok {
		return fmt.Errorf("tensor %q: dtype %s is not one troupe carries", name, t.GetDtype())
	}
	if err := checkData(t.GetData(), t.GetShape(), tt.size, tt.oip); err != nil {
		return fmt.Errorf("tensor %q: %w", name, err)
	}
	if _, ok := standardInputs[name]; ok {
		return fmt.Errorf("tensor %q: the name is the mapping's own input", name)
	}
	dt, ok := m.inputs[name]
	if !ok {
		return fmt.Errorf("tensor %q: the model declares no such input", name)
	}
	if dt != tt.oip {
		return fmt.Errorf("tensor %q is %s; the model takes %s", name, tt.oip, dt)
	}
	return nil
}

// sequenceParams adds Triton's sequence parameters to a fed stage's
// segment (GenerateRequest.segment set by the worker): sequence_id, the
// troupe request id, on every segment; sequence_start on the first;
// sequence_end on the one the input ends with (last_segment), or on every
// segment of a model that does not continue its input (it runs a fed input
// as one segment).
func (e *Engine) sequenceParams(m *model, req *stagepb.GenerateRequest, params map[string]*oippb.InferParameter) {
	if req.GetSegment() == 0 {
		return
	}
	params[ParamSequenceID] = stringParam(req.GetRequestId())
	if req.GetSegment() == 1 {
		params[ParamSequenceStart] = boolParam(true)
	}
	if req.GetLastSegment() || !m.continues() {
		params[ParamSequenceEnd] = boolParam(true)
	}
}

// requestParams are the sampling parameters the client set, under the
// mapping's names; unset ones are not sent, so the model's defaults apply.
func requestParams(req *stagepb.GenerateRequest) map[string]*oippb.InferParameter {
	// Triton sends a decoupled model's final flag on a response of its own
	// (a model that ends with the flag alone) only when asked: without it
	// such a request would never end here.
	p := map[string]*oippb.InferParameter{ParamEnableEmptyFinal: boolParam(true)}
	sp := req.GetSampling()
	if sp == nil {
		sp = &stagepb.SamplingParams{}
	}
	if v := sp.GetMaxTokens(); v > 0 {
		p["max_tokens"] = int64Param(int64(v))
	}
	if sp.TopK != nil {
		p["top_k"] = int64Param(int64(sp.GetTopK()))
	}
	if sp.Seed != nil {
		p["seed"] = int64Param(sp.GetSeed())
	}
	if v := sp.GetMinTokens(); v > 0 {
		p["min_tokens"] = int64Param(int64(v))
	}
	for name, v := range map[string]*float32{
		"temperature": sp.Temperature, "top_p": sp.TopP, "min_p": sp.MinP,
		"frequency_penalty": sp.FrequencyPenalty, "presence_penalty": sp.PresencePenalty, "repetition_penalty": sp.RepetitionPenalty,
	} {
		if v != nil {
			p[name] = doubleParam(*v)
		}
	}
	if stop := sp.GetStop(); len(stop) > 0 {
		b, _ := json.Marshal(stop) // strings always marshal
		p["stop"] = stringParam(string(b))
	}
	if sp.GetIgnoreEos() {
		p["ignore_eos"] = boolParam(true)
	}
	for name, v := range map[string]string{"voice": req.GetVoice(), "language": req.GetLanguage(), "continuation": req.GetContinuation()} {
		if v != "" {
			p[name] = stringParam(v)
		}
	}
	return p
}

func int64Param(v int64) *oippb.InferParameter {
	return &oippb.InferParameter{ParameterChoice: &oippb.InferParameter_Int64Param{Int64Param: v}}
}

func boolParam(v bool) *oippb.InferParameter {
	return &oippb.InferParameter{ParameterChoice: &oippb.InferParameter_BoolParam{BoolParam: v}}
}

func stringParam(v string) *oippb.InferParameter {
	return &oippb.InferParameter{ParameterChoice: &oippb.InferParameter_StringParam{StringParam: v}}
}

// doubleParam sends a float32 as the double of its shortest decimal form,
// so that the client's 0.7 arrives as 0.7, not 0.699999988079071.
func doubleParam(v float32) *oippb.InferParameter {
	d, err := strconv.ParseFloat(strconv.FormatFloat(float64(v), 'g', -1, 32), 64)
	if err != nil {
		d = float64(v)
	}
	return &oippb.InferParameter{ParameterChoice: &oippb.InferParameter_DoubleParam{DoubleParam: d}}
}

// intParam reads an integer parameter (int64 or uint64).
func intParam(p *oippb.InferParameter) (int64, bool) {
	switch v := p.GetParameterChoice().(type) {
	case *oippb.InferParameter_Int64Param:
		return v.Int64Param, true
	case *oippb.InferParameter_Uint64Param:
		if v.Uint64Param <= math.MaxInt64 {
			return int64(v.Uint64Param), true
		}
	}
	return 0, false
}

// messagesJSON is a chat input as the messages tensor holds it:
// [{"role":…,"content":…}], the content being the message's text.
func messagesJSON(msgs []*stagepb.ChatMessage) string {
	type message struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	out := make([]message, len(msgs))
	for i, m := range msgs {
		out[i] = message{Role: m.GetRole(), Content: m.GetContent()}
	}
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(out) // strings always encode
	return strings.TrimSuffix(b.String(), "\n")
}

// chatLines is a chat input for a model without a messages input: one
// "role: content" line per message.
func chatLines(msgs []*stagepb.ChatMessage) string {
	lines := make([]string, len(msgs))
	for i, m := range msgs {
		lines[i] = m.GetRole() + ": " + m.GetContent()
	}
	return strings.Join(lines, "\n")
}

// chatAudio is the conversation's audio for a model that takes audio: its
// last audio part with bytes, as PCM16 mono samples and their rate. A WAV
// (the head has checked it) must be mono 16-bit PCM; pcm16 is taken at
// 24 kHz; compressed audio is not decoded.
func chatAudio(msgs []*stagepb.ChatMessage) (pcm []byte, rate int, err error) {
	var part *stagepb.ContentPart
	for _, m := range msgs {
		for _, p := range m.GetParts() {
			if p.GetKind() == stagepb.PartAudio && len(p.GetData()) > 0 {
				part = p
			}
		}
	}
	if part == nil {
		return nil, 0, errors.New("takes audio: the input has no audio part with its bytes")
	}
	data := part.GetData()
	switch {
	case bytes.HasPrefix(data, []byte("RIFF")):
		r, err := wav.NewReader(bytes.NewReader(data))
		if err != nil {
			return nil, 0, fmt.Errorf("audio: %w", err)
		}
		for {
			b, err := r.Next(len(data))
			if errors.Is(err, io.EOF) {
				return pcm, r.SampleRate(), nil
			}
			if err != nil {
				return nil, 0, fmt.Errorf("audio: %w", err)
			}
			pcm = append(pcm, b...)
		}
	case part.GetFormat() == "pcm16" || part.GetMimeType() == "audio/pcm" || strings.HasPrefix(part.GetMimeType(), "audio/L16"):
		if len(data)%2 != 0 {
			return nil, 0, errors.New("audio: pcm16 of an odd number of bytes")
		}
		return data, rawAudioRate, nil
	}
	return nil, 0, fmt.Errorf("audio: takes PCM16 (a WAV file or pcm16); troupe does not decode %q", cmp(part.GetFormat(), part.GetMimeType()))
}

// cmp is the first non-empty string.
func cmp(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// responseReader turns one request's responses into chunks. It holds the
// state that spans responses: a UTF-8 sequence cut between two responses,
// the latest sample rate.
type responseReader struct {
	model      *model
	pending    []byte // the start of a UTF-8 sequence the next response ends
	sampleRate int64
	tokens     uint64 // the latest response's token count
}

// read maps one response: text, token_ids, codes and audio to the chunk's
// fields, other outputs of a tensor type to its tensors (outputs of other
// types are dropped). final reports the request's last response; its
// chunk carries the finish reason.
func (rd *responseReader) read(r *oippb.ModelInferResponse) (c *stagepb.GenerateChunk, final bool, err error) {
	c = &stagepb.GenerateChunk{}
	rd.tokens = 0
	outs, raw := r.GetOutputs(), r.GetRawOutputContents()
	hasRaw := len(raw) > 0
	if hasRaw && len(raw) != len(outs) {
		return nil, false, fmt.Errorf("%d raw contents for %d outputs", len(raw), len(outs))
	}
	var text []byte
	for i, o := range outs {
		name, dt := o.GetName(), o.GetDatatype()
		want, standard := standardOutputs[name]
		_, carried := typeOfOIP(dt)
		switch {
		case standard && dt != want:
			return nil, false, fmt.Errorf("output %q is %s, want %s", name, dt, want)
		case !standard && !carried:
			continue // not a type troupe carries: dropped (warned about at start)
		}
		var b []byte
		if hasRaw {
			b = raw[i]
		}
		tc, err := readTensor(dt, o.GetShape(), b, hasRaw, o.GetContents())
		if err != nil {
			return nil, false, fmt.Errorf("output %q: %w", name, err)
		}
		switch name {
		case TensorText:
			for _, el := range tc.elems {
				text = append(text, el...)
			}
		case TensorTokenIDs, TensorCodes:
			ids, err := int32s(tc.data)
			if err != nil {
				return nil, false, fmt.Errorf("output %q: %w", name, err)
			}
			if name == TensorCodes {
				c.Codes = append(c.Codes, ids...)
			} else {
				c.TokenIds = append(c.TokenIds, ids...)
			}
		case TensorAudio:
			if err := rd.sampleRateOf(o, r); err != nil && len(tc.data) > 0 {
				return nil, false, err
			}
			c.AudioPcm16 = append(c.AudioPcm16, tc.data...)
		default:
			tt, _ := typeOfOIP(dt)
			c.Tensors = append(c.Tensors, &stagepb.Tensor{Name: name, Dtype: tt.dtype, Shape: slices.Clone(o.GetShape()), Data: tc.data})
		}
	}
	final = true // a response without the parameter is the last (a model that is not decoupled)
	if p, ok := r.GetParameters()[ParamFinalResponse]; ok {
		final = p.GetBoolParam()
	}
	c.Text = rd.text(text, final)
	if len(c.AudioPcm16) > 0 || (final && rd.sampleRate > 0) {
		c.SampleRate = uint32(rd.sampleRate)
	}
	switch {
	case len(c.TokenIds) > 0:
		rd.tokens = uint64(len(c.TokenIds))
	case len(c.Codes) > 0:
		rd.tokens = uint64(len(c.Codes))
	case len(text) > 0:
		rd.tokens = 1
	}
	if final {
		c.FinishReason = stagepb.FinishReason_FINISH_REASON_STOP
		if r.GetParameters()[ParamFinishReason].GetStringParam() == "length" {
			c.FinishReason = stagepb.FinishReason_FINISH_REASON_LENGTH
		}
	}
	return c, final, nil
}

// sampleRateOf takes the audio's sample rate from the audio output's
// sample_rate parameter, else the response's, else the request's latest.
func (rd *responseReader) sampleRateOf(o *oippb.ModelInferResponse_InferOutputTensor, r *oippb.ModelInferResponse) error {
	for _, params := range []map[string]*oippb.InferParameter{o.GetParameters(), r.GetParameters()} {
		if p, ok := params[ParamSampleRate]; ok {
			v, ok := intParam(p)
			if !ok || v <= 0 || v > math.MaxUint32 {
				return fmt.Errorf("audio: sample_rate parameter %v is not a positive int64", p)
			}
			rd.sampleRate = v
			return nil
		}
	}
	if rd.sampleRate == 0 {
		return errors.New("audio without a sample_rate parameter (on the audio output or the response)")
	}
	return nil
}

// text is the chunk's text: what the response adds, without the start of
// a UTF-8 sequence that it cuts (kept for the next response), invalid
// bytes replaced with U+FFFD. The final response's text is all of it.
func (rd *responseReader) text(b []byte, final bool) string {
	if len(rd.pending) > 0 {
		b = append(rd.pending, b...)
		rd.pending = nil
	}
	if !final {
		cut := len(b)
		for i := len(b) - 1; i >= 0 && i >= len(b)-utf8.UTFMax+1; i-- {
			if utf8.RuneStart(b[i]) {
				if !utf8.FullRune(b[i:]) {
					cut = i
				}
				break
			}
		}
		b, rd.pending = b[:cut], bytes.Clone(b[cut:])
	}
	return strings.ToValidUTF8(string(b), "\uFFFD")
}
