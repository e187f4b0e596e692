package httpapi

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// Limits of the request fields troupe checks itself; the engines check the
// rest.
const (
	// MaxTokensLimit is the largest max_tokens / max_completion_tokens
	// accepted: far above any real context, small enough that a typo
	// (1e12) is an error rather than an hour of generation.
	MaxTokensLimit = 1 << 20
	maxTemperature = 2.0
)

// samplingFields are the generation parameters shared by chat and text
// completions. Pointers tell an absent field from a zero one.
type samplingFields struct {
	Model               *string         `json:"model"`
	Stream              *bool           `json:"stream"`
	StreamOptions       *streamOptions  `json:"stream_options"`
	MaxTokens           *int64          `json:"max_tokens"`
	MaxCompletionTokens *int64          `json:"max_completion_tokens"`
	Temperature         *float64        `json:"temperature"`
	Seed                *int64          `json:"seed"`
	Stop                json.RawMessage `json:"stop"`
	IgnoreEOS           *bool           `json:"ignore_eos"` // vLLM extension
	N                   *int64          `json:"n"`
}

type streamOptions struct {
	IncludeUsage *bool `json:"include_usage"`
}

// chatRequest is the body of POST /v1/chat/completions. Fields troupe does
// not use (top_p, user, tools, ...) are accepted and ignored, as clients
// send them freely.
type chatRequest struct {
	samplingFields
	Messages   []chatMessage `json:"messages"`
	Modalities []string      `json:"modalities"`
	Audio      *audioParam   `json:"audio"`
}

type chatMessage struct {
	Role    *string         `json:"role"`
	Content json.RawMessage `json:"content"` // string, array of parts, or null
}

type contentPart struct {
	Type *string `json:"type"`
	Text *string `json:"text"`
}

type audioParam struct {
	Voice  json.RawMessage `json:"voice"` // a name, or {"id": "..."}
	Format *string         `json:"format"`
}

// completionRequest is the body of POST /v1/completions.
type completionRequest struct {
	samplingFields
	Prompt json.RawMessage `json:"prompt"`
}

// job is a parsed, validated request, ready for the head.
type job struct {
	model        string
	prompt       string
	sampling     *stagepb.SamplingParams
	stream       bool
	includeUsage bool
	messages     []*stagepb.ChatMessage // the conversation (chat only)
	voice        string                 // audio.voice (chat only)
	audio        bool                   // run every stage and return message.audio (chat only)
	audioFormat  string                 // audioFormatWAV or audioFormatPCM16
	operation    string                 // gen_ai.operation.name: chat or text_completion
}

// decodeBody unmarshals a JSON object into v and turns decoding failures
// into 400s that name the field.
func decodeBody(body []byte, v any) *apiError {
	trimmed := bytes.TrimSpace(body)
	if len(trimmed) == 0 {
		return badRequest("", "invalid_json", "request body is empty; expected a JSON object")
	}
	err := json.Unmarshal(trimmed, v)
	if err == nil {
		return nil
	}
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		// encoding/json names the embedded struct in the path; clients do
		// not know it.
		field := strings.TrimPrefix(te.Field, "samplingFields.")
		if field == "" {
			return badRequest("", "invalid_type", "request body must be a JSON object, got %s", te.Value)
		}
		return badRequest(field, "invalid_type", "invalid type for %q: expected %s, got %s", field, jsonTypeName(te.Type), te.Value)
	}
	return badRequest("", "invalid_json", "request body is not valid JSON: %v", err)
}

// jsonTypeName names a Go type as JSON would.
func jsonTypeName(t reflect.Type) string {
	if t == nil {
		return "a value"
	}
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.Bool:
		return "a boolean"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "an integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.String:
		return "a string"
	case reflect.Slice, reflect.Array:
		return "an array"
	case reflect.Struct, reflect.Map:
		return "an object"
	}
	return "a value"
}

// isNull reports whether a raw field is absent or JSON null.
func isNull(raw json.RawMessage) bool {
	t := bytes.TrimSpace(raw)
	return len(t) == 0 || bytes.Equal(t, []byte("null"))
}

// parseChat validates a chat request for a pipeline serving model.
func parseChat(body []byte, model string) (job, *apiError) {
	var req chatRequest
	if e := decodeBody(body, &req); e != nil {
		return job{}, e
	}
	j, e := req.samplingFields.job(model)
	if e != nil {
		return job{}, e
	}
	if req.Messages == nil {
		return job{}, badRequest("messages", "missing_field", "missing required field \"messages\"")
	}
	if len(req.Messages) == 0 {
		return job{}, badRequest("messages", "invalid_value", "\"messages\" must hold at least one message")
	}
	if j.prompt, j.messages, e = chatPrompt(req.Messages); e != nil {
		return job{}, e
	}
	for _, m := range req.Modalities {
		switch m {
		case "text":
		case "audio":
			j.audio = true
		default:
			return job{}, badRequest("modalities", "invalid_value", "unknown modality %q: expected \"text\" or \"audio\"", m)
		}
	}
	j.audioFormat = audioFormatWAV
	if j.stream {
		j.audioFormat = audioFormatPCM16 // the only format audio streams in
	}
	if req.Audio != nil {
		if e := req.Audio.validate(); e != nil {
			return job{}, e
		}
		if req.Audio.Format != nil {
			j.audioFormat = *req.Audio.Format
		}
		j.voice = req.Audio.voiceName()
	}
	if j.audio && j.stream && j.audioFormat != audioFormatPCM16 {
		return job{}, badRequest("audio.format", "unsupported",
			"streamed audio is sent as raw samples: set \"audio\": {\"format\": \"pcm16\"} with \"stream\": true (as OpenAI requires), or stream without audio")
	}
	return j, nil
}

// chatPrompt renders messages as the stage-0 prompt: one "role: content"
// line per message, joined by "\n"; the text parts of an array content are
// joined by "\n". The rendering is deterministic, so the same conversation
// always yields the same output from a seeded engine. It also returns the
// messages as the protocol carries them (the same contents), for engines
// that apply their own chat template.
func chatPrompt(msgs []chatMessage) (string, []*stagepb.ChatMessage, *apiError) {
	var b strings.Builder
	out := make([]*stagepb.ChatMessage, 0, len(msgs))
	for i, m := range msgs {
		param := fmt.Sprintf("messages[%d]", i)
		if m.Role == nil {
			return "", nil, badRequest(param+".role", "missing_field", "missing required field %q", param+".role")
		}
		switch *m.Role {
		case "system", "developer", "user", "assistant", "tool", "function":
		default:
			return "", nil, badRequest(param+".role", "invalid_value", "unknown role %q: expected system, developer, user, assistant, tool or function", *m.Role)
		}
		text, e := messageText(param+".content", m.Content)
		if e != nil {
			return "", nil, e
		}
		out = append(out, &stagepb.ChatMessage{Role: *m.Role, Content: text})
		if i > 0 {
			b.WriteByte('\n')
		}
		b.WriteString(*m.Role)
		b.WriteString(": ")
		b.WriteString(text)
	}
	return b.String(), out, nil
}

// messageText flattens a message content: a string, null (an assistant
// turn that only called tools), or an array of {"type":"text","text":...}.
func messageText(param string, raw json.RawMessage) (string, *apiError) {
	if isNull(raw) {
		return "", nil
	}
	switch bytes.TrimSpace(raw)[0] {
	case '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return "", badRequest(param, "invalid_type", "invalid %s: %v", param, err)
		}
		return s, nil
	case '[':
		var parts []json.RawMessage
		if err := json.Unmarshal(raw, &parts); err != nil {
			return "", badRequest(param, "invalid_type", "invalid %s: %v", param, err)
		}
		texts := make([]string, 0, len(parts))
		for k, rawPart := range parts {
			pp := fmt.Sprintf("%s[%d]", param, k)
			var p contentPart
			if t := bytes.TrimSpace(rawPart); len(t) == 0 || t[0] != '{' {
				return "", badRequest(pp, "invalid_type", "invalid type for %q: expected an object", pp)
			}
			if err := json.Unmarshal(rawPart, &p); err != nil {
				return "", badRequest(pp, "invalid_type", "invalid %s: %v", pp, err)
			}
			switch {
			case p.Type == nil:
				return "", badRequest(pp+".type", "missing_field", "missing required field %q", pp+".type")
			case *p.Type != "text":
				return "", badRequest(pp+".type", "unsupported", "content part type %q is not supported: only \"text\" parts are", *p.Type)
			case p.Text == nil:
				return "", badRequest(pp+".text", "missing_field", "missing required field %q", pp+".text")
			}
			texts = append(texts, *p.Text)
		}
		return strings.Join(texts, "\n"), nil
	}
	return "", badRequest(param, "invalid_type", "invalid type for %q: expected a string or an array of content parts", param)
}

// Audio formats troupe answers in: a WAV file, or raw PCM16 mono
// little-endian samples at the pipeline's sample rate (OpenAI's pcm16,
// which it requires for streamed audio).
const (
	audioFormatWAV   = "wav"
	audioFormatPCM16 = "pcm16"
)

func (a *audioParam) validate() *apiError {
	if a.Format != nil && *a.Format != audioFormatWAV && *a.Format != audioFormatPCM16 {
		return badRequest("audio.format", "unsupported", "audio format %q is not supported: \"wav\" and \"pcm16\" are", *a.Format)
	}
	if !isNull(a.Voice) {
		switch bytes.TrimSpace(a.Voice)[0] {
		case '"':
		case '{':
			var v struct {
				ID *string `json:"id"`
			}
			if err := json.Unmarshal(a.Voice, &v); err != nil || v.ID == nil {
				return badRequest("audio.voice", "invalid_type", "\"audio.voice\" must be a voice name or an object with a string \"id\"")
			}
		default:
			return badRequest("audio.voice", "invalid_type", "invalid type for \"audio.voice\": expected a string or an object")
		}
	}
	return nil
}

// voiceName is the voice's name: the string, or the object's id.
func (a *audioParam) voiceName() string {
	var name string
	if json.Unmarshal(a.Voice, &name) == nil {
		return name
	}
	var v struct {
		ID string `json:"id"`
	}
	_ = json.Unmarshal(a.Voice, &v)
	return v.ID
}

// parseCompletion validates a text completion request.
func parseCompletion(body []byte, model string) (job, *apiError) {
	var req completionRequest
	if e := decodeBody(body, &req); e != nil {
		return job{}, e
	}
	j, e := req.samplingFields.job(model)
	if e != nil {
		return job{}, e
	}
	if j.prompt, e = completionPrompt(req.Prompt); e != nil {
		return job{}, e
	}
	return j, nil
}

// completionPrompt accepts a string, or an array holding one string.
// Batches and token-id prompts are refused: one request is one pipeline run.
func completionPrompt(raw json.RawMessage) (string, *apiError) {
	if isNull(raw) {
		return "", badRequest("prompt", "missing_field", "missing required field \"prompt\"")
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	var arr []json.RawMessage
	if err := json.Unmarshal(raw, &arr); err != nil {
		return "", badRequest("prompt", "invalid_type", "invalid type for \"prompt\": expected a string or an array of one string")
	}
	if len(arr) != 1 {
		return "", badRequest("prompt", "unsupported", "\"prompt\" holds %d prompts: batched prompts are not supported, send one request per prompt", len(arr))
	}
	if err := json.Unmarshal(arr[0], &s); err != nil {
		return "", badRequest("prompt", "unsupported", "token-id prompts are not supported: \"prompt\" must be text")
	}
	return s, nil
}

// job validates the fields shared by both endpoints.
func (f *samplingFields) job(model string) (job, *apiError) {
	if f.Model == nil || *f.Model == "" {
		return job{}, badRequest("model", "missing_field", "missing required field \"model\"")
	}
	if *f.Model != model {
		return job{}, notFound("model", "model_not_found", "the model %q does not exist; this server serves %q", *f.Model, model)
	}
	if f.N != nil && *f.N != 1 {
		if *f.N > 1 {
			return job{}, badRequest("n", "unsupported", "n=%d is not supported: troupe returns exactly one choice per request (n must be 1)", *f.N)
		}
		return job{}, badRequest("n", "invalid_value", "n must be 1, got %d", *f.N)
	}
	sp := &stagepb.SamplingParams{}
	for _, mt := range []struct {
		name string
		v    *int64
	}{{"max_tokens", f.MaxTokens}, {"max_completion_tokens", f.MaxCompletionTokens}} {
		if mt.v != nil && (*mt.v < 1 || *mt.v > MaxTokensLimit) {
			return job{}, badRequest(mt.name, "invalid_value", "%s must be between 1 and %d, got %d", mt.name, MaxTokensLimit, *mt.v)
		}
	}
	switch {
	case f.MaxCompletionTokens != nil:
		sp.MaxTokens = uint32(*f.MaxCompletionTokens)
	case f.MaxTokens != nil:
		sp.MaxTokens = uint32(*f.MaxTokens)
	}
	if f.Temperature != nil {
		if t := *f.Temperature; t < 0 || t > maxTemperature {
			return job{}, badRequest("temperature", "invalid_value", "temperature must be between 0 and %g, got %g", maxTemperature, t)
		}
		t := float32(*f.Temperature)
		sp.Temperature = &t
	}
	if f.Seed != nil {
		seed := *f.Seed
		sp.Seed = &seed
	}
	stop, e := stopSequences(f.Stop)
	if e != nil {
		return job{}, e
	}
	sp.Stop = stop
	if f.IgnoreEOS != nil {
		sp.IgnoreEos = *f.IgnoreEOS
	}
	j := job{model: model, sampling: sp}
	if f.Stream != nil {
		j.stream = *f.Stream
	}
	if f.StreamOptions != nil && f.StreamOptions.IncludeUsage != nil {
		j.includeUsage = *f.StreamOptions.IncludeUsage
	}
	return j, nil
}

// stopSequences accepts null, a string, or an array of strings.
func stopSequences(raw json.RawMessage) ([]string, *apiError) {
	if isNull(raw) {
		return nil, nil
	}
	var one string
	if err := json.Unmarshal(raw, &one); err == nil {
		if one == "" {
			return nil, badRequest("stop", "invalid_value", "stop sequences must not be empty")
		}
		return []string{one}, nil
	}
	var many []string
	if err := json.Unmarshal(raw, &many); err != nil {
		return nil, badRequest("stop", "invalid_type", "invalid type for \"stop\": expected a string or an array of strings")
	}
	for _, s := range many {
		if s == "" {
			return nil, badRequest("stop", "invalid_value", "stop sequences must not be empty")
		}
	}
	if len(many) == 0 {
		return nil, nil
	}
	return many, nil
}
