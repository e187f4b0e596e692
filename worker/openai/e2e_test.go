package openai_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	oa "github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/tokenizers"
	"github.com/troupe-serving/troupe/worker/openai"
	"github.com/troupe-serving/troupe/worker/sim"
)

// TestThroughTwoHeads is the whole path over real HTTP and gRPC: an OpenAI
// client → head B → a worker with the openai engine → head A (the
// upstream, a real OpenAI-compatible server) → A's sim worker. Streaming,
// usage, an upstream 400 and a client disconnect all cross both heads.
func TestThroughTwoHeads(t *testing.T) {
	// A's sim decodes one token per 5 ms and holds at most 8×16 tokens.
	a := startUpstreamHead(t, orchestratortest.Options{Pipeline: thinkerOnly,
		Sim: sim.Config{DecodeTokenLatency: 5 * time.Millisecond, NumKVBlocks: 8, BlockSize: 16}})
	b := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, ReplicasPerStage: -1})
	e, err := openai.New(openai.Config{URL: a.base, Logger: quiet()})
	require.NoError(t, err)
	srv := startWorker(t, b, "thinker", e)
	b.WaitState(t, "thinker", srv.Member().ReplicaID, "attached")
	bBase := serveAPI(t, b)
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	httpClient := &http.Client{Transport: tr}
	client := oa.NewClient(option.WithBaseURL(bBase+"/v1/"), option.WithAPIKey("unused"), option.WithHTTPClient(httpClient), option.WithMaxRetries(0))
	ctx := testCtx(t)

	msgs := []*stagepb.ChatMessage{msg("system", "be brief"), msg("user", "what is a river")}
	want, wantTokens, _ := sim.ExpectedText(tokenizers.ChatText(msgs), 4, 12)
	params := oa.ChatCompletionNewParams{
		Model:               "troupe-omni-sim",
		Messages:            []oa.ChatCompletionMessageParamUnion{oa.SystemMessage("be brief"), oa.UserMessage("what is a river")},
		Seed:                oa.Int(4),
		MaxCompletionTokens: oa.Int(12),
		StreamOptions:       oa.ChatCompletionStreamOptionsParam{IncludeUsage: oa.Bool(true)},
	}

	t.Run("stream", func(t *testing.T) {
		stream := client.Chat.Completions.NewStreaming(ctx, params)
		var text strings.Builder
		var usage oa.CompletionUsage
		deltas := 0
		for stream.Next() {
			ch := stream.Current()
			if len(ch.Choices) == 0 {
				usage = ch.Usage
				continue
			}
			if ch.Choices[0].Delta.Content != "" {
				deltas++
			}
			text.WriteString(ch.Choices[0].Delta.Content)
		}
		require.NoError(t, stream.Err())
		require.NoError(t, stream.Close())
		assert.Equal(t, want, text.String())
		assert.Equal(t, int64(wantTokens), usage.CompletionTokens)
		assert.Equal(t, int64(len(tokenizers.Sim(tokenizers.ChatText(msgs)))), usage.PromptTokens)
		assert.Greater(t, deltas, 1, "streamed through both heads")
	})

	t.Run("whole", func(t *testing.T) {
		res, err := client.Chat.Completions.New(ctx, params)
		require.NoError(t, err)
		assert.Equal(t, want, res.Choices[0].Message.Content)
		assert.Equal(t, int64(wantTokens), res.Usage.CompletionTokens)
	})

	t.Run("upstream 400 reaches the client", func(t *testing.T) {
		p := params
		p.MaxCompletionTokens = oa.Int(500) // with ignore_eos: more than A's KV cache holds
		_, err := client.Chat.Completions.New(ctx, p, option.WithJSONSet("ignore_eos", true))
		var apiErr *oa.Error
		require.ErrorAs(t, err, &apiErr)
		assert.Equal(t, http.StatusBadRequest, apiErr.StatusCode)
		assert.Contains(t, apiErr.Message, "maximum context length", "the upstream's own message")
	})

	t.Run("client disconnect aborts upstream", func(t *testing.T) {
		before := a.Workers()[0].Engine.Snapshot().Finished
		aborted, lengths := before[stagepb.FinishReason_FINISH_REASON_ABORT], before[stagepb.FinishReason_FINISH_REASON_LENGTH]
		body, _ := json.Marshal(map[string]any{"model": "troupe-omni-sim", "stream": true, "max_tokens": 100, "ignore_eos": true,
			"messages": []map[string]string{{"role": "user", "content": "go on and on"}}})
		rctx, cancel := context.WithCancel(ctx)
		defer cancel()
		req, err := http.NewRequestWithContext(rctx, http.MethodPost, bBase+"/v1/chat/completions", bytes.NewReader(body))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/json")
		resp, err := httpClient.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
		sc := bufio.NewScanner(resp.Body)
		for texts := 0; texts < 2 && sc.Scan(); {
			if strings.Contains(sc.Text(), `"content":"`) && !strings.Contains(sc.Text(), `"content":""`) {
				texts++
			}
		}
		cancel() // the client goes away mid-answer
		up := a.Workers()[0].Engine
		require.Eventually(t, func() bool {
			s := up.Snapshot()
			return s.Finished[stagepb.FinishReason_FINISH_REASON_ABORT] == aborted+1 && s.Running == 0
		}, wait, 5*time.Millisecond, "head A's engine aborted the request")
		assert.Equal(t, lengths, up.Snapshot().Finished[stagepb.FinishReason_FINISH_REASON_LENGTH], "it never ran to its 100 tokens")
	})
}

// TestSamplingReachesUpstream: every sampling parameter an OpenAI client
// sends to the head reaches the upstream as given, and none is reported
// as ignored.
func TestSamplingReachesUpstream(t *testing.T) {
	f := newVLLM(t)
	f.route("POST /v1/chat/completions", func(w http.ResponseWriter, _ *http.Request) {
		sse(w, contUsage("hi", 4, 1), finish("stop"), usageEvent(4, 1, 0), "[DONE]")
	})
	b := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, ReplicasPerStage: -1})
	e, err := openai.New(openai.Config{URL: f.URL, Logger: quiet()})
	require.NoError(t, err)
	srv := startWorker(t, b, "thinker", e)
	b.WaitState(t, "thinker", srv.Member().ReplicaID, "attached")
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	client := oa.NewClient(option.WithBaseURL(serveAPI(t, b)+"/v1/"), option.WithAPIKey("unused"), option.WithHTTPClient(&http.Client{Transport: tr}), option.WithMaxRetries(0))

	var raw *http.Response
	res, err := client.Chat.Completions.New(testCtx(t), oa.ChatCompletionNewParams{
		Model:               "troupe-omni-sim",
		Messages:            []oa.ChatCompletionMessageParamUnion{oa.UserMessage("hello")},
		MaxCompletionTokens: oa.Int(11),
		Temperature:         oa.Float(0.25),
		TopP:                oa.Float(0.5),
		FrequencyPenalty:    oa.Float(-0.75),
		PresencePenalty:     oa.Float(1.25),
		Seed:                oa.Int(7),
		Stop:                oa.ChatCompletionNewParamsStopUnion{OfStringArray: []string{"x", "yz"}},
		LogitBias:           map[string]int64{"50256": -100, "13": 5},
	}, option.WithJSONSet("top_k", 40), option.WithJSONSet("min_p", 0.125), option.WithJSONSet("repetition_penalty", 1.5),
		option.WithJSONSet("min_tokens", 2), option.WithJSONSet("ignore_eos", true), option.WithResponseInto(&raw))
	require.NoError(t, err)
	assert.Equal(t, "hi", res.Choices[0].Message.Content)
	assert.Empty(t, raw.Header.Get("X-Troupe-Ignored-Params"), "every parameter went somewhere")

	got := f.lastBody()
	for k, want := range map[string]any{
		"max_completion_tokens": 11.0, "temperature": 0.25, "top_p": 0.5, "frequency_penalty": -0.75, "presence_penalty": 1.25,
		"seed": 7.0, "stop": []any{"x", "yz"}, "logit_bias": map[string]any{"50256": -100.0, "13": 5.0},
		"top_k": 40.0, "min_p": 0.125, "repetition_penalty": 1.5, "min_tokens": 2.0, "ignore_eos": true,
	} {
		assert.Equal(t, want, got[k], k)
	}
	assert.Equal(t, 11.0, got["max_tokens"], "and goes as max_tokens too, which every server reads")
}

// headWithWorkers is a head whose one stage is served by openai workers,
// one per fake upstream, and an OpenAI client of its HTTP API.
func headWithWorkers(t *testing.T, ups ...*fake) (*orchestratortest.Cluster, oa.Client) {
	t.Helper()
	b := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, ReplicasPerStage: -1, MaxMigrations: 2})
	for _, f := range ups {
		e, err := openai.New(openai.Config{URL: f.URL, Logger: quiet()})
		require.NoError(t, err)
		srv := startWorker(t, b, "thinker", e)
		b.WaitState(t, "thinker", srv.Member().ReplicaID, "attached")
	}
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	return b, oa.NewClient(option.WithBaseURL(serveAPI(t, b)+"/v1/"), option.WithAPIKey("unused"), option.WithHTTPClient(&http.Client{Transport: tr}), option.WithMaxRetries(0))
}

// total sums a metric family over all its series.
func total(t *testing.T, g prometheus.Gatherer, name string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	require.NoError(t, err)
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			switch {
			case m.GetCounter() != nil:
				sum += m.GetCounter().GetValue()
			case m.GetHistogram() != nil:
				sum += m.GetHistogram().GetSampleSum()
			}
		}
	}
	return sum
}

// cutOrContinue answers a first request with 2 chunks of 2 tokens each
// and then cuts the stream, and a continuation (continue_final_message)
// with one token up to its limit. f is the fake it serves (which has read
// the body).
func cutOrContinue(f *fake) http.HandlerFunc {
	return func(w http.ResponseWriter, _ *http.Request) {
		if f.lastBody()["continue_final_message"] == true {
			sse(w, contUsage(" five", 4, 1), finish("length"), usageEvent(4, 1, 0), "[DONE]")
			return
		}
		sse(w, contUsage("one two", 4, 2), contUsage(" three four", 4, 4))
		panic(http.ErrAbortHandler)
	}
}

// TestMigrationKeepsMaxTokens: an answer cut after 4 tokens (2 per delta)
// continues on another vLLM with what is left of max_tokens, and the
// usage is what the client received from both.
func TestMigrationKeepsMaxTokens(t *testing.T) {
	a1, a2 := newVLLM(t), newVLLM(t)
	a1.route("POST /v1/chat/completions", cutOrContinue(a1))
	a2.route("POST /v1/chat/completions", cutOrContinue(a2))
	b, client := headWithWorkers(t, a1, a2)
	stream := client.Chat.Completions.NewStreaming(testCtx(t), oa.ChatCompletionNewParams{
		Model: "troupe-omni-sim", Messages: []oa.ChatCompletionMessageParamUnion{oa.UserMessage("count")},
		MaxCompletionTokens: oa.Int(5), StreamOptions: oa.ChatCompletionStreamOptionsParam{IncludeUsage: oa.Bool(true)},
	})
	var text strings.Builder
	var usage oa.CompletionUsage
	for stream.Next() {
		ch := stream.Current()
		if len(ch.Choices) == 0 {
			usage = ch.Usage
			continue
		}
		text.WriteString(ch.Choices[0].Delta.Content)
	}
	require.NoError(t, stream.Err())
	require.NoError(t, stream.Close())
	assert.Equal(t, "one two three four five", text.String())
	assert.Equal(t, int64(5), usage.CompletionTokens, "4 from the cut replica, 1 from the continuation")

	cont := a2.lastBody()
	if cont["continue_final_message"] != true {
		cont = a1.lastBody()
	}
	require.Equal(t, true, cont["continue_final_message"], "the answer was continued")
	assert.EqualValues(t, 1, cont["max_completion_tokens"], "max_tokens holds: 5 asked, 4 delivered")
	assert.Equal(t, 5.0, total(t, b.Metrics, "troupe_generation_tokens_total"), "the cut attempt's tokens are counted too")
}

// TestNoContinuationWithoutSupport: an upstream that is not vLLM cannot
// continue a chat answer, so an answer cut after output ends with a clear
// error and nothing is sent as a continuation.
func TestNoContinuationWithoutSupport(t *testing.T) {
	a1, a2 := newFake(t), newFake(t)
	a1.route("POST /v1/chat/completions", cutOrContinue(a1))
	a2.route("POST /v1/chat/completions", cutOrContinue(a2))
	b, client := headWithWorkers(t, a1, a2)
	stream := client.Chat.Completions.NewStreaming(testCtx(t), oa.ChatCompletionNewParams{
		Model: "troupe-omni-sim", Messages: []oa.ChatCompletionMessageParamUnion{oa.UserMessage("count")}, MaxCompletionTokens: oa.Int(5),
	})
	var text strings.Builder
	for stream.Next() {
		if ch := stream.Current(); len(ch.Choices) > 0 {
			text.WriteString(ch.Choices[0].Delta.Content)
		}
	}
	require.Error(t, stream.Err())
	assert.Contains(t, stream.Err().Error(), "cannot be continued")
	_ = stream.Close()
	assert.Equal(t, "one two three four", text.String())
	assert.Equal(t, 1, a1.posts()+a2.posts(), "no continuation sent")
	assert.Equal(t, 4.0, total(t, b.Metrics, "troupe_generation_tokens_total"), "the usage the chunks carried, counted for the failed request")
}

// TestCancelledRequestCounted: the tokens a cancelled request received
// count in the head's counters and histograms.
func TestCancelledRequestCounted(t *testing.T) {
	a := newVLLM(t)
	a.route("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		sse(w, contUsage("one two", 4, 2), contUsage(" three", 4, 3))
		<-r.Context().Done()
	})
	b, client := headWithWorkers(t, a)
	ctx, cancel := context.WithCancel(testCtx(t))
	defer cancel()
	stream := client.Chat.Completions.NewStreaming(ctx, oa.ChatCompletionNewParams{
		Model: "troupe-omni-sim", Messages: []oa.ChatCompletionMessageParamUnion{oa.UserMessage("count")}, MaxCompletionTokens: oa.Int(50),
	})
	var text strings.Builder
	for text.String() != "one two three" && stream.Next() {
		if ch := stream.Current(); len(ch.Choices) > 0 {
			text.WriteString(ch.Choices[0].Delta.Content)
		}
	}
	cancel()
	_ = stream.Close()
	require.Eventually(t, func() bool {
		return total(t, b.Metrics, "troupe_request_generation_tokens") == 3
	}, wait, 5*time.Millisecond, "the request's histogram records its 3 tokens")
	assert.Equal(t, 3.0, total(t, b.Metrics, "troupe_generation_tokens_total"))
	assert.Equal(t, 4.0, total(t, b.Metrics, "troupe_prompt_tokens_total"), "prompt tokens on the first chunk (continuous usage)")
}
