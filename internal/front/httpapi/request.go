package httpapi

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

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

// The request structs below are the one table of the request's fields:
// the fast decoder, the fields each endpoint reads (chatFields,
// completionFields) and the tests are derived from their json tags and Go
// types (fastdecode.go). A field added here is decoded and counted as read
// without another edit.

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
	// Sampling knobs passed on to stage 0 as given (SamplingParams); the
	// engine honours them or documents that it does not (docs/api.md).
	TopP              *float64        `json:"top_p"`
	TopK              *int64          `json:"top_k"` // vLLM extension
	MinP              *float64        `json:"min_p"` // vLLM extension
	FrequencyPenalty  *float64        `json:"frequency_penalty"`
	PresencePenalty   *float64        `json:"presence_penalty"`
	RepetitionPenalty *float64        `json:"repetition_penalty"` // vLLM extension
	LogitBias         json.RawMessage `json:"logit_bias"`         // {"token id": bias}
	MinTokens         *int64          `json:"min_tokens"`         // vLLM extension
	// Asked for, but not produced by troupe: refused when they ask for
	// something (see refuseUnsupported).
	ResponseFormat *responseFormat `json:"response_format"`
	PromptLogprobs json.RawMessage `json:"prompt_logprobs"` // vLLM extension
	// User is the OpenAI user field: a session key for affinity when
	// --session-user is on.
	User *string `json:"user"`
}

type streamOptions struct {
	IncludeUsage *bool `json:"include_usage"`
}

type responseFormat struct {
	Type *string `json:"type"`
}

// chatRequest is the body of POST /v1/chat/completions. Arrays are decoded
// element by element, so an error names the element's index.
type chatRequest struct {
	samplingFields
	Messages     []json.RawMessage `json:"messages"`
	Modalities   []json.RawMessage `json:"modalities"`
	Audio        *audioParam       `json:"audio"`
	Logprobs     *bool             `json:"logprobs"`
	TopLogprobs  *int64            `json:"top_logprobs"`
	ToolChoice   json.RawMessage   `json:"tool_choice"`
	FunctionCall json.RawMessage   `json:"function_call"` // deprecated form of tool_choice
}

type chatMessage struct {
	Role    *string         `json:"role"`
	Content json.RawMessage `json:"content"` // string, array of parts, or null
}

type audioParam struct {
	Voice  json.RawMessage `json:"voice"` // a name, or {"id": "..."}
	Format *string         `json:"format"`
}

// completionRequest is the body of POST /v1/completions.
type completionRequest struct {
	samplingFields
	Prompt   json.RawMessage `json:"prompt"`
	Echo     *bool           `json:"echo"`
	Logprobs *int64          `json:"logprobs"`
	Suffix   *string         `json:"suffix"`
	BestOf   *int64          `json:"best_of"`
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
	echo         bool                   // prepend the prompt to the text (completions only)
	operation    string                 // gen_ai.operation.name: chat or text_completion
	ignored      []string               // fields accepted and ignored, sorted
	user         string                 // the OpenAI `user` field
}

// decodeBody unmarshals a JSON object into v and turns decoding failures
// into 400s that name the field.
func decodeBody(body []byte, v any) *apiError {
	trimmed := bytes.TrimSpace(body)
	if len(trimmed) == 0 {
		return badRequest("", "invalid_json", "request body is empty; expected a JSON object")
	}
	return decodeValue(trimmed, v, "")
}

// decodeValue unmarshals valid JSON into v. A type mismatch becomes a 400
// whose param is the field's path below param (`messages[1].role`), in
// JSON's words: encoding/json's own message names Go types.
func decodeValue(raw json.RawMessage, v any, param string) *apiError {
	err := json.Unmarshal(raw, v)
	if err == nil {
		return nil
	}
	var te *json.UnmarshalTypeError
	if !errors.As(err, &te) {
		// A syntax error: its text names no Go type.
		return badRequest(param, "invalid_json", "%s is not valid JSON: %v", orBody(param), err)
	}
	// encoding/json names the embedded struct in the path; clients do not
	// know it.
	field := strings.TrimPrefix(strings.TrimPrefix(te.Field, "samplingFields"), ".")
	switch {
	case field == "":
		field = param
	case param != "":
		field = param + "." + field
	}
	return badRequest(field, "invalid_type", "invalid type for %s: expected %s, got %s", orBody(field), jsonTypeName(te.Type), te.Value)
}

// orBody names a param in a message: "max_tokens" quoted, or "the request
// body" for the whole body.
func orBody(param string) string {
	if param == "" {
		return "the request body"
	}
	return strconv.Quote(param)
}

// jsonKind names the JSON type of a valid value by its first byte.
func jsonKind(raw []byte) string {
	t := bytes.TrimSpace(raw)
	if len(t) == 0 {
		return "nothing"
	}
	switch t[0] {
	case '{':
		return "an object"
	case '[':
		return "an array"
	case '"':
		return "a string"
	case 't', 'f':
		return "a boolean"
	case 'n':
		return "null"
	}
	return "a number"
}

// jsonTypeName names a Go type as JSON would.
func jsonTypeName(t reflect.Type) string {
	if t == nil {
		return "a value"
	}
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t == reflect.TypeFor[json.RawMessage]() {
		return "a value"
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

// ignoredFields lists the top-level fields of a valid JSON object that are
// set (not null) and not among used, sorted. body has already been decoded
// whole, so it is valid JSON: this only walks its top level, without
// decoding a second time (every completion request pays for it, and every
// chat request the fast decoder leaves to encoding/json). For a repeated
// key the last occurrence counts, as in encoding/json.
func ignoredFields(body []byte, used []string) []string {
	type field struct {
		key []byte // unquoted; a subslice of body unless it had escapes
		set bool
	}
	var buf [32]field // a request has a few top-level fields: no allocation
	fields := buf[:0]
	i := skipSpace(body, 0)
	if i >= len(body) || body[i] != '{' {
		return nil
	}
	i++
	for {
		i = skipSpace(body, i)
		if i >= len(body) || body[i] == '}' {
			break
		}
		end := skipString(body, i)
		raw := body[i:end]
		key := raw[1 : len(raw)-1]
		if bytes.IndexByte(raw, '\\') >= 0 {
			var k string
			if json.Unmarshal(raw, &k) != nil {
				return nil
			}
			key = []byte(k)
		}
		i = skipSpace(body, end)
		if i >= len(body) || body[i] != ':' {
			return nil
		}
		i = skipSpace(body, i+1)
		start := i
		i = skipValue(body, i)
		fields = append(fields, field{key: key, set: !isNull(body[start:i])})
		i = skipSpace(body, i)
		if i < len(body) && body[i] == ',' {
			i++
		}
	}
	// A repeated key counts by its last occurrence, as in encoding/json:
	// walk backwards and skip keys already seen. The few fields of a usual
	// request are compared pairwise (no allocation); more go through a
	// set, so a body of many fields costs time linear in its size.
	var seen map[string]struct{}
	if len(fields) > len(buf) {
		seen = make(map[string]struct{}, len(fields))
	}
	var out []string
	for n := len(fields) - 1; n >= 0; n-- {
		f := fields[n]
		if seen != nil {
			if _, dup := seen[string(f.key)]; dup {
				continue
			}
			seen[string(f.key)] = struct{}{}
		} else if slices.ContainsFunc(fields[n+1:], func(g field) bool { return bytes.Equal(g.key, f.key) }) {
			continue
		}
		if !f.set || slices.ContainsFunc(used, func(u string) bool { return u == string(f.key) }) {
			continue
		}
		out = append(out, string(f.key))
	}
	slices.Sort(out)
	return out
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// skipString returns the index after the JSON string that starts at i.
func skipString(b []byte, i int) int {
	for i++; i < len(b); i++ {
		switch b[i] {
		case '\\':
			i++
		case '"':
			return i + 1
		}
	}
	return len(b)
}

// skipValue returns the index after the JSON value that starts at i.
func skipValue(b []byte, i int) int {
	depth := 0
	for i < len(b) {
		switch b[i] {
		case '"':
			i = skipString(b, i)
			if depth == 0 {
				return i
			}
			continue
		case '{', '[':
			depth++
		case '}', ']':
			if depth == 0 {
				return i
			}
			depth--
			if depth == 0 {
				return i + 1
			}
		case ',':
			if depth == 0 {
				return i
			}
		case ' ', '\t', '\n', '\r':
			if depth == 0 {
				return i
			}
		}
		i++
	}
	return i
}

// parseChat validates a chat request for a pipeline serving model, with
// the default limits of media parts.
func parseChat(body []byte, model string) (job, *apiError) {
	return parseChatLimited(body, model, newPartBudget(0, 0))
}

// parseChatLimited is parseChat within the given limits of media parts.
func parseChatLimited(body []byte, model string, budget *partBudget) (job, *apiError) {
	var req chatRequest
	ignored, fast := decodeChatFast(body, &req)
	if !fast {
		req = chatRequest{}
		if e := decodeBody(body, &req); e != nil {
			return job{}, e
		}
		ignored = ignoredFields(body, chatFields)
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
	if j.prompt, j.messages, e = chatPrompt(req.Messages, budget); e != nil {
		return job{}, e
	}
	for i, raw := range req.Modalities {
		param := indexed("modalities", i)
		var m string
		if e := decodeValue(raw, &m, param); e != nil {
			return job{}, e
		}
		switch m {
		case "text":
		case "audio":
			j.audio = true
		default:
			return job{}, badRequest(param, "invalid_value", "unknown modality %q: expected \"text\" or \"audio\"", m)
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
	if req.Logprobs != nil && *req.Logprobs {
		return job{}, unsupported("logprobs", "logprobs are not supported: troupe's engines do not report them; leave \"logprobs\" unset or false")
	}
	if req.TopLogprobs != nil && *req.TopLogprobs != 0 {
		return job{}, unsupported("top_logprobs", "top_logprobs are not supported: troupe's engines do not report log probabilities")
	}
	for _, tc := range []struct {
		name string
		raw  json.RawMessage
	}{{"tool_choice", req.ToolChoice}, {"function_call", req.FunctionCall}} {
		if e := toolChoice(tc.name, tc.raw); e != nil {
			return job{}, e
		}
	}
	j.ignored = ignored
	return j, nil
}

// toolChoice accepts "none" and "auto": the model may answer without a
// tool call, which it always does. A choice that forces a call is refused,
// as troupe's models never call tools.
func toolChoice(param string, raw json.RawMessage) *apiError {
	if isNull(raw) {
		return nil
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		switch s {
		case "none", "auto":
			return nil
		case "required":
			return unsupported(param, "%s %q is not supported: troupe's models do not call tools; use \"auto\" or \"none\"", param, s)
		}
		return badRequest(param, "invalid_value", "unknown %s %q: expected \"none\", \"auto\" or \"required\"", param, s)
	}
	if bytes.TrimSpace(raw)[0] == '{' {
		return unsupported(param, "forcing a tool call with %s is not supported: troupe's models do not call tools; use \"auto\" or \"none\"", param)
	}
	return badRequest(param, "invalid_type", "invalid type for %q: expected a string or an object, got %s", param, jsonKind(raw))
}

func unsupported(param, format string, args ...any) *apiError {
	return badRequest(param, "unsupported", format, args...)
}

// indexedParams are "messages[0]" and the like for the first indices: a
// request's param paths are built for every element, and are only shown
// when something is wrong.
var indexedParams = func() map[string][]string {
	m := map[string][]string{}
	for _, name := range []string{"messages", "modalities"} {
		for i := range 16 {
			m[name] = append(m[name], name+"["+strconv.Itoa(i)+"]")
		}
	}
	return m
}()

// indexed is the param path of element i of the array field name.
func indexed(name string, i int) string {
	if ps := indexedParams[name]; i < len(ps) {
		return ps[i]
	}
	return name + "[" + strconv.Itoa(i) + "]"
}

// chatPrompt renders messages as the stage-0 prompt: one "role: content"
// line per message, joined by "\n"; the text parts of an array content are
// joined by "\n". The rendering is deterministic, so the same conversation
// always yields the same output from a seeded engine. It also returns the
// messages as the protocol carries them (the same contents), for engines
// that apply their own chat template.
func chatPrompt(msgs []json.RawMessage, budget *partBudget) (string, []*stagepb.ChatMessage, *apiError) {
	var b strings.Builder
	out := make([]*stagepb.ChatMessage, 0, len(msgs))
	for i, raw := range msgs {
		param := indexed("messages", i)
		var m chatMessage
		if t := bytes.TrimSpace(raw); t[0] != '{' {
			return "", nil, badRequest(param, "invalid_type", "invalid type for %q: expected an object, got %s", param, jsonKind(t))
		}
		if !decodeMessageFast(raw, &m) {
			m = chatMessage{}
			if e := decodeValue(raw, &m, param); e != nil {
				return "", nil, e
			}
		}
		if m.Role == nil {
			return "", nil, badRequest(param+".role", "missing_field", "missing required field %q", param+".role")
		}
		switch *m.Role {
		case "system", "developer", "user", "assistant", "tool", "function":
		default:
			return "", nil, badRequest(param+".role", "invalid_value", "unknown role %q: expected system, developer, user, assistant, tool or function", *m.Role)
		}
		text, parts, e := messageContent(param+".content", m.Content, budget)
		if e != nil {
			return "", nil, e
		}
		out = append(out, &stagepb.ChatMessage{Role: *m.Role, Content: text, Parts: parts})
		if i > 0 {
			b.WriteByte('\n')
		}
		b.WriteString(*m.Role)
		b.WriteString(": ")
		b.WriteString(text)
	}
	return b.String(), out, nil
}

// messageContent flattens a message content: a string, null (an assistant
// turn that only called tools), or an array of content parts (content.go),
// whose text parts are joined by "\n" and which are returned in order when
// one of them is media.
func messageContent(param string, raw json.RawMessage, budget *partBudget) (string, []*stagepb.ContentPart, *apiError) {
	if isNull(raw) {
		return "", nil, nil
	}
	switch t := bytes.TrimSpace(raw); t[0] {
	case '"':
		// raw is valid JSON (the body was decoded): a string without
		// escapes is its bytes, which encoding/json would also keep as
		// they are when they are valid UTF-8.
		if inner := t[1 : len(t)-1]; bytes.IndexByte(inner, '\\') < 0 && utf8.Valid(inner) {
			return string(inner), nil, nil
		}
		var s string
		if e := decodeValue(raw, &s, param); e != nil {
			return "", nil, e
		}
		return s, nil, nil
	case '[':
		return contentParts(param, raw, budget)
	}
	return "", nil, badRequest(param, "invalid_type", "invalid type for %q: expected a string or an array of content parts, got %s", param, jsonKind(raw))
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
			return badRequest("audio.voice", "invalid_type", "invalid type for \"audio.voice\": expected a string or an object, got %s", jsonKind(a.Voice))
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
	if req.Echo != nil {
		j.echo = *req.Echo
	}
	if req.Logprobs != nil {
		return job{}, unsupported("logprobs", "logprobs are not supported: troupe's engines do not report them; leave \"logprobs\" unset")
	}
	if req.Suffix != nil && *req.Suffix != "" {
		return job{}, unsupported("suffix", "suffix is not supported: troupe's engines only append to the prompt")
	}
	if req.BestOf != nil && *req.BestOf != 1 {
		if *req.BestOf > 1 {
			return job{}, unsupported("best_of", "best_of=%d is not supported: troupe generates one completion per request (best_of must be 1)", *req.BestOf)
		}
		return job{}, badRequest("best_of", "invalid_value", "best_of must be 1, got %d", *req.BestOf)
	}
	j.ignored = ignoredFields(body, completionFields)
	return j, nil
}

// completionPrompt accepts a string, or an array holding one string.
// Batches and token-id prompts are refused: one request is one pipeline
// run, and the pipeline takes text.
func completionPrompt(raw json.RawMessage) (string, *apiError) {
	if isNull(raw) {
		return "", badRequest("prompt", "missing_field", "missing required field \"prompt\"")
	}
	t := bytes.TrimSpace(raw)
	switch t[0] {
	case '"':
		var s string
		if e := decodeValue(t, &s, "prompt"); e != nil {
			return "", e
		}
		return s, nil
	case '[':
	default:
		return "", badRequest("prompt", "invalid_type", "invalid type for \"prompt\": expected a string or an array of one string, got %s", jsonKind(t))
	}
	var arr []json.RawMessage
	if e := decodeValue(t, &arr, "prompt"); e != nil {
		return "", e
	}
	if len(arr) == 0 {
		return "", badRequest("prompt", "invalid_value", "\"prompt\" is an empty array: send the prompt as a string")
	}
	// OpenAI's prompt forms: "text", ["text", ...], [1, 2, 3] (one prompt
	// of token ids), [[1, 2], [3]] (prompts of token ids).
	switch first := bytes.TrimSpace(arr[0]); first[0] {
	case '"':
		if len(arr) > 1 {
			return "", unsupported("prompt", "\"prompt\" holds %d prompts: batched prompts are not supported, send one request per prompt", len(arr))
		}
		var s string
		if e := decodeValue(arr[0], &s, "prompt[0]"); e != nil {
			return "", e
		}
		return s, nil
	case '[':
		if len(arr) > 1 {
			return "", unsupported("prompt", "\"prompt\" holds %d prompts of token ids: batched prompts and token-id prompts are not supported, send one request per prompt, as text", len(arr))
		}
		var ids []int64
		if e := decodeValue(arr[0], &ids, "prompt[0]"); e != nil {
			return "", e
		}
		return "", unsupported("prompt", "\"prompt\" is one prompt of %d token ids: token-id prompts are not supported, send the prompt as text", len(ids))
	}
	for i, el := range arr {
		var id int64
		if e := decodeValue(el, &id, fmt.Sprintf("prompt[%d]", i)); e != nil {
			return "", e
		}
	}
	return "", unsupported("prompt", "\"prompt\" is one prompt of %d token ids: token-id prompts are not supported, send the prompt as text", len(arr))
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
	// Both bound the answer: the smaller wins.
	if f.MaxTokens != nil {
		sp.MaxTokens = uint32(*f.MaxTokens)
	}
	if m := f.MaxCompletionTokens; m != nil && (f.MaxTokens == nil || *m <= *f.MaxTokens) {
		sp.MaxTokens = uint32(*m)
		sp.MaxCompletionTokens = true
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
	if e := f.knobs(sp); e != nil {
		return job{}, e
	}
	if e := f.refuseUnsupported(); e != nil {
		return job{}, e
	}
	j := job{model: model, sampling: sp}
	if f.User != nil {
		j.user = *f.User
	}
	if f.Stream != nil {
		j.stream = *f.Stream
	}
	if f.StreamOptions != nil && f.StreamOptions.IncludeUsage != nil {
		j.includeUsage = *f.StreamOptions.IncludeUsage
	}
	return j, nil
}

// knobs checks the sampling knobs against the ranges OpenAI and vLLM
// accept and sets those the client sent on sp.
func (f *samplingFields) knobs(sp *stagepb.SamplingParams) *apiError {
	for _, k := range []struct {
		name   string
		v      *float64
		lo, hi float64
		loOpen bool // lo itself is out of range
		dst    **float32
	}{
		{"top_p", f.TopP, 0, 1, true, &sp.TopP},
		{"min_p", f.MinP, 0, 1, false, &sp.MinP},
		{"frequency_penalty", f.FrequencyPenalty, -2, 2, false, &sp.FrequencyPenalty},
		{"presence_penalty", f.PresencePenalty, -2, 2, false, &sp.PresencePenalty},
		{"repetition_penalty", f.RepetitionPenalty, 0, math.MaxFloat32, true, &sp.RepetitionPenalty},
	} {
		if k.v == nil {
			continue
		}
		v := *k.v
		switch {
		case k.loOpen && (v <= k.lo || v > k.hi):
			return badRequest(k.name, "invalid_value", "%s must be greater than %g and at most %g, got %g", k.name, k.lo, k.hi, v)
		case v < k.lo || v > k.hi:
			return badRequest(k.name, "invalid_value", "%s must be between %g and %g, got %g", k.name, k.lo, k.hi, v)
		}
		f32 := float32(v)
		*k.dst = &f32
	}
	if f.TopK != nil {
		if k := *f.TopK; k < -1 || k > MaxTokensLimit {
			return badRequest("top_k", "invalid_value", "top_k must be -1 (off), 0 (off) or a positive number of tokens, got %d", k)
		}
		k := int32(*f.TopK)
		sp.TopK = &k
	}
	if f.MinTokens != nil {
		if n := *f.MinTokens; n < 0 || n > MaxTokensLimit {
			return badRequest("min_tokens", "invalid_value", "min_tokens must be between 0 and %d, got %d", MaxTokensLimit, n)
		}
		sp.MinTokens = uint32(*f.MinTokens)
	}
	if !isNull(f.LogitBias) {
		var bias map[string]float64
		if err := json.Unmarshal(f.LogitBias, &bias); err != nil {
			return badRequest("logit_bias", "invalid_type", "invalid type for \"logit_bias\": expected an object of token ids to numbers")
		}
		sp.LogitBias = make(map[string]float32, len(bias))
		for id, b := range bias {
			if _, err := strconv.ParseUint(id, 10, 32); err != nil {
				return badRequest("logit_bias", "invalid_value", "logit_bias key %q is not a token id", id)
			}
			if b < -100 || b > 100 {
				return badRequest("logit_bias", "invalid_value", "logit_bias of token %s must be between -100 and 100, got %g", id, b)
			}
			sp.LogitBias[id] = float32(b)
		}
	}
	return nil
}

// stopSequences accepts null, a string, or an array of strings.
func stopSequences(raw json.RawMessage) ([]string, *apiError) {
	if isNull(raw) {
		return nil, nil
	}
	t := bytes.TrimSpace(raw)
	switch t[0] {
	case '"':
		var one string
		if e := decodeValue(t, &one, "stop"); e != nil {
			return nil, e
		}
		if one == "" {
			return nil, badRequest("stop", "invalid_value", "stop sequences must not be empty")
		}
		return []string{one}, nil
	case '[':
	default:
		return nil, badRequest("stop", "invalid_type", "invalid type for \"stop\": expected a string or an array of strings, got %s", jsonKind(t))
	}
	var many []json.RawMessage
	if e := decodeValue(t, &many, "stop"); e != nil {
		return nil, e
	}
	out := make([]string, 0, len(many))
	for i, el := range many {
		param := fmt.Sprintf("stop[%d]", i)
		var s string
		if e := decodeValue(el, &s, param); e != nil {
			return nil, e
		}
		if s == "" {
			return nil, badRequest(param, "invalid_value", "stop sequences must not be empty")
		}
		out = append(out, s)
	}
	if len(out) == 0 {
		return nil, nil
	}
	return out, nil
}

// refuseUnsupported refuses the shared fields that ask for output troupe
// cannot give, where ignoring them would hand the client something else
// than it parses for.
func (f *samplingFields) refuseUnsupported() *apiError {
	if rf := f.ResponseFormat; rf != nil {
		switch {
		case rf.Type == nil:
			return badRequest("response_format.type", "missing_field", "missing required field \"response_format.type\"")
		case *rf.Type == "text":
		case *rf.Type == "json_object" || *rf.Type == "json_schema":
			return unsupported("response_format", "response_format %q is not supported: troupe's engines cannot constrain their output; use \"text\"", *rf.Type)
		default:
			return badRequest("response_format.type", "invalid_value", "unknown response_format type %q: expected \"text\", \"json_object\" or \"json_schema\"", *rf.Type)
		}
	}
	if !isNull(f.PromptLogprobs) {
		return unsupported("prompt_logprobs", "prompt_logprobs are not supported: troupe's engines do not report log probabilities")
	}
	return nil
}
