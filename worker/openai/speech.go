package openai

import (
	"context"
	"errors"
	"io"
	"net/http"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker/internal/wav"
)

// speechChunkBytes bounds the audio of one chunk: about 0.7 s at 24 kHz.
const speechChunkBytes = 32 << 10

// SpeechEngine is a speech stage served by an upstream's OpenAI speech
// API (POST /v1/audio/speech): text in, PCM16 mono audio out, streamed as
// the upstream sends it. Run must be running for it to become available.
type SpeechEngine struct {
	*upstream
}

// NewSpeech builds the engine; it sends nothing until Run or Generate.
func NewSpeech(cfg Config) (*SpeechEngine, error) {
	u, err := newUpstream(cfg)
	if err != nil {
		return nil, err
	}
	return &SpeechEngine{upstream: u}, nil
}

// Health reports a speech stage (text in, audio out).
func (e *SpeechEngine) Health() *stagepb.HealthResponse {
	return e.health(SpeechEngineName, stagepb.RoleAudio)
}

type speechRequest struct {
	Model          string `json:"model"`
	Input          string `json:"input"`
	Voice          string `json:"voice,omitempty"`
	ResponseFormat string `json:"response_format"`
	// StreamFormat "audio" asks for the audio bytes as they are made
	// (OpenAI's default; vLLM-Omni streams only when asked).
	StreamFormat string `json:"stream_format"`
}

// ContinuesInput: in a streaming pipeline the speech stage asks the TTS
// server for each sentence as soon as the stage before has written it,
// instead of waiting for the whole text (worker.Continuer).
func (e *SpeechEngine) ContinuesInput() bool { return true }

// SegmentsBySentence: segments end at sentence ends, so no sentence is
// spoken with a break in it (worker.SentenceSegmenter).
func (e *SpeechEngine) SegmentsBySentence() bool { return true }

// Generate speaks the request's text (its text input, or the last chat
// message) with its voice (the configured one when it names none; none at
// all leaves the choice to the upstream) and streams the audio as it
// arrives (stream_format audio). Empty text gives no audio. A response
// cut short is an Unavailable error.
func (e *SpeechEngine) Generate(ctx context.Context, req *stagepb.GenerateRequest, emit func(*stagepb.GenerateChunk) error) error {
	if err := e.admit(); err != nil {
		return err
	}
	defer e.track()()
	text, ok := req.SpeechText()
	if !ok {
		return status.Errorf(codes.InvalidArgument, "openai: a speech stage takes text or chat input, got %T", req.GetInput())
	}
	start := time.Now()
	if text == "" {
		return emit(&stagepb.GenerateChunk{FinishReason: stagepb.FinishReason_FINISH_REASON_STOP, Stats: e.gauges(), Timings: &stagepb.Timings{}})
	}
	voice := req.GetVoice()
	if voice == "" {
		voice = e.cfg.Voice
	}
	resp, err := e.postJSON(ctx, "/audio/speech", speechRequest{Model: e.Model(), Input: text, Voice: voice, ResponseFormat: e.cfg.SpeechFormat, StreamFormat: "audio"})
	if err != nil {
		return err
	}
	defer closeBody(resp)
	if resp.StatusCode != http.StatusOK {
		return statusError(resp)
	}
	var r *wav.Reader
	if e.cfg.SpeechFormat == "pcm" {
		r = wav.NewRawReader(resp.Body, e.cfg.PCMSampleRate)
	} else if r, err = wav.NewReader(resp.Body); err != nil {
		return e.readError(ctx, err)
	}
	var first, last time.Time
	for {
		pcm, err := r.Next(speechChunkBytes)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return e.readError(ctx, err)
		}
		last = time.Now()
		if first.IsZero() {
			first = last
		}
		if err := emit(&stagepb.GenerateChunk{AudioPcm16: pcm, SampleRate: uint32(r.SampleRate()), Stats: e.gauges()}); err != nil {
			return err
		}
	}
	if first.IsZero() {
		first, last = time.Now(), time.Now()
	}
	return emit(&stagepb.GenerateChunk{
		FinishReason: stagepb.FinishReason_FINISH_REASON_STOP,
		SampleRate:   uint32(r.SampleRate()),
		Stats:        e.gauges(),
		Timings:      &stagepb.Timings{PrefillSeconds: first.Sub(start).Seconds(), DecodeSeconds: last.Sub(first).Seconds()},
	})
}

// readError classifies a failure reading the audio: the caller's cancel,
// a cut connection (Unavailable), or audio that is not what was asked.
func (e *SpeechEngine) readError(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if errors.Is(err, io.ErrUnexpectedEOF) {
		return status.Errorf(codes.Unavailable, "openai: upstream speech stream cut short: %v", err)
	}
	return status.Errorf(codes.Internal, "openai: upstream speech (%s): %v", e.cfg.SpeechFormat, err)
}
