package httpapi

import (
	"encoding/json"
	"log/slog"
	"net/http"
	"strconv"
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

// The X-Troupe-Deadline header, through the official client: a malformed
// one is a 400 invalid_deadline; a target the deadline policy predicts no
// replica can meet is refused early with 429 deadline_unmeetable (counted
// as reason deadline_shed) under admission; a meetable one is served and
// counted as reason deadline, and the prediction's error is observed.
func TestDeadlineHeader(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{
		Pipeline: orchestrator.Pipeline{Model: model, Stages: []orchestrator.Stage{
			{Name: "thinker", Policy: "deadline", Deadline: &orchestrator.Deadline{Admission: true}},
		}},
		// One replica: an unobserved one would be probed (router.DeadlineProbeAfter).
		ReplicasPerStage: 1,
		// About 100 ms of prefill for the prompt below: a first token no
		// replica can give within 1 ms.
		Sim: sim.Config{PrefillTokensPerSec: 2000},
	})
	a := startAPI(t, c, Config{}, nil, nil)
	client := a.openai()
	prompt := strings.Repeat("tell me about the weather ", 40)
	chat := func(deadline string) (*openai.ChatCompletion, error) {
		var opts []option.RequestOption
		if deadline != "" {
			opts = append(opts, option.WithHeader("X-Troupe-Deadline", deadline))
		}
		return client.Chat.Completions.New(testCtx(t), openai.ChatCompletionNewParams{
			Model:               model,
			Messages:            []openai.ChatCompletionMessageParamUnion{openai.UserMessage(prompt)},
			MaxCompletionTokens: openai.Int(3),
		}, opts...)
	}

	for _, bad := range []string{"ttft", "ttft=fast", "ttft=-5ms", "rtf=0", "ttfb=1s", "ttft=1s,ttft=2s", ","} {
		_, err := chat(bad)
		oe := apiErrorOf(t, err)
		assert.Equal(t, http.StatusBadRequest, oe.StatusCode, "header %q", bad)
		assert.Equal(t, "invalid_deadline", oe.Code, "header %q", bad)
		assert.Contains(t, oe.Message, "X-Troupe-Deadline", "header %q", bad)
	}

	// Without targets the policy balances load; the first answer teaches
	// it the replica's time to first output.
	_, err := chat("")
	require.NoError(t, err)
	assert.Equal(t, 1.0, counter(t, c, "troupe_router_decisions_total", "0", "reason", "load"))

	_, err = chat("ttft=30s")
	require.NoError(t, err)
	assert.Equal(t, 1.0, counter(t, c, "troupe_router_decisions_total", "0", "reason", "deadline"))

	// 1 ms is below any replica's predicted first token (the prefill).
	_, err = chat("ttft=1ms, ttfa=5s")
	oe := apiErrorOf(t, err)
	assert.Equal(t, http.StatusTooManyRequests, oe.StatusCode)
	assert.Equal(t, "deadline_unmeetable", oe.Code)
	assert.Contains(t, oe.Message, `stage "thinker"`)
	assert.Equal(t, 1.0, counter(t, c, "troupe_router_decisions_total", "0", "reason", "deadline_shed"))
	assert.Equal(t, 2.0, counter(t, c, "troupe_request_success_total", "0", "", ""), "the refused request never ran")

	// /v1/replicas shows the prediction for the next attempt.
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
	assert.Greater(t, *list.Data[0].Predicted, 0.02, "at least part of the prefill")
	assert.Less(t, *list.Data[0].Predicted, 30.0)

	fams, err := c.Metrics.Gather()
	require.NoError(t, err)
	var observed uint64
	for _, f := range fams {
		if f.GetName() == "troupe_router_deadline_prediction_error_seconds" {
			for _, m := range f.GetMetric() {
				observed += m.GetHistogram().GetSampleCount()
			}
		}
	}
	assert.Equal(t, uint64(1), observed, "the one request routed with a prediction is observed")
}

// On a pipeline routed by deadline, an audio answer's stages are routed to
// the header's first-audio target, and the vocoder's audio rate is
// observed: /v1/replicas shows it.
func TestDeadlineAudioRate(t *testing.T) {
	p := orchestrator.DefaultPipeline()
	for i := range p.Stages {
		p.Stages[i].Policy = "deadline"
	}
	c := startCluster(t, orchestratortest.Options{Pipeline: p, Sim: sim.Config{DecodeTokenLatency: 2 * time.Millisecond}})
	a := startAPI(t, c, Config{}, nil, nil)
	client := a.openai()
	params := openai.ChatCompletionNewParams{
		Model:               model,
		Messages:            []openai.ChatCompletionMessageParamUnion{openai.UserMessage("say hello to everyone here")},
		MaxCompletionTokens: openai.Int(8),
		Modalities:          []string{"text", "audio"},
		Audio: openai.ChatCompletionAudioParam{
			Format: openai.ChatCompletionAudioParamFormatWAV,
			Voice:  openai.ChatCompletionAudioParamVoiceUnion{OfString: openai.String("alloy")},
		},
	}
	res, err := client.Chat.Completions.New(testCtx(t), params, option.WithHeader("X-Troupe-Deadline", "ttft=30s,ttfa=30s,rtf=0.01"))
	require.NoError(t, err)
	require.NotEmpty(t, res.Choices[0].Message.Audio.Data)
	for stage := range 3 {
		assert.Equal(t, 1.0, counter(t, c, "troupe_router_decisions_total", strconv.Itoa(stage), "reason", "deadline"), "stage %d", stage)
	}

	resp, body := a.do(t, "GET", "/v1/replicas", nil, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode, "body: %s", body)
	var list struct {
		Data []struct {
			Stage     int      `json:"stage"`
			Predicted *float64 `json:"predicted_first_output_s"`
			RTF       *float64 `json:"rtf"`
		} `json:"data"`
	}
	require.NoError(t, json.Unmarshal(body, &list))
	require.Len(t, list.Data, 3)
	for _, r := range list.Data {
		require.NotNil(t, r.Predicted, "stage %d: observed", r.Stage)
		if r.Stage == 2 {
			require.NotNil(t, r.RTF, "the vocoder's audio rate is observed")
			assert.Positive(t, *r.RTF)
		} else {
			assert.Nil(t, r.RTF, "stage %d makes no audio", r.Stage)
		}
	}
}

// The deadline policy's prediction is queue-aware, seen from the front
// door: while two requests wait for their first token on the one replica,
// /v1/replicas predicts a new one three prefills away (its own and the two
// ahead), not a load factor's fraction more; once they have answered, the
// count is back to none (the prediction to one unit).
func TestDeadlinePredictionQueueAware(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{
		Pipeline: orchestrator.Pipeline{Model: model, Stages: []orchestrator.Stage{
			{Name: "thinker", Policy: "deadline", Deadline: &orchestrator.Deadline{Targets: orchestrator.Targets{TTFT: 30 * time.Second}}},
		}},
		ReplicasPerStage: 1,
		// About 700 ms of prefill for the prompt below: the window in which
		// both requests wait must outlast a poll of /v1/replicas on a
		// loaded machine under -race.
		Sim: sim.Config{PrefillTokensPerSec: 300},
	})
	a := startAPI(t, c, Config{}, nil, nil)
	client := a.openai()
	prompt := strings.Repeat("tell me about the weather ", 40)
	chat := func() error {
		_, err := client.Chat.Completions.New(testCtx(t), openai.ChatCompletionNewParams{
			Model:               model,
			Messages:            []openai.ChatCompletionMessageParamUnion{openai.UserMessage(prompt)},
			MaxCompletionTokens: openai.Int(2),
		})
		return err
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

	require.NoError(t, chat())
	unit := predicted()
	require.Greater(t, unit, 0.2, "the prefill is learned")

	errs := make(chan error, 2)
	for range 2 {
		go func() { errs <- chat() }()
	}
	var peak float64
	require.Eventually(t, func() bool {
		peak = max(peak, predicted())
		return peak >= 2.9*unit
	}, 30*time.Second, time.Millisecond, "two first tokens pending: three units (%.3f s each); the most seen %.3f s", unit, peak)
	for range 2 {
		require.NoError(t, <-errs)
	}
	assert.Less(t, predicted(), 0.75*peak, "none pending once both answered")
}

// A streamed later stage waits for its input, the stage before's output:
// the deadline policy learns the replica's own time from when its first
// input piece reached it, not from the attempt's start, and adds the
// stage's learned wait for its input (its lead) when it checks a target.
// Here the thinker takes about half a second to its first words and the
// talker, fed by it, a few tens of milliseconds after them: the talker's
// predicted first output stays its own, far below the wait (before, it
// was judged as slow as the thinker); and under admission a first-audio
// target shorter than the wait is refused up front (429, stage "talker")
// although the talker alone would be in time, while a longer one is
// served.
func TestDeadlineLaterStageExcludesInputWait(t *testing.T) {
	p := orchestrator.DefaultPipeline()
	p.Stages[1].Policy = "deadline"
	p.Stages[1].Deadline = &orchestrator.Deadline{Admission: true}
	c := startCluster(t, orchestratortest.Options{Pipeline: p, ReplicasPerStage: -1})
	quiet := slog.New(slog.DiscardHandler)
	fast := sim.Config{DecodeTokenLatency: 2 * time.Millisecond, Logger: quiet}
	// About 500 ms of prefill for the prompt below.
	slowPrefill := sim.Config{DecodeTokenLatency: 2 * time.Millisecond, PrefillTokensPerSec: 600, Logger: quiet}
	c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{Sim: &slowPrefill})
	c.AddWorker(t, "talker", orchestratortest.WorkerOptions{Sim: &fast})
	c.AddWorker(t, "vocoder", orchestratortest.WorkerOptions{Sim: &fast})
	require.Eventually(t, func() bool {
		n := 0
		for _, r := range c.Head.Replicas() {
			if r.State == "attached" {
				n++
			}
		}
		return n == 3
	}, 30*time.Second, 5*time.Millisecond)
	a := startAPI(t, c, Config{}, nil, nil)
	client := a.openai()
	n := 0
	chat := func(deadline string) (*openai.ChatCompletion, error) {
		n++ // a prompt of its own each: no prefix cached
		prompt := strconv.Itoa(n) + strings.Repeat(" tell me about the weather", 60)
		return client.Chat.Completions.New(testCtx(t), openai.ChatCompletionNewParams{
			Model:               model,
			Messages:            []openai.ChatCompletionMessageParamUnion{openai.UserMessage(prompt)},
			MaxCompletionTokens: openai.Int(8),
			Modalities:          []string{"text", "audio"},
			Audio: openai.ChatCompletionAudioParam{
				Format: openai.ChatCompletionAudioParamFormatWAV,
				Voice:  openai.ChatCompletionAudioParamVoiceUnion{OfString: openai.String("alloy")},
			},
		}, option.WithHeader("X-Troupe-Deadline", deadline))
	}
	var took time.Duration
	for range 3 {
		start := time.Now()
		res, err := chat("ttfa=30s")
		require.NoError(t, err)
		require.NotEmpty(t, res.Choices[0].Message.Audio.Data)
		took = time.Since(start)
	}
	require.Greater(t, took, 400*time.Millisecond, "the thinker's prefill is slow")

	resp, body := a.do(t, "GET", "/v1/replicas", nil, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode, "body: %s", body)
	var list struct {
		Data []struct {
			Stage     int      `json:"stage"`
			Predicted *float64 `json:"predicted_first_output_s"`
		} `json:"data"`
	}
	require.NoError(t, json.Unmarshal(body, &list))
	var talker *float64
	for _, r := range list.Data {
		if r.Stage == 1 {
			talker = r.Predicted
		}
	}
	require.NotNil(t, talker, "the talker's first outputs are observed")
	assert.Less(t, *talker, 0.2, "the talker's own time, without the ~500 ms it waited for the thinker")

	// 250 ms: the talker's own time fits, the wait for its input does not.
	_, err := chat("ttfa=250ms")
	oe := apiErrorOf(t, err)
	assert.Equal(t, http.StatusTooManyRequests, oe.StatusCode)
	assert.Equal(t, "deadline_unmeetable", oe.Code)
	assert.Contains(t, oe.Message, `stage "talker"`)
	assert.Equal(t, 1.0, counter(t, c, "troupe_router_decisions_total", "1", "reason", "deadline_shed"))

	_, err = chat("ttfa=20s")
	require.NoError(t, err)
	assert.Equal(t, 4.0, counter(t, c, "troupe_router_decisions_total", "1", "reason", "deadline"))
}
