package httpapi

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/worker/sim"
)

// rtfCluster is thinker → talker → two vocoders, the vocoder stage
// routed by deadline with a 300 ms real-time window, every sim decoding a
// code in 5 ms (8× real time: a code is 40 ms of audio).
func rtfCluster(t *testing.T) (*orchestratortest.Cluster, map[uint32]*orchestratortest.Worker, map[string]*orchestratortest.Worker) {
	p := orchestrator.DefaultPipeline()
	p.Stages[2].Policy = "deadline"
	p.Stages[2].Deadline = &orchestrator.Deadline{RTFWindow: 300 * time.Millisecond}
	c := startCluster(t, orchestratortest.Options{Pipeline: p, ReplicasPerStage: -1, Sim: sim.Config{DecodeTokenLatency: 5 * time.Millisecond}})
	vocoders := map[uint32]*orchestratortest.Worker{}
	others := map[string]*orchestratortest.Worker{}
	for _, st := range []string{"thinker", "talker", "vocoder", "vocoder"} {
		w := c.AddWorker(t, st, orchestratortest.WorkerOptions{})
		if st == "vocoder" {
			vocoders[w.ReplicaID()] = w
		} else {
			others[st] = w
		}
	}
	c.WaitReady(t)
	for id := range vocoders {
		c.WaitState(t, "vocoder", id, orchestrator.StateAttached)
	}
	return c, vocoders, others
}

// speak asks /v1/audio/speech for raw PCM with an rtf=1 target through
// the official client; after the first bytes it calls firstBytes (nil:
// nothing), then reads the rest.
func speak(t *testing.T, client openai.Client, input string, firstBytes func()) []byte {
	t.Helper()
	resp, err := client.Audio.Speech.New(testCtx(t), openai.AudioSpeechNewParams{Model: model, Input: input,
		Voice: openai.AudioSpeechNewParamsVoiceUnion{OfString: openai.String("alloy")}, ResponseFormat: openai.AudioSpeechNewParamsResponseFormatPCM},
		option.WithHeader("X-Troupe-Deadline", "rtf=1"))
	require.NoError(t, err)
	defer resp.Body.Close()
	buf := make([]byte, 1024)
	n, err := resp.Body.Read(buf)
	require.NoError(t, err)
	require.Positive(t, n)
	if firstBytes != nil {
		firstBytes()
	}
	rest, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	assert.Empty(t, resp.Header.Get(errorTrailer), "the stream ended well")
	return append(buf[:n], rest...)
}

// An audio stream whose vocoder falls behind real time mid-stream is moved
// to the other vocoder at a chunk boundary: the client's audio is byte for
// byte the unmoved render's, no sample twice and none lost, and
// troupe_router_decisions_total{reason="rtf_migrate"} counts the move.
// Streams that keep real time are not moved: one on fast replicas, and
// one whose vocoder is starved by a talker slower than real time (the
// time its input waits does not count against the vocoder).
func TestRTFMigrateMovesSlowAudio(t *testing.T) {
	c, vocoders, others := rtfCluster(t)
	a := startAPI(t, c, Config{}, nil, nil)
	client := a.openai()
	input := strings.Repeat("the river runs down to the sea ", 6) // 42 words, 3.4 s of audio
	moves := func() float64 { return counter(t, c, "troupe_router_decisions_total", "2", "reason", "rtf_migrate") }

	want := speak(t, client, input, nil)
	require.Greater(t, len(want), 48000, "over a second of audio")
	assert.Zero(t, moves(), "a stream at 8× real time is not moved")

	// A talker at 0.8× real time starves the vocoder: not its fault.
	others["talker"].Engine.SlowDown(45 * time.Millisecond)
	short := "the river runs down to the sea and on"
	starved := speak(t, client, short, nil)
	others["talker"].Engine.SlowDown(0)
	assert.Zero(t, moves(), "a vocoder waiting for its input is not moved")
	assert.Equal(t, speak(t, client, short, nil), starved)

	slowed := false
	got := speak(t, client, input, func() {
		for _, r := range c.Head.Replicas() {
			if r.StageName == "vocoder" && r.InFlight > 0 {
				slowed = true
				// 40 ms of audio every 305 ms: 0.13× real time.
				vocoders[r.Replica].Engine.SlowDown(300 * time.Millisecond)
			}
		}
	})
	require.True(t, slowed, "a vocoder was slowed mid-stream")
	samePCM(t, want, got)
	assert.Equal(t, 1.0, moves(), "the slowed stream was moved once")
	assert.Equal(t, 1.0, counter(t, c, "troupe_request_success_total", "2", "finished_reason", "abort"), "the slow vocoder's attempt ended at the move")
}

func samePCM(t *testing.T, want, got []byte) {
	t.Helper()
	if len(want) == len(got) && string(want) == string(got) {
		return
	}
	i := 0
	for i < min(len(want), len(got)) && want[i] == got[i] {
		i++
	}
	t.Errorf("audio: %d bytes, want %d; first difference at byte %d", len(got), len(want), i)
}

// With admission on, a request whose first token has not come by its
// target is stopped at the target: a 503 deadline_missed before any byte
// of the answer (the stream's headers wait for the first token), its
// stage attempt cancelled and counted as reason deadline_missed; never a
// late first token. A request in time is served.
func TestDeadlineMissedStopsAtTarget(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{
		Pipeline: orchestrator.Pipeline{Model: model, Stages: []orchestrator.Stage{
			{Name: "thinker", Policy: "deadline", Deadline: &orchestrator.Deadline{Admission: true}},
		}},
		ReplicasPerStage: 1,
		// A 2,000-word prompt takes about a second to prefill; a short one
		// a few milliseconds, which is what the policy learns.
		Sim: sim.Config{PrefillTokensPerSec: 2000},
	})
	a := startAPI(t, c, Config{}, nil, nil)
	client := a.openai()
	stream := func(prompt, deadline string) (chunks int, err error) {
		s := client.Chat.Completions.NewStreaming(testCtx(t), openai.ChatCompletionNewParams{
			Model:               model,
			Messages:            []openai.ChatCompletionMessageParamUnion{openai.UserMessage(prompt)},
			MaxCompletionTokens: openai.Int(3),
		}, option.WithHeader("X-Troupe-Deadline", deadline))
		defer s.Close()
		for s.Next() {
			chunks++
		}
		return chunks, s.Err()
	}
	for range 3 {
		n, err := stream("hello there", "ttft=10s")
		require.NoError(t, err)
		require.Positive(t, n)
	}

	predicted := func() float64 {
		resp, body := a.do(t, "GET", "/v1/replicas", nil, nil)
		require.Equal(t, http.StatusOK, resp.StatusCode, "body: %s", body)
		var list struct {
			Data []struct {
				Predicted *float64 `json:"predicted_first_output_s"`
			} `json:"data"`
		}
		require.NoError(t, json.Unmarshal(body, &list))
		require.Len(t, list.Data, 1)
		require.NotNil(t, list.Data[0].Predicted)
		return *list.Data[0].Predicted
	}
	before := predicted()
	start := time.Now()
	n, err := stream(strings.Repeat("weather ", 2000), "ttft=100ms")
	took := time.Since(start)
	var oe *openai.Error
	require.True(t, errors.As(err, &oe), "want an API error, got %v", err)
	assert.Equal(t, http.StatusServiceUnavailable, oe.StatusCode)
	assert.Equal(t, "deadline_missed", oe.Code)
	assert.Contains(t, oe.Message, `stage "thinker"`)
	assert.Zero(t, n, "no chunk of a late answer")
	assert.GreaterOrEqual(t, took, 100*time.Millisecond, "not before the target")
	assert.Less(t, took, 900*time.Millisecond, "stopped at the target, not at the first token (about 1 s)")
	assert.Equal(t, 1.0, counter(t, c, "troupe_router_decisions_total", "0", "reason", "deadline_missed"))
	assert.Zero(t, counter(t, c, "troupe_router_decisions_total", "0", "reason", "deadline_shed"), "admitted on its prediction")
	assert.Equal(t, 1.0, counter(t, c, "troupe_request_success_total", "0", "finished_reason", "abort"), "its attempt was cancelled")
	// The stopped attempt teaches the policy that the replica took at
	// least that long (else a replica slower than every target would
	// never be learned): its prediction rises (by at most the bound on
	// one observation, router.deadlineMaxJump).
	assert.Greater(t, predicted(), 1.2*before, "learned from the stopped attempt")
	require.Eventually(t, func() bool {
		s := c.Workers()[0].Engine.Snapshot()
		return s.Running+s.WaitingCapacity == 0
	}, 10*time.Second, 5*time.Millisecond, "the engine let the request go")
}

// The same for the first audio of /v1/audio/speech: a vocoder that slowed
// after the policy learned it is admitted on its prediction, and the
// request is stopped at its ttfa target with a 503 deadline_missed before
// any audio (the raw stream's headers wait for the first samples).
func TestDeadlineMissedFirstAudio(t *testing.T) {
	p := orchestrator.DefaultPipeline()
	p.Stages[2].Policy = "deadline"
	p.Stages[2].Deadline = &orchestrator.Deadline{Admission: true}
	c := startCluster(t, orchestratortest.Options{Pipeline: p, ReplicasPerStage: 1, Sim: sim.Config{DecodeTokenLatency: 2 * time.Millisecond}})
	a := startAPI(t, c, Config{}, nil, nil)
	client := a.openai()
	say := func(deadline string) (*http.Response, error) {
		return client.Audio.Speech.New(testCtx(t), openai.AudioSpeechNewParams{Model: model, Input: "the river runs down to the sea",
			Voice: openai.AudioSpeechNewParamsVoiceUnion{OfString: openai.String("alloy")}, ResponseFormat: openai.AudioSpeechNewParamsResponseFormatPCM},
			option.WithHeader("X-Troupe-Deadline", deadline))
	}
	for range 3 {
		resp, err := say("ttfa=10s")
		require.NoError(t, err)
		_, err = io.Copy(io.Discard, resp.Body)
		require.NoError(t, err)
		require.NoError(t, resp.Body.Close())
	}
	for _, w := range c.Workers() {
		if w.Stage == "vocoder" {
			w.Engine.SlowDown(time.Second)
		}
	}
	start := time.Now()
	_, err := say("ttfa=300ms")
	took := time.Since(start)
	var oe *openai.Error
	require.True(t, errors.As(err, &oe), "want an API error, got %v", err)
	assert.Equal(t, http.StatusServiceUnavailable, oe.StatusCode)
	assert.Equal(t, "deadline_missed", oe.Code)
	assert.Contains(t, oe.Message, `stage "vocoder" gave no first audio`)
	assert.GreaterOrEqual(t, took, 300*time.Millisecond, "not before the target")
	assert.Less(t, took, 900*time.Millisecond, "stopped at the target, not at the first audio (over 1 s)")
	assert.Equal(t, 1.0, counter(t, c, "troupe_router_decisions_total", "2", "reason", "deadline_missed"))
}
