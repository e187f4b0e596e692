package httpapi

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/telemetry"
)

// speechRequest is the body of POST /v1/audio/speech (OpenAI's). Other
// fields (instructions, …) are accepted, ignored and reported.
type speechRequest struct {
	Model          *string         `json:"model"`
	Input          *string         `json:"input"`
	Voice          json.RawMessage `json:"voice"` // a name, or {"id": "..."}
	ResponseFormat *string         `json:"response_format"`
	Speed          *float64        `json:"speed"`
	StreamFormat   *string         `json:"stream_format"`
}

var speechFields = decoderFor[speechRequest]().names

// The speech endpoint's response formats and stream formats.
const (
	speechWAV         = "wav"
	speechPCM         = "pcm"
	streamFormatAudio = "audio"
	streamFormatSSE   = "sse"
)

// speechJob is a parsed speech request.
type speechJob struct {
	input, voice, format string
	sse                  bool
	ignored              []string
}

// parseSpeech validates a speech request for a pipeline serving model.
func parseSpeech(body []byte, model string) (speechJob, *apiError) {
	var req speechRequest
	if e := decodeBody(body, &req); e != nil {
		return speechJob{}, e
	}
	switch {
	case req.Model == nil || *req.Model == "":
		return speechJob{}, badRequest("model", "missing_field", "missing required field \"model\"")
	case *req.Model != model:
		return speechJob{}, notFound("model", "model_not_found", "the model %q does not exist; this server serves %q", *req.Model, model)
	case req.Input == nil:
		return speechJob{}, badRequest("input", "missing_field", "missing required field \"input\"")
	case *req.Input == "":
		return speechJob{}, badRequest("input", "invalid_value", "\"input\" is empty: give the text to speak")
	}
	j := speechJob{input: *req.Input, format: speechWAV, ignored: ignoredFields(body, speechFields)}
	if !isNull(req.Voice) {
		voice := &audioParam{Voice: req.Voice}
		if e := voice.validate(); e != nil {
			e.Param = "voice"
			e.Message = "invalid \"voice\": expected a voice name or an object with a string \"id\""
			return speechJob{}, e
		}
		j.voice = voice.voiceName()
	}
	if f := req.ResponseFormat; f != nil {
		switch *f {
		case speechWAV, speechPCM:
			j.format = *f
		default:
			return speechJob{}, unsupported("response_format", "response_format %q is not supported: \"wav\" (the default) and \"pcm\" (raw PCM16 mono little-endian at the pipeline's sample rate) are", *f)
		}
	}
	if sp := req.Speed; sp != nil && *sp != 1 {
		if *sp < 0.25 || *sp > 4 {
			return speechJob{}, badRequest("speed", "invalid_value", "speed must be between 0.25 and 4, got %g", *sp)
		}
		return speechJob{}, unsupported("speed", "speed %g is not supported: the speech stages speak at their own rate; omit \"speed\" or send 1", *sp)
	}
	if sf := req.StreamFormat; sf != nil {
		switch *sf {
		case streamFormatAudio:
		case streamFormatSSE:
			if j.format != speechPCM {
				return speechJob{}, unsupported("stream_format", "stream_format \"sse\" sends raw samples: set \"response_format\": \"pcm\" with it")
			}
			j.sse = true
		default:
			return speechJob{}, badRequest("stream_format", "invalid_value", "unknown stream_format %q: expected \"audio\" or \"sse\"", *sf)
		}
	}
	return j, nil
}

// speech serves POST /v1/audio/speech: the pipeline's audio stages speak
// the input as if the text stage had written it (orchestrator
// Request.Speech). pcm streams the samples as they come, as the body
// (stream_format audio) or as speech.audio.delta events (sse); wav answers
// one WAV file once the audio is whole. Nothing is written before the
// first audio, so an earlier failure is an ordinary error response.
func (s *Server) speech(w http.ResponseWriter, r *http.Request) {
	body, e := s.readBody(r)
	if e != nil {
		s.reject(w, r, e)
		return
	}
	j, e := parseSpeech(body, s.b.Pipeline().Model)
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
	req := orchestrator.Request{ID: id, Prompt: j.input, Voice: j.voice, Sampling: &stagepb.SamplingParams{}, Speech: true,
		Operation: telemetry.GenAIOperationGenerateContent, SessionKey: s.sessionKey(r, job{}), Received: receivedAt(w)}
	if req.Deadline, e = deadlineOf(r); e != nil {
		s.reject(w, r, e)
		return
	}
	var stream *sseWriter
	started := false
	if j.format == speechPCM {
		rc := http.NewResponseController(w)
		stream = &sseWriter{w: w, rc: rc, timeout: s.cfg.WriteStallTimeout}
		req.OnAudio = func(pcm []byte, rate int) error {
			if j.sse {
				if !stream.started {
					w.Header().Set(sampleRateHeader, strconv.Itoa(rate))
					stream.writeHeader()
				}
				if err := stream.send(speechEvent{Type: "speech.audio.delta", Audio: base64.StdEncoding.EncodeToString(pcm)}); err != nil {
					return err
				}
				return stream.flush()
			}
			if !started {
				started = true
				w.Header().Set("Content-Type", "audio/pcm")
				w.Header().Set("Trailer", errorTrailer)
				w.Header().Set(sampleRateHeader, strconv.Itoa(rate))
				w.WriteHeader(http.StatusOK)
			}
			_ = rc.SetWriteDeadline(time.Now().Add(s.cfg.WriteStallTimeout))
			if _, err := w.Write(pcm); err != nil {
				stream.broken = true
				return err
			}
			return rc.Flush()
		}
	}
	res, err := s.b.Execute(ctx, req, nil)
	if err == nil && res.AudioBytes() == 0 {
		err = errNoAudio
	}
	switch {
	case err != nil && started:
		// A raw stream can only say it failed in its trailer.
		e := fromBackend(err, id)
		s.log.WarnContext(r.Context(), "httpapi: speech failed after its audio began", "request_id", id, "code", e.Code, "err", err)
		w.Header().Set(errorTrailer, e.Code+": "+e.Message)
	case err != nil:
		if ae := fromBackend(err, id); ae.Param == "audio.voice" {
			ae.Param = "voice"
			err = ae
		}
		s.fail(w, r, stream, err)
	case j.sse:
		u := &speechUsage{InputTokens: res.PromptTokens, OutputTokens: res.CompletionTokens, TotalTokens: res.PromptTokens + res.CompletionTokens}
		if stream.send(speechEvent{Type: "speech.audio.done", Usage: u}) == nil {
			_ = stream.flush()
		}
	case j.format == speechWAV:
		wav, err := appendWAV(nil, res.PCM, res.SampleRate)
		if err != nil {
			s.fail(w, r, nil, err)
			return
		}
		w.Header().Set("Content-Type", "audio/wav")
		w.Header().Set("Content-Length", strconv.Itoa(len(wav)))
		extendWriteDeadline(w, s.cfg.WriteStallTimeout)
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write(wav)
	}
}

// errorTrailer is the trailer of a raw PCM answer that failed after its
// audio began: "<code>: <message>".
const errorTrailer = "X-Troupe-Error"

// sampleRateHeader tells the client of raw PCM its sample rate (24 kHz
// for the sim, 22,050 Hz for espeak): the samples cannot.
const sampleRateHeader = "X-Audio-Sample-Rate"

// speechEvent is an SSE event of a streamed speech answer.
type speechEvent struct {
	Type  string       `json:"type"`
	Audio string       `json:"audio,omitempty"`
	Usage *speechUsage `json:"usage,omitempty"`
}

type speechUsage struct {
	InputTokens  int `json:"input_tokens"`
	OutputTokens int `json:"output_tokens"`
	TotalTokens  int `json:"total_tokens"`
}
