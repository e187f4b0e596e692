package espeak_test

import (
	"context"
	"encoding/binary"
	"io"
	"log/slog"
	"math"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/espeak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// newEngine starts from the real espeak-ng. Outside CI a machine without
// it skips; in CI (CI set) its absence fails, as scripts/test.sh installs it.
func newEngine(t *testing.T, cfg espeak.Config) *espeak.Engine {
	t.Helper()
	if _, err := exec.LookPath(espeak.DefaultBinary); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("espeak-ng is required in CI (scripts/test.sh installs it): %v", err)
		}
		t.Skipf("espeak-ng is not installed (apt-get install espeak-ng); skipping outside CI: %v", err)
	}
	cfg.Logger = slog.New(slog.DiscardHandler)
	e, err := espeak.New(cfg)
	require.NoError(t, err)
	return e
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func speak(ctx context.Context, e *espeak.Engine, text, voice string) ([]*stagepb.GenerateChunk, error) {
	var chunks []*stagepb.GenerateChunk
	err := e.Generate(ctx, &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Text{Text: text}, Voice: voice},
		func(c *stagepb.GenerateChunk) error { chunks = append(chunks, c); return nil })
	return chunks, err
}

// audio joins the chunks' PCM into samples and checks the stream's shape:
// one sample rate, the finish on the last chunk only.
func audio(t *testing.T, chunks []*stagepb.GenerateChunk) (samples []int16, rate int) {
	t.Helper()
	require.NotEmpty(t, chunks)
	for i, c := range chunks {
		last := i == len(chunks)-1
		if last {
			assert.Equal(t, stagepb.FinishReason_FINISH_REASON_STOP, c.GetFinishReason())
			require.NotNil(t, c.GetTimings())
		} else {
			assert.Equal(t, stagepb.FinishReason_FINISH_REASON_UNSPECIFIED, c.GetFinishReason())
		}
		pcm := c.GetAudioPcm16()
		require.Zero(t, len(pcm)%2)
		if len(pcm) > 0 {
			if rate == 0 {
				rate = int(c.GetSampleRate())
			}
			require.Equal(t, rate, int(c.GetSampleRate()))
		}
		for k := 0; k < len(pcm); k += 2 {
			samples = append(samples, int16(binary.LittleEndian.Uint16(pcm[k:])))
		}
	}
	return samples, rate
}

func rms(s []int16) float64 {
	var sum float64
	for _, v := range s {
		sum += float64(v) * float64(v)
	}
	return math.Sqrt(sum / float64(max(len(s), 1)))
}

// TestSpeech: real speech comes out. It is loud enough to hear, has the
// pauses between words that speech has (some 20 ms frames quiet, most
// not), and takes longer for longer text.
func TestSpeech(t *testing.T) {
	e := newEngine(t, espeak.Config{})
	ctx := testCtx(t)

	short, err := speak(ctx, e, "Hello.", "")
	require.NoError(t, err)
	shortPCM, rate := audio(t, short)
	assert.Equal(t, 22050, rate, "espeak-ng speaks at 22050 Hz")

	long, err := speak(ctx, e, "Hello. The quick brown fox jumps over the lazy dog, and then it runs far away across the green hills.", "")
	require.NoError(t, err)
	longPCM, _ := audio(t, long)
	assert.Greater(t, len(long), 2, "long audio streams in several chunks")

	shortSec, longSec := float64(len(shortPCM))/float64(rate), float64(len(longPCM))/float64(rate)
	t.Logf("short: %.2fs, long: %.2fs, rms %.0f", shortSec, longSec, rms(longPCM))
	assert.Greater(t, shortSec, 0.2)
	assert.Greater(t, longSec, 3*shortSec, "duration grows with the text")
	assert.Greater(t, rms(longPCM), 500.0, "not silent")

	frame := rate / 50
	quiet, frames := 0, 0
	for i := 0; i+frame <= len(longPCM); i += frame {
		frames++
		if rms(longPCM[i:i+frame]) < 100 {
			quiet++
		}
	}
	assert.Greater(t, quiet, frames/50, "pauses between words")
	assert.Less(t, quiet, frames*3/4, "mostly voiced")
}

// TestUsage: espeak-ng has no tokens, yet what it spoke is counted: a
// prompt token a word of the text, on the first chunk, and an output token
// per 40 ms of its audio, as the chunks fill them; the totals are the
// text's words and the audio's frames, whatever the chunking.
func TestUsage(t *testing.T) {
	e := newEngine(t, espeak.Config{})
	text := "Hello. The quick brown fox jumps over the lazy dog, and then it runs far away across the green hills."
	chunks, err := speak(testCtx(t), e, text, "")
	require.NoError(t, err)
	samples, rate := audio(t, chunks)
	require.Greater(t, len(chunks), 2)
	var prompt, generated uint64
	for i, c := range chunks {
		st := c.GetStats()
		require.NotNil(t, st)
		if i > 0 {
			assert.Zero(t, st.GetPromptTokens(), "the words are counted once, on the first chunk")
		}
		prompt += st.GetPromptTokens()
		generated += st.GetGenerationTokens()
		if i < len(chunks)-1 {
			// Whole frames only until the end: at most what this chunk's audio holds, rounded up.
			assert.LessOrEqual(t, st.GetGenerationTokens(), uint64(espeak.Frames(len(c.GetAudioPcm16())/2, rate)+1), "chunk %d", i)
		}
	}
	assert.Equal(t, uint64(len(strings.Fields(text))), prompt)
	assert.Equal(t, uint64(espeak.Frames(len(samples), rate)), generated)
	assert.Greater(t, generated, uint64(50), "seconds of speech are many 40 ms frames")
	assert.Equal(t, 3, espeak.Frames(1765, 22050), "882 samples a frame, a partial one counted")
	assert.Zero(t, espeak.Frames(0, 22050))
}

func TestVoices(t *testing.T) {
	e := newEngine(t, espeak.Config{})
	ctx := testCtx(t)
	base, err := speak(ctx, e, "one two three", "")
	require.NoError(t, err)
	basePCM, _ := audio(t, base)

	// OpenAI's voice names are the default voice: the same audio.
	alloy, err := speak(ctx, e, "one two three", "alloy")
	require.NoError(t, err)
	alloyPCM, _ := audio(t, alloy)
	assert.Equal(t, basePCM, alloyPCM)

	// Another espeak voice (a female variant) sounds different.
	f3, err := speak(ctx, e, "one two three", "en+f3")
	require.NoError(t, err)
	f3PCM, _ := audio(t, f3)
	assert.NotEqual(t, basePCM, f3PCM)

	_, err = speak(ctx, e, "hi", "zzvoice")
	assert.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
	assert.Contains(t, status.Convert(err).Message(), "zzvoice")
	// Written for the API client, marked for the head to name the field.
	assert.Equal(t, "voice \"zzvoice\" is not an espeak-ng voice: want one such as en, en-us or en+f3 (`espeak-ng --voices` lists them)", status.Convert(err).Message())
	assert.Equal(t, stagepb.ReasonInvalidVoice, stagepb.ErrorReason(err))

	_, err = speak(ctx, e, "hi", "../../etc/passwd")
	assert.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
	assert.Equal(t, stagepb.ReasonInvalidVoice, stagepb.ErrorReason(err))
}

func TestInput(t *testing.T) {
	e := newEngine(t, espeak.Config{})
	ctx := testCtx(t)
	// A conversation: the last message is spoken.
	var chat, text []*stagepb.GenerateChunk
	err := e.Generate(ctx, &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Chat{Chat: &stagepb.Chat{Messages: []*stagepb.ChatMessage{
		{Role: "system", Content: "be brief"}, {Role: "user", Content: "good morning"},
	}}}}, func(c *stagepb.GenerateChunk) error { chat = append(chat, c); return nil })
	require.NoError(t, err)
	text, err = speak(ctx, e, "good morning", "")
	require.NoError(t, err)
	a, _ := audio(t, chat)
	b, _ := audio(t, text)
	assert.Equal(t, b, a)

	err = e.Generate(ctx, &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Codes{Codes: &stagepb.Codes{Codes: []uint32{1}}}},
		func(*stagepb.GenerateChunk) error { return nil })
	assert.Equal(t, codes.InvalidArgument, status.Code(err))
}

// TestCancel: cancelling the request mid-stream kills espeak-ng at once and
// frees its slot.
func TestCancel(t *testing.T) {
	e := newEngine(t, espeak.Config{Concurrency: 1})
	ctx, cancel := context.WithCancel(testCtx(t))
	text := strings.Repeat("This sentence is long and it goes on and on. ", 200)
	got := 0
	err := e.Generate(ctx, &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Text{Text: text}}, func(c *stagepb.GenerateChunk) error {
		got++
		cancel()
		return nil
	})
	require.ErrorIs(t, err, context.Canceled)
	assert.Equal(t, 1, got, "nothing after the cancel")
	assert.Zero(t, e.Health().GetGauges().GetNumRequestsRunning())
	// The one slot is free again.
	_, err = speak(testCtx(t), e, "again", "")
	require.NoError(t, err)

	// An emit error (the client is gone) aborts too.
	boom := io.ErrClosedPipe
	err = e.Generate(testCtx(t), &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Text{Text: text}}, func(*stagepb.GenerateChunk) error { return boom })
	require.ErrorIs(t, err, boom)
}

// TestOverGRPC: the engine behind a real worker server, over loopback:
// Health says text in, audio out, and a codes input is refused by the
// worker before the engine sees it.
func TestOverGRPC(t *testing.T) {
	e := newEngine(t, espeak.Config{})
	srv, cli := serve(t, e)
	h, err := cli.Health(testCtx(t), &stagepb.HealthRequest{})
	require.NoError(t, err)
	assert.Equal(t, "espeak", h.GetEngine())
	assert.Equal(t, "audio", h.GetRole())
	assert.Equal(t, "text", h.GetInputRole())
	assert.Equal(t, srv.Member().Engine, "espeak")

	stream, err := cli.Generate(testCtx(t), &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Text{Text: "over the wire"}, Voice: "en-us"})
	require.NoError(t, err)
	var chunks []*stagepb.GenerateChunk
	for {
		c, err := stream.Recv()
		if err == io.EOF {
			break
		}
		require.NoError(t, err)
		chunks = append(chunks, c)
	}
	pcm, _ := audio(t, chunks)
	assert.Greater(t, rms(pcm), 500.0)

	stream, err = cli.Generate(testCtx(t), &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Codes{Codes: &stagepb.Codes{Codes: []uint32{3}}}})
	require.NoError(t, err)
	_, err = stream.Recv()
	assert.Equal(t, codes.InvalidArgument, status.Code(err))
	assert.Contains(t, status.Convert(err).Message(), "takes text, chat or token_ids input, got codes")
}

func TestMissingBinary(t *testing.T) {
	_, err := espeak.New(espeak.Config{Binary: "/nonexistent/espeak-ng"})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "apt-get install espeak-ng")
}

// TestStreamedSpeechStartsOnTheFirstSentence: fed through GenerateStream,
// as a streaming pipeline feeds it, espeak speaks the first sentence while
// the rest of the text has not arrived, and the whole answer is the
// sentences' audio one after the other.
func TestStreamedSpeechStartsOnTheFirstSentence(t *testing.T) {
	e := newEngine(t, espeak.Config{})
	_, cli := serve(t, e)

	stream, err := cli.GenerateStream(testCtx(t))
	require.NoError(t, err)
	require.NoError(t, stream.Send(&stagepb.StreamInput{Request: &stagepb.GenerateRequest{
		Input: &stagepb.GenerateRequest_Text{Text: "The first sentence is here. And the second"}, Voice: "en-us"}}))
	var first []*stagepb.GenerateChunk
	for {
		c, err := stream.Recv() // the input is still open: only the first sentence is complete
		require.NoError(t, err)
		first = append(first, c)
		if len(c.GetAudioPcm16()) > 0 {
			break
		}
	}
	require.NoError(t, stream.Send(&stagepb.StreamInput{Text: " one ends later."}))
	require.NoError(t, stream.CloseSend())
	rest := first
	for {
		c, err := stream.Recv()
		if err == io.EOF {
			break
		}
		require.NoError(t, err)
		rest = append(rest, c)
	}
	assert.Equal(t, stagepb.FinishReason_FINISH_REASON_STOP, rest[len(rest)-1].GetFinishReason())
	got, rate := audio(t, rest)
	one, _ := audio(t, mustSpeak(t, e, "The first sentence is here. "))
	two, _ := audio(t, mustSpeak(t, e, "And the second one ends later."))
	assert.Equal(t, len(one)+len(two), len(got), "the two sentences' audio, one after the other (rate %d)", rate)
	assert.Greater(t, rms(got), 500.0)
}

func mustSpeak(t *testing.T, e *espeak.Engine, text string) []*stagepb.GenerateChunk {
	t.Helper()
	chunks, err := speak(testCtx(t), e, text, "en-us")
	require.NoError(t, err)
	return chunks
}

// serve runs e behind a real worker server on loopback until the test ends
// and returns the server and a gRPC client of it.
func serve(t *testing.T, e *espeak.Engine) (*worker.Server, stagepb.StageServiceClient) {
	t.Helper()
	srv, err := worker.New(worker.Config{Stage: "speech", Engine: e, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	t.Cleanup(func() { cancel(); require.NoError(t, <-done) })
	<-srv.Registered()
	conn, err := grpc.NewClient(srv.Advertise(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() }) // runs first: the connection closes before the server stops
	return srv, stagepb.NewStageServiceClient(conn)
}
