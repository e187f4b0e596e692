package orchestrator_test

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker/sim"
)

func omni(streaming bool, chunk int) orchestrator.Pipeline {
	p := orchestrator.DefaultPipeline()
	p.Streaming = &streaming
	for i := range p.Stages {
		p.Stages[i].InputChunk = chunk
	}
	return p
}

// expectedText is what the sim thinker answers.
func expectedText(t *testing.T, prompt string, sp *stagepb.SamplingParams) string {
	t.Helper()
	out, err := sim.Expect(stagepb.RoleText, &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Text{Text: prompt}, Sampling: sp})
	require.NoError(t, err)
	return out.Text
}

// longAnswer makes the thinker say maxTokens words (ignore_eos).
func longAnswer(maxTokens uint32, seed int64) *stagepb.SamplingParams {
	s := sampling(maxTokens, seed)
	s.IgnoreEos = true
	return s
}

// TestStreamedEqualsSequential: streaming through the stages, in segments
// as small as one word or one code, gives the text, codes and samples of
// running the stages one after the other, and both are the sim's pure
// function of the prompt. Audio the client reads as it is made (OnAudio)
// is not also kept in the result; without OnAudio the result holds it.
func TestStreamedEqualsSequential(t *testing.T) {
	const prompt = "tell me a long story about the sea"
	req := orchestrator.Request{ID: "eq", Prompt: prompt, Sampling: longAnswer(30, 11), Stages: 3}
	text := expectedText(t, prompt, req.Sampling)
	codes, _ := sim.ExpectedCodes(text, 11, 0)
	want := sim.ExpectedAudio(codes)
	for i, p := range []orchestrator.Pipeline{omni(false, 0), omni(true, 0), omni(true, 1)} {
		c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: p})
		var pcm []byte
		r := req
		r.OnAudio = func(b []byte, rate int) error {
			assert.Equal(t, sim.SampleRate, rate)
			pcm = append(pcm, b...)
			return nil
		}
		res, err := c.Head.Execute(ctxT(t), r, nil)
		require.NoError(t, err)
		samePCM(t, want, pcm, fmt.Sprintf("run %d: OnAudio saw every sample, in order, byte for byte", i))
		assert.Nil(t, res.PCM, "run %d: streamed audio is not kept", i)
		assert.Equal(t, sim.SampleRate, res.SampleRate, "run %d", i)
		whole, err := c.Head.Execute(ctxT(t), req, nil)
		require.NoError(t, err)
		for _, res := range []*orchestrator.Result{res, whole} {
			assert.Equal(t, text, res.Text, "run %d", i)
			assert.Equal(t, codes, res.Codes, "run %d", i)
			assert.False(t, res.AudioTruncated)
		}
		samePCM(t, want, whole.PCM, fmt.Sprintf("run %d without OnAudio: the result's audio byte for byte", i))
	}
}

// TestFirstAudioBeforeThinkerEnds: with a realistic pace the first audio
// reaches the client while the thinker is still speaking; run one after
// the other it comes only after.
func TestFirstAudioBeforeThinkerEnds(t *testing.T) {
	pace := sim.Config{DecodeTokenLatency: 4 * time.Millisecond}
	for _, streaming := range []bool{true, false} {
		c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: omni(streaming, 0), Sim: pace})
		var mu sync.Mutex
		var firstAudio, lastText time.Time
		req := orchestrator.Request{ID: "ttfa", Prompt: "a story", Sampling: longAnswer(48, 2), Stages: 3,
			OnAudio: func([]byte, int) error {
				mu.Lock()
				defer mu.Unlock()
				if firstAudio.IsZero() {
					firstAudio = time.Now()
				}
				return nil
			}}
		_, err := c.Head.Execute(ctxT(t), req, func(string) error {
			mu.Lock()
			defer mu.Unlock()
			lastText = time.Now()
			return nil
		})
		require.NoError(t, err)
		if streaming {
			assert.True(t, firstAudio.Before(lastText), "streaming: first audio %v before the thinker's last word", lastText.Sub(firstAudio))
		} else {
			assert.True(t, firstAudio.After(lastText), "sequential: first audio after the thinker's last word")
		}
	}
}

// TestStreamedRetryDeliversNoAudioTwice: a talker or a vocoder killed
// after audio has reached the client is re-driven on another replica (a
// streamed stage from its buffered input, a sequential one from its
// request) and skips the samples already delivered; the client hears
// every sample exactly once.
func TestStreamedRetryDeliversNoAudioTwice(t *testing.T) {
	for _, tc := range []struct {
		stage     string
		streaming bool
	}{{"talker", true}, {"vocoder", true}, {"vocoder", false}} {
		t.Run(fmt.Sprintf("%s/streaming=%v", tc.stage, tc.streaming), func(t *testing.T) {
			retryDeliversNoAudioTwice(t, tc.stage, omni(tc.streaming, 2))
		})
	}
}

func retryDeliversNoAudioTwice(t *testing.T, stage string, p orchestrator.Pipeline) {
	slow := sim.Config{DecodeTokenLatency: 3 * time.Millisecond}
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: p, ReplicasPerStage: -1, Sim: slow})
	var twins []*orchestratortest.Worker
	for _, st := range []string{"thinker", "talker", "vocoder"} {
		n := 1
		if st == stage {
			n = 2
		}
		for range n {
			w := c.AddWorker(t, st, orchestratortest.WorkerOptions{})
			if st == stage {
				twins = append(twins, w)
			}
		}
	}
	c.WaitReady(t)
	for _, w := range twins {
		c.WaitState(t, stage, w.ReplicaID(), orchestrator.StateAttached)
	}
	var pcm []byte
	killed := false
	req := orchestrator.Request{ID: "retry", Prompt: "keep talking", Sampling: longAnswer(40, 4), Stages: 3,
		OnAudio: func(b []byte, _ int) error {
			pcm = append(pcm, b...)
			if killed {
				return nil
			}
			for _, r := range c.Head.Replicas() {
				if r.StageName == stage && r.InFlight > 0 {
					for _, w := range twins {
						if w.ReplicaID() == r.Replica {
							killed = true
							go w.Kill(t)
						}
					}
				}
			}
			return nil
		}}
	res, err := c.Head.Execute(ctxT(t), req, nil)
	require.NoError(t, err)
	require.True(t, killed, "a %s was killed mid-request", stage)
	text := expectedText(t, "keep talking", req.Sampling)
	codes, _ := sim.ExpectedCodes(text, 4, 0)
	want := sim.ExpectedAudio(codes)
	assert.Nil(t, res.PCM, "streamed audio is not kept")
	samePCM(t, want, pcm, "the audio the client heard: every sample once")
	failed, _ := orchestrator.GatheredValue(t, c.Metrics, "troupe_request_success_total", map[string]string{"stage": stageIndex(stage), "finished_reason": "error"})
	assert.Equal(t, 1.0, failed, "the killed %s's attempt failed mid-answer and was retried", stage)
}

// stageIndex is the default pipeline's index of stage, as metrics label it.
func stageIndex(stage string) string {
	for i, st := range orchestrator.DefaultPipeline().Stages {
		if st.Name == stage {
			return fmt.Sprint(i)
		}
	}
	return "?"
}

// TestStreamedClientGoneCancelsEveryStage: a client that leaves after the
// first audio ends the request on every stage's worker.
func TestStreamedClientGoneCancelsEveryStage(t *testing.T) {
	slow := sim.Config{DecodeTokenLatency: 3 * time.Millisecond}
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: omni(true, 0), Sim: slow})
	gone := errors.New("client hung up")
	req := orchestrator.Request{ID: "gone", Prompt: "talk", Sampling: longAnswer(60, 1), Stages: 3,
		OnAudio: func([]byte, int) error { return gone }}
	_, err := c.Head.Execute(ctxT(t), req, nil)
	require.ErrorIs(t, err, gone)
	require.Eventually(t, func() bool {
		for _, w := range c.Workers() {
			if w.Engine.Snapshot().Running+w.Engine.Snapshot().WaitingCapacity > 0 {
				return false
			}
		}
		for _, r := range c.Head.Replicas() {
			if r.InFlight > 0 {
				return false
			}
		}
		return true
	}, 10*time.Second, 5*time.Millisecond, "every stage's work ended")
}

// TestPipelineMetrics: an audio request is counted and timed by the
// pipeline families; the handoff between each pair of stages is observed.
func TestPipelineMetrics(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: omni(true, 0)})
	_, err := c.Head.Execute(ctxT(t), orchestrator.Request{ID: "m", Prompt: "metrics please", Sampling: sampling(10, 1), Stages: 3}, nil)
	require.NoError(t, err)
	model := map[string]string{"model_name": "troupe-omni-sim"}
	for _, f := range []string{"troupe_pipeline_e2e_request_latency_seconds", "troupe_time_to_first_audio_seconds",
		"troupe_audio_duration_seconds", "troupe_audio_real_time_factor"} {
		v, ok := orchestrator.GatheredValue(t, c.Metrics, f, model)
		require.True(t, ok, f)
		assert.Equal(t, 1.0, v, f)
	}
	v, _ := orchestrator.GatheredValue(t, c.Metrics, "troupe_pipeline_requests_total", map[string]string{"outcome": "success"})
	assert.Equal(t, 1.0, v)
	for _, pair := range [][2]string{{"0", "1"}, {"1", "2"}} {
		v, ok := orchestrator.GatheredValue(t, c.Metrics, "troupe_stage_handoff_latency_seconds", map[string]string{"from_stage": pair[0], "to_stage": pair[1]})
		require.True(t, ok)
		assert.Positive(t, v, "handoffs %s→%s", pair[0], pair[1])
	}
	v, ok := orchestrator.GatheredValue(t, c.Metrics, "troupe_pipeline_requests_total", map[string]string{"outcome": "no_replica"})
	require.True(t, ok, "every outcome is bound at 0 from the start")
	assert.Zero(t, v)
}

// samePCM compares audio without dumping it: lengths, then the first
// differing byte.
func samePCM(t *testing.T, want, got []byte, what string) {
	t.Helper()
	if bytes.Equal(want, got) {
		return
	}
	i := 0
	for i < min(len(want), len(got)) && want[i] == got[i] {
		i++
	}
	t.Errorf("%s: %d bytes, want %d; first difference at byte %d", what, len(got), len(want), i)
}

// TestStreamedThinkerMigrates: in an audio request whose text streams to
// the client, a thinker killed mid-answer is continued on another replica;
// the talker and the vocoder go on from the text as the client saw it, and
// the audio is that whole text's, every sample once.
func TestStreamedThinkerMigrates(t *testing.T) {
	slow := sim.Config{DecodeTokenLatency: 20 * time.Millisecond}
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: omni(true, 2), ReplicasPerStage: -1, Sim: slow, MaxMigrations: 1})
	thinkers := []*orchestratortest.Worker{
		c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{}),
		c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{}),
	}
	c.AddWorker(t, "talker", orchestratortest.WorkerOptions{})
	c.AddWorker(t, "vocoder", orchestratortest.WorkerOptions{})
	c.WaitReady(t)
	for _, w := range thinkers {
		c.WaitState(t, "thinker", w.ReplicaID(), orchestrator.StateAttached)
	}
	var mu sync.Mutex
	var seen strings.Builder
	var pcm []byte
	deltas, killed := 0, false
	req := orchestrator.Request{ID: "mig-audio", Prompt: "tell a story", Sampling: longAnswer(30, 3), Stages: 3,
		OnAudio: func(b []byte, _ int) error {
			mu.Lock()
			defer mu.Unlock()
			pcm = append(pcm, b...)
			return nil
		}}
	res, err := c.Head.Execute(ctxT(t), req, func(d string) error {
		mu.Lock()
		defer mu.Unlock()
		seen.WriteString(d)
		deltas++
		if deltas == 5 && !killed {
			killed = true
			for _, r := range c.Head.Replicas() {
				if r.StageName == "thinker" && r.InFlight > 0 {
					for _, w := range thinkers {
						if w.ReplicaID() == r.Replica {
							go w.Kill(t)
						}
					}
				}
			}
		}
		return nil
	})
	require.NoError(t, err, "the answer continued on the other thinker")
	mu.Lock()
	defer mu.Unlock()
	require.True(t, killed)
	assert.Equal(t, seen.String(), res.Text, "one answer, each word once")
	assert.Equal(t, 30, len(strings.Fields(res.Text)), "max_tokens across both parts")
	codes, _ := sim.ExpectedCodes(res.Text, 3, 0)
	samePCM(t, sim.ExpectedAudio(codes), pcm, "the audio of the whole text, every sample once")
	failedThere, _ := orchestrator.GatheredValue(t, c.Metrics, "troupe_request_success_total", map[string]string{"stage": "0", "finished_reason": "error"})
	assert.Equal(t, 1.0, failedThere, "the first thinker's attempt failed mid-answer")
}
