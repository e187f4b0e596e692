package httpapi

import (
	"bytes"
	"context"
	"errors"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"path"
	"slices"
	"strconv"
	"strings"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/telemetry"
)

// maxFormParts bounds the parts of a transcription form: OpenAI's form has
// a few fields; thousands of empty parts are an attack on the parser.
const maxFormParts = 64

// transcriptionJob is a parsed transcription request.
type transcriptionJob struct {
	model, language, prompt, format string
	audio                           []byte
	audioFormat                     string // the file's extension: wav, mp3, ...
	stream                          bool
	ignored                         []string
}

// parseTranscription reads a multipart/form-data transcription request
// from body, whose Content-Type is contentType: the fields file, model,
// language, prompt, response_format and stream; any other field is
// accepted, ignored and reported.
func parseTranscription(body []byte, contentType, model string, maxFileBytes int64) (transcriptionJob, *apiError) {
	mt, params, err := mime.ParseMediaType(contentType)
	if err != nil || mt != "multipart/form-data" || params["boundary"] == "" {
		return transcriptionJob{}, badRequest("", "invalid_body", "expected a multipart/form-data body with a boundary (OpenAI's transcription form), got Content-Type %q", contentType)
	}
	j := transcriptionJob{format: "json"}
	seen := map[string]bool{}
	mr := multipart.NewReader(bytes.NewReader(body), params["boundary"])
	for n := 0; ; n++ {
		p, err := mr.NextPart()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return transcriptionJob{}, badRequest("", "invalid_body", "the multipart body is malformed: %v", err)
		}
		if n == maxFormParts {
			return transcriptionJob{}, badRequest("", "invalid_body", "the form holds more than %d parts", maxFormParts)
		}
		name := p.FormName()
		data, err := io.ReadAll(p)
		if err != nil {
			return transcriptionJob{}, badRequest(name, "invalid_body", "the multipart body is malformed: %v", err)
		}
		if seen[name] {
			return transcriptionJob{}, badRequest(name, "invalid_value", "the form field %q is sent twice", name)
		}
		seen[name] = true
		switch name {
		case "file":
			if p.FileName() == "" {
				return transcriptionJob{}, badRequest("file", "invalid_type", "\"file\" must be a file upload (a form part with a filename)")
			}
			j.audio, j.audioFormat = data, strings.ToLower(strings.TrimPrefix(path.Ext(p.FileName()), "."))
		case "model":
			j.model = string(data)
		case "language":
			j.language = string(data)
		case "prompt":
			j.prompt = string(data)
		case "response_format":
			j.format = string(data)
		case "stream":
			b, err := strconv.ParseBool(string(data))
			if err != nil {
				return transcriptionJob{}, badRequest("stream", "invalid_type", "invalid type for \"stream\": expected true or false, got %q", data)
			}
			j.stream = b
		default:
			if name != "" && len(data) > 0 && !slices.Contains(j.ignored, name) {
				j.ignored = append(j.ignored, name)
			}
		}
	}
	switch {
	case j.model == "":
		return transcriptionJob{}, badRequest("model", "missing_field", "missing required field \"model\"")
	case j.model != model:
		return transcriptionJob{}, notFound("model", "model_not_found", "the model %q does not exist; this server serves %q", j.model, model)
	case !seen["file"]:
		return transcriptionJob{}, badRequest("file", "missing_field", "missing required field \"file\"")
	case len(j.audio) == 0:
		return transcriptionJob{}, badRequest("file", "invalid_value", "\"file\" is empty")
	case int64(len(j.audio)) > maxFileBytes:
		return transcriptionJob{}, &apiError{Status: http.StatusRequestEntityTooLarge, Type: typeInvalidRequest, Code: "request_too_large", Param: "file",
			Message: "\"file\" holds " + strconv.Itoa(len(j.audio)) + " bytes, over the limit of " + strconv.FormatInt(maxFileBytes, 10) + " bytes per media part"}
	case j.format != "json" && j.format != "text":
		return transcriptionJob{}, unsupported("response_format", "response_format %q is not supported: \"json\" (the default) and \"text\" are", j.format)
	}
	if err := checkAudio(j.audioFormat, j.audio); err != nil {
		return transcriptionJob{}, invalidAudio("file", err)
	}
	slices.Sort(j.ignored)
	return j, nil
}

// transcriptions serves POST /v1/audio/transcriptions: stage 0, a speech
// recognizer, transcribes the file (orchestrator Request.Transcribe).
func (s *Server) transcriptions(w http.ResponseWriter, r *http.Request) {
	body, e := s.readBody(r)
	if e != nil {
		s.reject(w, r, e)
		return
	}
	maxFile := s.cfg.MaxPartBytes
	if maxFile <= 0 {
		maxFile = DefaultMaxPartBytes
	}
	j, e := parseTranscription(body, r.Header.Get("Content-Type"), s.b.Pipeline().Model, maxFile)
	if e != nil {
		s.reject(w, r, e)
		return
	}
	if len(j.ignored) > 0 {
		w.Header().Set(ignoredHeader, strings.Join(j.ignored, ", "))
	}
	ctx, cancel := context.WithTimeout(r.Context(), s.cfg.RequestTimeout)
	defer cancel()
	id := requestIDFrom(r.Context())
	parts := []*stagepb.ContentPart{{Kind: stagepb.PartAudio, Data: j.audio, Format: j.audioFormat}}
	if j.prompt != "" {
		parts = append([]*stagepb.ContentPart{{Kind: stagepb.PartText, Text: j.prompt}}, parts...)
	}
	req := orchestrator.Request{ID: id, Prompt: j.prompt, Messages: []*stagepb.ChatMessage{{Role: "user", Content: j.prompt, Parts: parts}},
		Sampling: &stagepb.SamplingParams{}, Stages: 1, Transcribe: true, Language: j.language,
		Operation: telemetry.GenAIOperationGenerateContent, SessionKey: s.sessionKey(r, job{})}
	var stream *sseWriter
	var onText func(string) error
	if j.stream {
		stream = &sseWriter{w: w, rc: http.NewResponseController(w), timeout: s.cfg.WriteStallTimeout}
		onText = func(delta string) error {
			if delta == "" {
				return nil
			}
			if !stream.started {
				stream.writeHeader()
			}
			if err := stream.send(transcriptEvent{Type: "transcript.text.delta", Delta: delta}); err != nil {
				return err
			}
			return stream.flush()
		}
	}
	res, err := s.b.Execute(ctx, req, onText)
	if err != nil {
		s.fail(w, r, stream, err)
		return
	}
	u := &transcriptUsage{Type: "tokens", InputTokens: res.PromptTokens, OutputTokens: res.CompletionTokens, TotalTokens: res.PromptTokens + res.CompletionTokens}
	switch {
	case j.stream:
		if !stream.started {
			stream.writeHeader()
		}
		if stream.send(transcriptEvent{Type: "transcript.text.done", Text: res.Text, Usage: u}) == nil {
			_ = stream.flush()
		}
	case j.format == "text":
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		extendWriteDeadline(w, s.cfg.WriteStallTimeout)
		w.WriteHeader(http.StatusOK)
		_, _ = io.WriteString(w, res.Text)
	default:
		extendWriteDeadline(w, s.cfg.WriteStallTimeout)
		writeJSON(w, http.StatusOK, &transcription{Text: res.Text, Usage: u})
	}
}

// transcription is the json answer of a transcription, as OpenAI's.
type transcription struct {
	Text  string           `json:"text"`
	Usage *transcriptUsage `json:"usage"`
}

type transcriptUsage struct {
	Type         string `json:"type"`
	InputTokens  int    `json:"input_tokens"`
	OutputTokens int    `json:"output_tokens"`
	TotalTokens  int    `json:"total_tokens"`
}

// transcriptEvent is an SSE event of a streamed transcription.
type transcriptEvent struct {
	Type  string           `json:"type"`
	Delta string           `json:"delta,omitempty"`
	Text  string           `json:"text,omitempty"`
	Usage *transcriptUsage `json:"usage,omitempty"`
}
