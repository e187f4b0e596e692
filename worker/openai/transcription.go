package openai

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"net/textproto"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// TranscriptionEngine is a speech recognition stage served by an
// upstream's OpenAI transcription API (POST /v1/audio/transcriptions:
// vLLM with a Whisper model, OpenAI): the audio parts of a conversation
// in, their transcript out. Run must be running for it to become
// available.
type TranscriptionEngine struct {
	*upstream
}

// NewTranscription builds the engine; it sends nothing until Run or
// Generate.
func NewTranscription(cfg Config) (*TranscriptionEngine, error) {
	u, err := newUpstream(cfg)
	if err != nil {
		return nil, err
	}
	return &TranscriptionEngine{upstream: u}, nil
}

// Health reports a speech recognition stage: audio in (with its bytes),
// text out.
func (e *TranscriptionEngine) Health() *stagepb.HealthResponse {
	h := e.health(TranscriptionEngineName, stagepb.RoleText)
	h.InputRole, h.InputParts = stagepb.RoleAudio, []string{stagepb.PartAudio}
	return h
}

// maxAnswerBytes bounds the upstream's transcription answer, so that an
// upstream cannot make the worker buffer without bound.
const maxAnswerBytes = 8 << 20

// transcriptionAnswer is the upstream's json answer.
type transcriptionAnswer struct {
	Text  string `json:"text"`
	Usage *struct {
		InputTokens  uint64 `json:"input_tokens"`
		OutputTokens uint64 `json:"output_tokens"`
	} `json:"usage"`
}

// Generate transcribes the input's audio part (the last one with bytes)
// with the text parts as the prompt and the request's language: one
// upstream request (response_format json), whose text is one chunk.
func (e *TranscriptionEngine) Generate(ctx context.Context, req *stagepb.GenerateRequest, emit func(*stagepb.GenerateChunk) error) error {
	if err := e.admit(); err != nil {
		return err
	}
	var audio *stagepb.ContentPart
	var prompt []string
	for _, m := range req.GetChat().GetMessages() {
		for _, p := range m.GetParts() {
			switch {
			case p.GetKind() == stagepb.PartText:
				prompt = append(prompt, p.GetText())
			case p.GetKind() == stagepb.PartAudio && len(p.GetData()) > 0:
				audio = p
			}
		}
	}
	if audio == nil {
		return status.Error(codes.InvalidArgument, "speech recognition needs audio: the input has no audio part with its bytes")
	}
	body, contentType, err := transcriptionForm(e.Model(), audio, strings.Join(prompt, "\n"), req.GetLanguage())
	if err != nil {
		return status.Errorf(codes.Internal, "openai: encode transcription form: %v", err)
	}
	start := time.Now()
	hreq, err := e.newRequest(ctx, http.MethodPost, e.base+"/audio/transcriptions", bytes.NewReader(body))
	if err != nil {
		return err
	}
	hreq.Header.Set("Content-Type", contentType)
	resp, err := e.do(hreq)
	if err != nil {
		return err
	}
	defer closeBody(resp)
	if resp.StatusCode != http.StatusOK {
		return statusError(resp)
	}
	var ans transcriptionAnswer
	if err := json.NewDecoder(io.LimitReader(resp.Body, maxAnswerBytes)).Decode(&ans); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return status.Errorf(codes.Unavailable, "openai: upstream transcription answer unreadable: %v", err)
	}
	done := time.Since(start).Seconds()
	stats := e.gauges()
	if ans.Usage != nil {
		stats.PromptTokens, stats.GenerationTokens, stats.PromptAudioTokens = ans.Usage.InputTokens, ans.Usage.OutputTokens, ans.Usage.InputTokens
		stats.PromptTokensLocalCompute = ans.Usage.InputTokens
	}
	e.takeCounters(stats)
	if ans.Text != "" {
		if err := emit(&stagepb.GenerateChunk{Text: ans.Text, Stats: e.gauges()}); err != nil {
			return err
		}
	}
	return emit(&stagepb.GenerateChunk{FinishReason: stagepb.FinishReason_FINISH_REASON_STOP, Stats: stats,
		Timings: &stagepb.Timings{PrefillSeconds: done}})
}

// transcriptionForm is the multipart body of a transcription: the audio as
// file audio.<format> (wav when the format is unknown) with its media type
// (servers that sniff by it refuse application/octet-stream), the model,
// and the prompt and language when given.
func transcriptionForm(model string, audio *stagepb.ContentPart, prompt, language string) ([]byte, string, error) {
	var b bytes.Buffer
	mw := multipart.NewWriter(&b)
	format := audio.GetFormat()
	if format == "" || strings.ContainsAny(format, "/\\\"\r\n") {
		format = "wav"
	}
	h := make(textproto.MIMEHeader)
	h.Set("Content-Disposition", fmt.Sprintf(`form-data; name="file"; filename="audio.%s"`, format))
	h.Set("Content-Type", audioMediaType(audio.GetMimeType(), format))
	fw, err := mw.CreatePart(h)
	if err != nil {
		return nil, "", err
	}
	if _, err := fw.Write(audio.GetData()); err != nil {
		return nil, "", err
	}
	for _, f := range [][2]string{{"model", model}, {"response_format", "json"}, {"prompt", prompt}, {"language", language}} {
		if f[1] == "" {
			continue
		}
		if err := mw.WriteField(f[0], f[1]); err != nil {
			return nil, "", err
		}
	}
	if err := mw.Close(); err != nil {
		return nil, "", err
	}
	return b.Bytes(), mw.FormDataContentType(), nil
}

// audioMediaType is the media type of audio in format: the client's own
// (a data: URL's) when it gave one, else the format's, else
// application/octet-stream.
func audioMediaType(given, format string) string {
	if given != "" && !strings.ContainsAny(given, "\r\n") {
		return given
	}
	switch format {
	case "wav":
		return "audio/wav"
	case "mp3":
		return "audio/mpeg"
	case "pcm16":
		return "audio/L16"
	case "m4a", "aac":
		return "audio/mp4"
	case "flac", "ogg", "opus", "webm":
		return "audio/" + format
	}
	return "application/octet-stream"
}
