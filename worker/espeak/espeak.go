// Package espeak is a local speech stage: text in, PCM16 mono audio out,
// spoken by the espeak-ng synthesizer (Debian's espeak-ng package), one
// process per request. The audio streams out while espeak-ng makes it.
package espeak

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os/exec"
	"regexp"
	"runtime"
	"strings"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker/internal/wav"
)

// EngineName is what Health reports as the engine.
const EngineName = "espeak"

// Defaults for zero Config fields.
const (
	DefaultBinary = "espeak-ng"
	DefaultVoice  = "en"
)

// chunkBytes bounds the audio of one chunk: about 0.7 s at 22050 Hz.
const chunkBytes = 32 << 10

// stderrLimit bounds what is kept of espeak-ng's stderr for error messages.
const stderrLimit = 4 << 10

// frameSeconds is the audio one output token stands for. espeak-ng has no
// tokenizer and no codec, yet the head counts every stage's usage
// (a speech answer's usage, the replica's token counters): it counts a
// prompt token a word of the text it speaks, and an output token per
// 40 ms of the audio, the frame of a codec code of the sim's talker and
// vocoder (sim.SamplesPerCode at sim.SampleRate), so that the usage of
// the two speech pipelines reads alike.
const frameSeconds = 0.040

// Frames is the output tokens of samples of audio at rate Hz: the 40 ms
// frames they fill, a last partial frame included.
func Frames(samples, rate int) int {
	if samples <= 0 || rate <= 0 {
		return 0
	}
	return int(math.Ceil(float64(samples) / (frameSeconds * float64(rate))))
}

// openAIVoices are the OpenAI API's voice names. Clients of the OpenAI
// API must send one with audio output, so they are taken as "the default
// voice" rather than refused.
var openAIVoices = map[string]bool{
	"alloy": true, "ash": true, "ballad": true, "cedar": true, "coral": true, "echo": true, "fable": true,
	"marin": true, "nova": true, "onyx": true, "sage": true, "shimmer": true, "verse": true,
}

// voiceRE is what a voice may look like: an espeak-ng language or voice
// name (en, en-us, gmw/en-US) with an optional variant (+f3). It keeps
// paths and option-like values away from the command line.
var voiceRE = regexp.MustCompile(`^[A-Za-z0-9_-]+(/[A-Za-z0-9_-]+)?(\+[A-Za-z0-9_-]+)?$`)

// Config configures an Engine.
type Config struct {
	// Binary is the espeak-ng executable, a path or a name looked up in
	// PATH (default DefaultBinary).
	Binary string
	// Voice is used when a request names none, or names an OpenAI voice
	// (alloy, nova, ...); default DefaultVoice.
	Voice string
	// Concurrency is how many espeak-ng processes may run at once; more
	// requests wait (num_requests_waiting). Default: the number of CPUs.
	Concurrency int
	Logger      *slog.Logger // default slog.Default()
}

// Engine speaks text with espeak-ng. It starts no goroutines; every method
// may be called concurrently.
type Engine struct {
	cfg     Config
	bin     string
	slots   chan struct{} // one token per running process
	running atomic.Int32
	waiting atomic.Int32
}

// New checks the configuration and finds the binary; it runs nothing.
func New(cfg Config) (*Engine, error) {
	if cfg.Binary == "" {
		cfg.Binary = DefaultBinary
	}
	if cfg.Voice == "" {
		cfg.Voice = DefaultVoice
	}
	if !voiceRE.MatchString(cfg.Voice) {
		return nil, fmt.Errorf("espeak: invalid voice %q", cfg.Voice)
	}
	if cfg.Concurrency <= 0 {
		cfg.Concurrency = runtime.NumCPU()
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	bin, err := exec.LookPath(cfg.Binary)
	if err != nil {
		return nil, fmt.Errorf("espeak: %s not found (Debian: apt-get install espeak-ng): %w", cfg.Binary, err)
	}
	return &Engine{cfg: cfg, bin: bin, slots: make(chan struct{}, cfg.Concurrency)}, nil
}

// Health reports a speech engine: text in, audio out.
func (e *Engine) Health() *stagepb.HealthResponse {
	return &stagepb.HealthResponse{
		Status:    stagepb.ServingStatus_SERVING_STATUS_SERVING,
		Engine:    EngineName,
		Role:      stagepb.RoleAudio,
		InputRole: stagepb.RoleText,
		Gauges:    e.gauges(),
	}
}

func (e *Engine) gauges() *stagepb.EngineStats {
	return &stagepb.EngineStats{
		NumRequestsRunning:         uint32(max(e.running.Load(), 0)),
		NumRequestsWaitingCapacity: uint32(max(e.waiting.Load(), 0)),
	}
}

// Sleep is not supported: espeak-ng holds nothing worth freeing.
func (e *Engine) Sleep(context.Context, int) (stagepb.SleepState, error) {
	return stagepb.SleepState_SLEEP_STATE_AWAKE, status.Error(codes.Unimplemented, "the espeak engine has no sleep mode")
}

// WakeUp is a no-op: the engine never sleeps.
func (e *Engine) WakeUp(context.Context) (stagepb.SleepState, error) {
	return stagepb.SleepState_SLEEP_STATE_AWAKE, nil
}

// Voice resolves a request's voice: "" and OpenAI voice names are the
// configured default; anything else must look like an espeak-ng voice.
func (e *Engine) Voice(v string) (string, error) {
	if v == "" || openAIVoices[strings.ToLower(v)] {
		return e.cfg.Voice, nil
	}
	if !voiceRE.MatchString(v) {
		return "", unknownVoice(v)
	}
	return v, nil
}

// ContinuesInput: in a streaming pipeline espeak speaks each sentence as
// soon as the stage before has written it, instead of waiting for the whole
// text (worker.Continuer). The audio of the whole is the sentences' audio
// one after the other, as a streaming pipeline makes it for streamed and
// whole answers alike.
func (e *Engine) ContinuesInput() bool { return true }

// SegmentsBySentence: segments end at sentence ends, so no sentence is
// spoken with a break in it (worker.SentenceSegmenter).
func (e *Engine) SegmentsBySentence() bool { return true }

// Generate speaks the request's text and streams the audio as espeak-ng
// makes it; the final chunk carries finish stop and the timings (prefill:
// until the first audio; decode: the rest). Cancelling ctx kills the
// process.
func (e *Engine) Generate(ctx context.Context, req *stagepb.GenerateRequest, emit func(*stagepb.GenerateChunk) error) error {
	text, ok := req.SpeechText()
	if !ok {
		return status.Errorf(codes.InvalidArgument, "espeak: a speech stage takes text or chat input, got %T", req.GetInput())
	}
	voice, err := e.Voice(req.GetVoice())
	if err != nil {
		return err
	}
	start := time.Now()
	e.waiting.Add(1)
	select {
	case e.slots <- struct{}{}:
		e.waiting.Add(-1)
	case <-ctx.Done():
		e.waiting.Add(-1)
		return ctx.Err()
	}
	e.running.Add(1)
	defer func() {
		e.running.Add(-1)
		<-e.slots
	}()
	queued := time.Since(start)

	parent := ctx
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // kills the process on every early return
	cmd := exec.CommandContext(ctx, e.bin, "--stdout", "-v", voice)
	cmd.Stdin = strings.NewReader(text)
	stderr := &limitedBuffer{limit: stderrLimit}
	cmd.Stderr = stderr
	cmd.WaitDelay = 2 * time.Second
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return status.Errorf(codes.Internal, "espeak: %v", err)
	}
	if err := cmd.Start(); err != nil {
		return status.Errorf(codes.Internal, "espeak: start %s: %v", e.bin, err)
	}
	streamErr := e.stream(ctx, stdout, emit, cancel, start, queued, len(strings.Fields(text)))
	waitErr := cmd.Wait()
	switch {
	case parent.Err() != nil:
		return parent.Err() // the caller is gone, whatever else happened
	case waitErr != nil && ctx.Err() == nil:
		return e.processError(voice, waitErr, stderr.String()) // explains a stream that failed
	}
	return streamErr
}

// stream forwards the WAV on r as chunks, then the final chunk.
// When emit fails it calls kill, which ends the process; on its other
// errors the process has closed its output and ends by itself. The
// chunks' stats carry the usage as deltas: the text's words as prompt
// tokens on the first chunk, and the audio's 40 ms frames as generation
// tokens as they fill (a last partial frame on the final chunk).
func (e *Engine) stream(ctx context.Context, r io.Reader, emit func(*stagepb.GenerateChunk) error, kill func(), start time.Time, queued time.Duration, words int) error {
	wr, err := wav.NewReader(r)
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		_, _ = io.Copy(io.Discard, r) // let the process end; Wait reports why
		return status.Errorf(codes.Internal, "espeak: %v", err)
	}
	var first, last time.Time
	samples, counted := 0, 0 // samples so far; frames reported so far
	prompt := uint64(words)  // reported with the first chunk
	stats := func(final bool) *stagepb.EngineStats {
		st := e.gauges()
		st.PromptTokens, prompt = prompt, 0
		frames := samples / int(math.Round(frameSeconds*float64(wr.SampleRate())))
		if final {
			frames = Frames(samples, wr.SampleRate())
		}
		st.GenerationTokens = uint64(max(frames-counted, 0))
		counted = max(frames, counted)
		return st
	}
	for {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		pcm, err := wr.Next(chunkBytes)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return status.Errorf(codes.Internal, "espeak: %v", err)
		}
		last = time.Now()
		if first.IsZero() {
			first = last
		}
		samples += len(pcm) / 2
		if err := emit(&stagepb.GenerateChunk{AudioPcm16: pcm, SampleRate: uint32(wr.SampleRate()), Stats: stats(false)}); err != nil {
			kill()
			return err
		}
	}
	end := time.Now()
	if first.IsZero() {
		first, last = end, end
	}
	_, _ = io.Copy(io.Discard, r) // a trailing chunk after the data, if any
	return emit(&stagepb.GenerateChunk{
		FinishReason: stagepb.FinishReason_FINISH_REASON_STOP,
		SampleRate:   uint32(wr.SampleRate()),
		Stats:        stats(true),
		Timings: &stagepb.Timings{
			QueueSeconds:   queued.Seconds(),
			PrefillSeconds: first.Sub(start.Add(queued)).Seconds(),
			DecodeSeconds:  end.Sub(first).Seconds(),
		},
	})
}

// processError explains a failed espeak-ng run.
func (e *Engine) processError(voice string, err error, stderr string) error {
	msg := strings.TrimSpace(stderr)
	if i := strings.IndexByte(msg, '\n'); i >= 0 {
		msg = msg[:i]
	}
	if strings.Contains(stderr, "voice does not exist") || strings.Contains(stderr, "voice file") {
		e.cfg.Logger.Info("espeak: unknown voice", "voice", voice, "stderr", msg)
		return unknownVoice(voice)
	}
	return status.Errorf(codes.Internal, "espeak: %s: %v: %s", e.bin, err, msg)
}

// unknownVoice refuses a voice espeak-ng does not have, in words for the
// API client (espeak-ng's own stderr goes to the worker's log).
func unknownVoice(voice string) error {
	return stagepb.InvalidVoiceError(fmt.Sprintf("voice %q is not an espeak-ng voice: want one such as en, en-us or en+f3 (`espeak-ng --voices` lists them)", voice))
}

// limitedBuffer keeps the first limit bytes written to it.
type limitedBuffer struct {
	buf   bytes.Buffer
	limit int
}

func (b *limitedBuffer) Write(p []byte) (int, error) {
	if room := b.limit - b.buf.Len(); room > 0 {
		b.buf.Write(p[:min(len(p), room)])
	}
	return len(p), nil
}

func (b *limitedBuffer) String() string { return b.buf.String() }
