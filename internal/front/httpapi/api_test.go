package httpapi

import (
	"bufio"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker/sim"
)

const model = "troupe-omni-sim"

func chatParams(prompt string, seed, maxTokens int64) openai.ChatCompletionNewParams {
	return openai.ChatCompletionNewParams{
		Model: model,
		Messages: []openai.ChatCompletionMessageParamUnion{
			openai.SystemMessage("be brief"),
			openai.UserMessage(prompt),
		},
		Seed:                openai.Int(seed),
		MaxCompletionTokens: openai.Int(maxTokens),
	}
}

// TestOpenAIClient drives the API with the official Go client against a
// real head and sim workers.
func TestOpenAIClient(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{})
	a := startAPI(t, c, Config{}, nil, nil)
	client := a.openai()
	ctx := testCtx(t)

	var whole *openai.ChatCompletion
	t.Run("chat", func(t *testing.T) {
		prompt0 := counter(t, c, "troupe_prompt_tokens_total", "0", "", "")
		gen0 := counter(t, c, "troupe_generation_tokens_total", "0", "", "")
		var raw *http.Response
		res, err := client.Chat.Completions.New(ctx, chatParams("tell me about the stages of a pipeline", 7, 12),
			option.WithHeader("X-Request-Id", "req-chat-1"), option.WithResponseInto(&raw))
		require.NoError(t, err)
		whole = res
		assert.Equal(t, "req-chat-1", raw.Header.Get("X-Request-Id"))
		assert.Regexp(t, traceparentRE, raw.Header.Get("Traceparent"))
		require.Len(t, raw.Header.Values("Date"), 1)
		date, err := http.ParseTime(raw.Header.Get("Date"))
		require.NoError(t, err, "the Date header is an HTTP date")
		assert.WithinDuration(t, time.Now(), date, 5*time.Second)
		assert.Regexp(t, `^chatcmpl-[0-9a-f]{32}$`, res.ID, "the response id is its own, not the request id")
		assert.Equal(t, "chat.completion", string(res.Object))
		assert.Equal(t, model, res.Model)
		require.Len(t, res.Choices, 1)
		ch := res.Choices[0]
		assert.Equal(t, "assistant", string(ch.Message.Role))
		assert.NotEmpty(t, ch.Message.Content)
		assert.Contains(t, []string{"stop", "length"}, ch.FinishReason)
		assert.Empty(t, ch.Message.Audio.Data, "a text request has no audio")
		u := res.Usage
		assert.Positive(t, u.PromptTokens)
		assert.Positive(t, u.CompletionTokens)
		assert.LessOrEqual(t, u.CompletionTokens, int64(12))
		assert.Equal(t, u.PromptTokens+u.CompletionTokens, u.TotalTokens)
		// The usage is what the head's metrics recorded for stage 0.
		assert.Equal(t, float64(u.PromptTokens), counter(t, c, "troupe_prompt_tokens_total", "0", "", "")-prompt0)
		assert.Equal(t, float64(u.CompletionTokens), counter(t, c, "troupe_generation_tokens_total", "0", "", "")-gen0)
		// A text request runs stage 0 alone.
		assert.Zero(t, counter(t, c, "troupe_request_success_total", "1", "", ""))

		// The same X-Request-Id again (a client retrying, or a proxy
		// that sets a constant one): a new response id all the same.
		again, err := client.Chat.Completions.New(ctx, chatParams("tell me about the stages of a pipeline", 7, 12),
			option.WithHeader("X-Request-Id", "req-chat-1"), option.WithResponseInto(&raw))
		require.NoError(t, err)
		assert.Equal(t, "req-chat-1", raw.Header.Get("X-Request-Id"), "the request id stays in the header")
		assert.Equal(t, ch.Message.Content, again.Choices[0].Message.Content, "same seed, same answer")
		assert.NotEqual(t, res.ID, again.ID, "each response gets its own id")
	})

	t.Run("chat stream with usage", func(t *testing.T) {
		require.NotNil(t, whole)
		p := chatParams("tell me about the stages of a pipeline", 7, 12)
		p.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
		stream := client.Chat.Completions.NewStreaming(ctx, p)
		var text strings.Builder
		var chunks, usageChunks int
		var finish string
		var final openai.CompletionUsage
		for stream.Next() {
			ch := stream.Current()
			chunks++
			assert.Equal(t, "chat.completion.chunk", string(ch.Object))
			assert.True(t, strings.HasPrefix(ch.ID, "chatcmpl-"))
			if len(ch.Choices) == 0 {
				usageChunks++
				final = ch.Usage
				continue
			}
			assert.Zero(t, usageChunks, "the usage chunk is the last one")
			text.WriteString(ch.Choices[0].Delta.Content)
			if ch.Choices[0].FinishReason != "" {
				finish = ch.Choices[0].FinishReason
			}
		}
		require.NoError(t, stream.Err())
		require.NoError(t, stream.Close())
		assert.Equal(t, whole.Choices[0].Message.Content, text.String(), "the stream carries the same text")
		assert.Equal(t, whole.Choices[0].FinishReason, finish)
		assert.Equal(t, 1, usageChunks)
		assert.Equal(t, whole.Usage.PromptTokens, final.PromptTokens)
		assert.Equal(t, whole.Usage.CompletionTokens, final.CompletionTokens)
		assert.Equal(t, final.PromptTokens+final.CompletionTokens, final.TotalTokens)
		assert.Greater(t, chunks, 3, "role, text, finish and usage chunks")
	})

	t.Run("chat audio", func(t *testing.T) {
		vocoder0 := counter(t, c, "troupe_request_success_total", "2", "finished_reason", "stop") +
			counter(t, c, "troupe_request_success_total", "2", "finished_reason", "length")
		p := chatParams("say hello", 3, 10)
		p.Modalities = []string{"text", "audio"}
		p.Audio = openai.ChatCompletionAudioParam{
			Format: openai.ChatCompletionAudioParamFormatWAV,
			Voice:  openai.ChatCompletionAudioParamVoiceUnion{OfString: openai.String("alloy")},
		}
		before := time.Now()
		res, err := client.Chat.Completions.New(ctx, p)
		require.NoError(t, err)
		msg := res.Choices[0].Message
		require.NotEmpty(t, msg.Audio.Data)
		assert.Equal(t, "audio_"+strings.TrimPrefix(res.ID, "chatcmpl-"), msg.Audio.ID)
		assert.Equal(t, msg.Content, msg.Audio.Transcript)
		assert.NotEmpty(t, msg.Audio.Transcript)
		assert.Greater(t, msg.Audio.ExpiresAt, before.Unix())

		wav, err := base64.StdEncoding.DecodeString(msg.Audio.Data)
		require.NoError(t, err)
		w := parseWAV(t, wav)
		assert.Equal(t, 1, w.format)
		assert.Equal(t, 1, w.channels)
		assert.Equal(t, 16, w.bitsPerSample)
		assert.Equal(t, sim.SampleRate, w.sampleRate)
		assert.Equal(t, 2*sim.SampleRate, w.byteRate)
		require.NotEmpty(t, w.data)
		samples := len(w.data) / 2
		assert.Equal(t, time.Duration(samples)*time.Second/time.Duration(sim.SampleRate), w.duration())
		assert.Positive(t, w.duration())

		vocoder1 := counter(t, c, "troupe_request_success_total", "2", "finished_reason", "stop") +
			counter(t, c, "troupe_request_success_total", "2", "finished_reason", "length")
		assert.Equal(t, 1.0, vocoder1-vocoder0, "audio runs every stage")

		// Same request, streamed: text and audio arrive as they are made, in
		// OpenAI's streamed-audio shape (pcm16); the samples are exactly
		// those of the whole answer's WAV.
		p.Audio.Format = openai.ChatCompletionAudioParamFormatPcm16
		stream := client.Chat.Completions.NewStreaming(ctx, p)
		var text, transcript strings.Builder
		var pcm []byte
		audioChunks, firstAudio, lastText := 0, -1, -1
		for i := 0; stream.Next(); i++ {
			ch := stream.Current()
			if len(ch.Choices) == 0 {
				continue
			}
			d := ch.Choices[0].Delta
			text.WriteString(d.Content)
			if d.Content != "" {
				lastText = i
			}
			transcript.WriteString(d.Audio.Transcript)
			if d.Audio.Data != "" {
				assert.Equal(t, "audio_"+strings.TrimPrefix(ch.ID, "chatcmpl-"), d.Audio.ID, "one audio id per answer")
				if audioChunks == 0 {
					firstAudio = i
					assert.Greater(t, d.Audio.ExpiresAt, before.Unix())
				}
				b, err := base64.StdEncoding.DecodeString(d.Audio.Data)
				require.NoError(t, err)
				pcm = append(pcm, b...)
				audioChunks++
			}
		}
		require.NoError(t, stream.Err())
		require.NoError(t, stream.Close())
		assert.Equal(t, msg.Content, text.String())
		assert.Equal(t, msg.Content, transcript.String())
		assert.Equal(t, w.data, pcm, "seeded pipeline: the streamed samples are the WAV's")
		assert.Greater(t, audioChunks, 1, "audio in more than one chunk")
		assert.Positive(t, firstAudio)
		assert.Positive(t, lastText)
	})

	t.Run("completions", func(t *testing.T) {
		var raw *http.Response
		res, err := client.Completions.New(ctx, openai.CompletionNewParams{
			Model:     model,
			Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String("once upon a time")},
			MaxTokens: openai.Int(8),
			Seed:      openai.Int(1),
		}, option.WithResponseInto(&raw))
		require.NoError(t, err)
		assert.Regexp(t, `^cmpl-[0-9a-f]{32}$`, res.ID)
		assert.NotContains(t, res.ID, raw.Header.Get("X-Request-Id"))
		assert.Equal(t, "text_completion", string(res.Object))
		require.Len(t, res.Choices, 1)
		assert.NotEmpty(t, res.Choices[0].Text)
		assert.Equal(t, res.Usage.PromptTokens+res.Usage.CompletionTokens, res.Usage.TotalTokens)
		assert.LessOrEqual(t, res.Usage.CompletionTokens, int64(8))

		stream := client.Completions.NewStreaming(ctx, openai.CompletionNewParams{
			Model:         model,
			Prompt:        openai.CompletionNewParamsPromptUnion{OfString: openai.String("once upon a time")},
			MaxTokens:     openai.Int(8),
			Seed:          openai.Int(1),
			StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
		})
		var text strings.Builder
		var final openai.CompletionUsage
		for stream.Next() {
			ch := stream.Current()
			if len(ch.Choices) == 0 {
				final = ch.Usage
				continue
			}
			text.WriteString(ch.Choices[0].Text)
		}
		require.NoError(t, stream.Err())
		require.NoError(t, stream.Close())
		assert.Equal(t, res.Choices[0].Text, text.String())
		assert.Equal(t, res.Usage.TotalTokens, final.TotalTokens)
	})

	t.Run("models", func(t *testing.T) {
		page, err := client.Models.List(ctx)
		require.NoError(t, err)
		require.Len(t, page.Data, 1)
		assert.Equal(t, model, page.Data[0].ID)
		assert.Equal(t, "troupe", page.Data[0].OwnedBy)

		m, err := client.Models.Get(ctx, model)
		require.NoError(t, err)
		assert.Equal(t, model, m.ID)

		_, err = client.Models.Get(ctx, "gpt-4o")
		oe := apiErrorOf(t, err)
		assert.Equal(t, http.StatusNotFound, oe.StatusCode)
		assert.Equal(t, "model_not_found", oe.Code)
	})

	t.Run("client errors", func(t *testing.T) {
		p := chatParams("hi", 1, 4)
		p.N = openai.Int(2)
		_, err := client.Chat.Completions.New(ctx, p)
		oe := apiErrorOf(t, err)
		assert.Equal(t, http.StatusBadRequest, oe.StatusCode)
		assert.Equal(t, "n", oe.Param)
		assert.Equal(t, "unsupported", oe.Code)

		p = chatParams("hi", 1, 4)
		p.Model = "gpt-4o"
		_, err = client.Chat.Completions.New(ctx, p)
		assert.Equal(t, http.StatusNotFound, apiErrorOf(t, err).StatusCode)
	})
}

// TestErrors checks every error class in OpenAI's error shape.
func TestErrors(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{})
	a := startAPI(t, c, Config{MaxBodyBytes: 4096}, nil, nil)
	const msgs = `"messages":[{"role":"user","content":"hi"}]`
	cases := []struct {
		name, method, path, body string
		status                   int
		typ, code, param         string
	}{
		{"invalid json", "POST", "/v1/chat/completions", `{"model":`, 400, typeInvalidRequest, "invalid_json", ""},
		{"empty body", "POST", "/v1/completions", ``, 400, typeInvalidRequest, "invalid_json", ""},
		{"missing model", "POST", "/v1/chat/completions", `{` + msgs + `}`, 400, typeInvalidRequest, "missing_field", "model"},
		{"missing messages", "POST", "/v1/chat/completions", `{"model":"troupe-omni-sim"}`, 400, typeInvalidRequest, "missing_field", "messages"},
		{"missing prompt", "POST", "/v1/completions", `{"model":"troupe-omni-sim"}`, 400, typeInvalidRequest, "missing_field", "prompt"},
		{"wrong type", "POST", "/v1/chat/completions", `{"model":"troupe-omni-sim",` + msgs + `,"max_tokens":"ten"}`, 400, typeInvalidRequest, "invalid_type", "max_tokens"},
		{"wrong type nested", "POST", "/v1/chat/completions", `{"model":"troupe-omni-sim","messages":[{"role":"user","content":"a"},{"role":7}]}`, 400, typeInvalidRequest, "invalid_type", "messages[1].role"},
		{"max_tokens zero", "POST", "/v1/chat/completions", `{"model":"troupe-omni-sim",` + msgs + `,"max_tokens":0}`, 400, typeInvalidRequest, "invalid_value", "max_tokens"},
		{"max_completion_tokens too big", "POST", "/v1/completions", `{"model":"troupe-omni-sim","prompt":"a","max_completion_tokens":2000000}`, 400, typeInvalidRequest, "invalid_value", "max_completion_tokens"},
		{"n > 1", "POST", "/v1/chat/completions", `{"model":"troupe-omni-sim",` + msgs + `,"n":3}`, 400, typeInvalidRequest, "unsupported", "n"},
		{"audio mp3", "POST", "/v1/chat/completions", `{"model":"troupe-omni-sim",` + msgs + `,"modalities":["text","audio"],"audio":{"voice":"alloy","format":"mp3"}}`, 400, typeInvalidRequest, "unsupported", "audio.format"},
		{"longer than the context", "POST", "/v1/completions", `{"model":"troupe-omni-sim","prompt":"a","max_tokens":1048576,"ignore_eos":true}`, 400, typeInvalidRequest, "context_length_exceeded", ""},
		{"unknown model", "POST", "/v1/chat/completions", `{"model":"gpt-4o",` + msgs + `}`, 404, typeNotFound, "model_not_found", "model"},
		{"unknown route", "GET", "/v1/nothing", ``, 404, typeNotFound, "not_found", ""},
		{"unknown root", "POST", "/", `{}`, 404, typeNotFound, "not_found", ""},
		{"wrong method", "GET", "/v1/chat/completions", ``, 405, typeInvalidRequest, "method_not_allowed", ""},
		{"wrong method admin", "GET", "/v1/replicas/0/0/sleep", ``, 405, typeInvalidRequest, "method_not_allowed", ""},
		{"body too large", "POST", "/v1/chat/completions", `{"model":"troupe-omni-sim","messages":[{"role":"user","content":"` + strings.Repeat("x", 5000) + `"}]}`, 413, typeInvalidRequest, "request_too_large", ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var body io.Reader
			if tc.body != "" || tc.method == "POST" {
				body = strings.NewReader(tc.body)
			}
			resp, data := a.do(t, tc.method, tc.path, body, nil)
			d := wantError(t, resp, data, tc.status, tc.typ, tc.code)
			if tc.param == "" {
				assert.Nil(t, d.Param, "param is null")
			} else {
				require.NotNil(t, d.Param)
				assert.Equal(t, tc.param, *d.Param)
			}
			if tc.status == http.StatusMethodNotAllowed {
				assert.Contains(t, resp.Header.Get("Allow"), "POST")
			}
		})
	}

	t.Run("unclean path is served, not redirected", func(t *testing.T) {
		resp, body := a.do(t, "GET", "/v1//models", nil, nil)
		require.Equal(t, http.StatusOK, resp.StatusCode, "body: %s", body)
		assert.Equal(t, "/v1//models", resp.Request.URL.Path, "no redirect was followed")
		assert.Contains(t, string(body), model)
	})

	t.Run("413 without content-length", func(t *testing.T) {
		// A reader of unknown length makes the client send chunked; the
		// limit then trips while reading.
		body := io.MultiReader(strings.NewReader(`{"model":"troupe-omni-sim","prompt":"`), strings.NewReader(strings.Repeat("y", 8192)), strings.NewReader(`"}`))
		req, err := http.NewRequestWithContext(testCtx(t), http.MethodPost, a.base+"/v1/completions", io.NopCloser(body))
		require.NoError(t, err)
		require.Equal(t, int64(0), req.ContentLength, "length unknown: sent chunked")
		resp, err := a.client.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		data, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		wantError(t, resp, data, http.StatusRequestEntityTooLarge, typeInvalidRequest, "request_too_large")
	})

	t.Run("413 from content-length before reading", func(t *testing.T) {
		// Announce a gigabyte and send none of it: only a server that
		// refuses from the header alone can answer.
		conn, err := net.Dial("tcp", strings.TrimPrefix(a.base, "http://"))
		require.NoError(t, err)
		defer conn.Close()
		require.NoError(t, conn.SetDeadline(time.Now().Add(wait)))
		_, err = fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n{", 1<<30)
		require.NoError(t, err)
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		require.NoError(t, err)
		defer resp.Body.Close()
		data, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		wantError(t, resp, data, http.StatusRequestEntityTooLarge, typeInvalidRequest, "request_too_large")
		assert.True(t, resp.Close, "the connection is closed: the rest of the body is never read")
	})
}

// withField adds a field to a JSON object.
func withField(obj, field string) string {
	return strings.TrimSuffix(obj, "}") + "," + field + "}"
}

// TestNoReplica: a stage without a replica is 503 with Retry-After, and
// /readyz says which.
func TestNoReplica(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{ReplicasPerStage: -1})
	a := startAPI(t, c, Config{}, nil, nil)

	resp, body := a.do(t, "GET", "/readyz", nil, nil)
	assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	assert.Contains(t, string(body), "thinker")
	wantIDs(t, resp)

	chat := `{"model":"troupe-omni-sim","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`
	resp, body = a.post(t, "/v1/chat/completions", chat)
	wantError(t, resp, body, http.StatusServiceUnavailable, typeServer, "no_replica")
	assert.Equal(t, "1", resp.Header.Get("Retry-After"))

	// Streaming requests fail the same way: nothing was streamed yet.
	resp, body = a.post(t, "/v1/chat/completions", withField(chat, `"stream":true`))
	wantError(t, resp, body, http.StatusServiceUnavailable, typeServer, "no_replica")

	// With the thinker alone, text works but audio (every stage) is 503.
	w := c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{})
	c.WaitState(t, "thinker", w.ReplicaID(), "attached")
	resp, body = a.post(t, "/v1/chat/completions", chat)
	require.Equal(t, http.StatusOK, resp.StatusCode, "body: %s", body)
	resp, body = a.post(t, "/v1/chat/completions", withField(chat, `"modalities":["text","audio"]`))
	d := wantError(t, resp, body, http.StatusServiceUnavailable, typeServer, "no_replica")
	assert.Contains(t, d.Message, "talker")
	assert.Equal(t, "1", resp.Header.Get("Retry-After"))

	resp, body = a.do(t, "GET", "/readyz", nil, nil)
	assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	assert.Contains(t, string(body), "talker")
}

// TestDrainTurnsReadyzUnready: once the head drains, /readyz is 503 (a
// load balancer stops sending) while requests are still served.
func TestDrainTurnsReadyzUnready(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{Pipeline: orchestrator.Pipeline{Model: model, Stages: []orchestrator.Stage{{Name: "thinker"}}}})
	a := startAPI(t, c, Config{}, nil, nil)
	resp, _ := a.do(t, "GET", "/readyz", nil, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode)

	a.Drain()
	resp, body := a.do(t, "GET", "/readyz", nil, nil)
	d := wantError(t, resp, body, http.StatusServiceUnavailable, typeServer, "shutting_down")
	assert.Equal(t, "not ready: shutting down", d.Message)
	resp, _ = a.do(t, "GET", "/healthz", nil, nil)
	assert.Equal(t, http.StatusOK, resp.StatusCode, "alive while draining")
	resp, body = a.post(t, "/v1/chat/completions", `{"model":"troupe-omni-sim","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`)
	assert.Equal(t, http.StatusOK, resp.StatusCode, "still serving: %s", body)
}

// TestStageFailure: a replica that fails the request (here: its engine was
// put to sleep behind the head's back, so it refuses work) is 502.
func TestStageFailure(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{ReplicasPerStage: -1})
	a := startAPI(t, c, Config{}, nil, nil)
	w := c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{})
	c.WaitState(t, "thinker", w.ReplicaID(), "attached")
	_, err := w.Engine.Sleep(t.Context(), 1)
	require.NoError(t, err)

	resp, body := a.post(t, "/v1/completions", `{"model":"troupe-omni-sim","prompt":"hi","max_tokens":4}`)
	d := wantError(t, resp, body, http.StatusBadGateway, typeServer, "stage_failed")
	assert.Contains(t, d.Message, "thinker")
}

// TestAudioWithoutAudioStage: asking a text-only pipeline for audio is a
// 502 that says so, not an empty WAV.
func TestAudioWithoutAudioStage(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{Pipeline: orchestrator.Pipeline{Model: model, Stages: []orchestrator.Stage{{Name: "thinker"}}}})
	a := startAPI(t, c, Config{}, nil, nil)
	chat := `{"model":"troupe-omni-sim","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"modalities":["text","audio"]}`
	resp, body := a.post(t, "/v1/chat/completions", chat)
	wantError(t, resp, body, http.StatusBadGateway, typeServer, "no_audio")
	resp, body = a.post(t, "/v1/chat/completions", withField(chat, `"stream":true`))
	require.Equal(t, http.StatusOK, resp.StatusCode, "the text streamed before the audio was missed")
	assert.Contains(t, string(body), `"code":"no_audio"`)
	assert.NotContains(t, string(body), "[DONE]")
}

// TestAuth: with an API key every route but /metrics and the probes needs
// it, admin included.
func TestAuth(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{})
	a := startAPI(t, c, Config{APIKey: "s3cret", Gatherer: c.Metrics}, nil, nil)
	bearer := func(k string) http.Header { return http.Header{"Authorization": {k}} }

	for _, route := range []struct{ method, path string }{
		{"POST", "/v1/chat/completions"}, {"POST", "/v1/completions"}, {"GET", "/v1/models"},
		{"GET", "/v1/replicas"}, {"POST", "/v1/replicas/0/0/sleep"}, {"POST", "/v1/replicas/thinker/0/wake_up"},
		{"GET", "/v1/nothing"},
	} {
		for _, h := range []http.Header{nil, bearer("Bearer wrong"), bearer("s3cret"), bearer("Basic s3cret"), bearer("Bearer s3cret2")} {
			resp, body := a.do(t, route.method, route.path, nil, h)
			wantError(t, resp, body, http.StatusUnauthorized, typeAuthentication, "invalid_api_key")
			assert.Contains(t, resp.Header.Get("WWW-Authenticate"), "Bearer")
		}
	}
	for _, path := range []string{"/metrics", "/healthz", "/readyz"} {
		resp, _ := a.do(t, "GET", path, nil, nil)
		assert.Equal(t, http.StatusOK, resp.StatusCode, path)
		wantIDs(t, resp)
	}
	resp, body := a.do(t, "GET", "/v1/models", nil, bearer("Bearer s3cret"))
	assert.Equal(t, http.StatusOK, resp.StatusCode, "body: %s", body)
	resp, _ = a.do(t, "GET", "/v1/replicas", nil, bearer("bearer s3cret"))
	assert.Equal(t, http.StatusOK, resp.StatusCode, "the scheme is case-insensitive")

	// The official client sends the key as a bearer token.
	ctx := testCtx(t)
	good, bad := a.openai(option.WithAPIKey("s3cret")), a.openai(option.WithAPIKey("nope"))
	_, err := good.Chat.Completions.New(ctx, chatParams("hi", 1, 3))
	require.NoError(t, err)
	_, err = bad.Chat.Completions.New(ctx, chatParams("hi", 1, 3))
	assert.Equal(t, http.StatusUnauthorized, apiErrorOf(t, err).StatusCode)
}

// TestAdminKey: the inference key cannot put replicas to sleep. With an
// admin key, only it opens the admin routes (the API key gets 403) (and it opens the others too);
// without one, the API key reads /v1/replicas but sleep and wake_up are 403.
func TestAdminKey(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{})
	bearer := func(k string) http.Header { return http.Header{"Authorization": {"Bearer " + k}} }

	a := startAPI(t, c, Config{APIKey: "infer", AdminAPIKey: "admin", Gatherer: c.Metrics}, nil, nil)
	for _, route := range []struct{ method, path string }{
		{"GET", "/v1/replicas"}, {"POST", "/v1/replicas/thinker/0/sleep"}, {"POST", "/v1/replicas/thinker/0/wake_up"},
	} {
		resp, b := a.do(t, route.method, route.path, nil, bearer("infer"))
		wantError(t, resp, b, http.StatusForbidden, typePermission, "admin_key_required")
		resp, b = a.do(t, route.method, route.path, nil, nil)
		wantError(t, resp, b, http.StatusUnauthorized, typeAuthentication, "invalid_api_key")
	}
	resp, b := a.do(t, "POST", "/v1/replicas/thinker/0/sleep?level=1", nil, bearer("admin"))
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", b)
	resp, b = a.do(t, "POST", "/v1/replicas/thinker/0/wake_up", nil, bearer("admin"))
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", b)
	resp, b = a.do(t, "GET", "/v1/replicas", nil, bearer("admin"))
	assert.Equal(t, http.StatusOK, resp.StatusCode, "%s", b)
	for _, k := range []string{"infer", "admin"} {
		resp, b = a.do(t, "GET", "/v1/models", nil, bearer(k))
		assert.Equal(t, http.StatusOK, resp.StatusCode, "%s: %s", k, b)
	}
	resp, b = a.do(t, "GET", "/v1/models", nil, bearer("wrong"))
	wantError(t, resp, b, http.StatusUnauthorized, typeAuthentication, "invalid_api_key")

	// No admin key: the API key reads the replicas but puts none to sleep.
	a = startAPI(t, c, Config{APIKey: "infer", Gatherer: c.Metrics}, nil, nil)
	resp, b = a.do(t, "GET", "/v1/replicas", nil, bearer("infer"))
	assert.Equal(t, http.StatusOK, resp.StatusCode, "%s", b)
	for _, path := range []string{"/v1/replicas/thinker/0/sleep", "/v1/replicas/thinker/0/wake_up"} {
		resp, b = a.do(t, "POST", path, nil, bearer("infer"))
		wantError(t, resp, b, http.StatusForbidden, typePermission, "admin_key_required")
	}
	c.WaitState(t, "thinker", 0, "attached")

	// Only an admin key: the serving routes are open, the admin ones not.
	a = startAPI(t, c, Config{AdminAPIKey: "admin", Gatherer: c.Metrics}, nil, nil)
	resp, b = a.do(t, "GET", "/v1/models", nil, nil)
	assert.Equal(t, http.StatusOK, resp.StatusCode, "%s", b)
	resp, b = a.do(t, "POST", "/v1/replicas/thinker/0/sleep", nil, nil)
	wantError(t, resp, b, http.StatusUnauthorized, typeAuthentication, "invalid_api_key")
}

// TestAdmin covers /v1/replicas, sleep and wake_up, /readyz and the
// handler split.
func TestAdmin(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{})
	a := startAPI(t, c, Config{Gatherer: c.Metrics}, nil, nil)

	resp, body := a.do(t, "GET", "/v1/replicas", nil, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	var raw map[string][]map[string]any
	require.NoError(t, json.Unmarshal(body, &raw))
	require.Len(t, raw["data"], 3)
	for _, row := range raw["data"] {
		keys := make([]string, 0, len(row))
		for k := range row {
			keys = append(keys, k)
		}
		// load and load_age_s: every sim reports its load in its Health on
		// joining; cache_report_age_s only once it reported its cache.
		assert.ElementsMatch(t, []string{"stage", "stage_name", "replica", "engine_index", "addr", "state", "joined_at", "in_flight", "load", "load_age_s"}, keys)
		joined, err := time.Parse(time.RFC3339, row["joined_at"].(string))
		require.NoError(t, err)
		assert.WithinDuration(t, time.Now(), joined, time.Hour)
		assert.Equal(t, "attached", row["state"])
	}
	var list replicaList
	require.NoError(t, json.Unmarshal(body, &list))
	byStage := map[string]orchestrator.ReplicaStatus{}
	for _, r := range list.Data {
		byStage[r.StageName] = r
	}
	thinker := byStage["thinker"]
	assert.Equal(t, 0, thinker.Stage)
	assert.Equal(t, 2, byStage["vocoder"].Stage)
	for _, r := range c.Head.Replicas() {
		assert.Equal(t, r.Addr, byStage[r.StageName].Addr)
		assert.Equal(t, r.EngineIndex, byStage[r.StageName].EngineIndex)
	}

	path := fmt.Sprintf("/v1/replicas/thinker/%d", thinker.Replica)
	resp, body = a.do(t, "POST", path+"/sleep?level=2", nil, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode, "body: %s", body)
	var ans sleepAnswer
	require.NoError(t, json.Unmarshal(body, &ans))
	assert.Equal(t, sleepAnswer{Stage: 0, StageName: "thinker", Replica: thinker.Replica, SleepState: "discard_all"}, ans)
	c.WaitState(t, "thinker", thinker.Replica, "sleeping")

	resp, body = a.do(t, "GET", "/readyz", nil, nil)
	assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	assert.Contains(t, string(body), "thinker")
	// Every thinker asleep: a retry cannot help, so no Retry-After; the
	// answer says how to wake one.
	resp, body = a.post(t, "/v1/completions", `{"model":"troupe-omni-sim","prompt":"hi","max_tokens":2}`)
	d := wantError(t, resp, body, http.StatusServiceUnavailable, typeServer, "stage_asleep")
	assert.Empty(t, resp.Header.Get("Retry-After"), "nothing changes by itself while the stage sleeps")
	assert.Equal(t, fmt.Sprintf(`stage "thinker" has no routable replica: every replica of it is asleep (replica %d); wake one with POST /v1/replicas/0/%d/wake_up`,
		thinker.Replica, thinker.Replica), d.Message)

	// Sleep transitions: the same level again is a no-op (200, same
	// state); another level is 409 until the replica is woken.
	resp, body = a.do(t, "POST", path+"/sleep?level=2", nil, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode, "body: %s", body)
	require.NoError(t, json.Unmarshal(body, &ans))
	assert.Equal(t, "discard_all", ans.SleepState)
	resp, body = a.do(t, "POST", path+"/sleep?level=1", nil, nil)
	d = wantError(t, resp, body, http.StatusConflict, typeInvalidRequest, "conflict")
	assert.Equal(t, fmt.Sprintf("sleep of stage thinker refused by replica %d: the replica is asleep at level 2 (discard_all); wake it up first (POST …/wake_up), then put it to sleep at level 1", thinker.Replica), d.Message)
	assertNoInternals(t, d.Message)
	for _, w := range c.Workers() {
		if w.Stage == "thinker" {
			assert.Equal(t, stagepb.SleepState_SLEEP_STATE_DISCARD_ALL, w.Engine.Health().GetSleepState(), "the refused call left the engine as it was")
		}
	}

	// The stage by index this time.
	resp, body = a.do(t, "POST", fmt.Sprintf("/v1/replicas/0/%d/wake_up", thinker.Replica), nil, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode, "body: %s", body)
	require.NoError(t, json.Unmarshal(body, &ans))
	assert.Equal(t, "awake", ans.SleepState)
	c.WaitState(t, "thinker", thinker.Replica, "attached")
	resp, body = a.do(t, "GET", "/readyz", nil, nil)
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, "ok\n", string(body))

	// Level 1 is the default.
	resp, body = a.do(t, "POST", fmt.Sprintf("/v1/replicas/talker/%d/sleep", byStage["talker"].Replica), nil, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode, "body: %s", body)
	require.NoError(t, json.Unmarshal(body, &ans))
	assert.Equal(t, "weights_offloaded", ans.SleepState)
	c.WaitState(t, "talker", byStage["talker"].Replica, "sleeping")
	resp, body = a.do(t, "POST", fmt.Sprintf("/v1/replicas/talker/%d/sleep?level=2", byStage["talker"].Replica), nil, nil)
	wantError(t, resp, body, http.StatusConflict, typeInvalidRequest, "conflict")
	resp, body = a.do(t, "POST", fmt.Sprintf("/v1/replicas/talker/%d/wake_up", byStage["talker"].Replica), nil, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode, "body: %s", body)
	c.WaitReady(t)
	// Waking an awake replica is a no-op.
	resp, body = a.do(t, "POST", fmt.Sprintf("/v1/replicas/talker/%d/wake_up", byStage["talker"].Replica), nil, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode, "body: %s", body)
	require.NoError(t, json.Unmarshal(body, &ans))
	assert.Equal(t, "awake", ans.SleepState)

	for _, tc := range []struct {
		path   string
		status int
		code   string
	}{
		{path + "/sleep?level=3", 400, "invalid_value"},
		{path + "/sleep?level=x", 400, "invalid_value"},
		{"/v1/replicas/nosuch/0/sleep", 404, "unknown_stage"},
		{"/v1/replicas/7/0/wake_up", 404, "unknown_stage"},
		{"/v1/replicas/thinker/999/sleep", 404, "unknown_replica"},
		{"/v1/replicas/thinker/abc/wake_up", 404, "unknown_replica"},
	} {
		resp, body := a.do(t, "POST", tc.path, nil, nil)
		typ := typeInvalidRequest
		if tc.status == 404 {
			typ = typeNotFound
		}
		wantError(t, resp, body, tc.status, typ, tc.code)
	}

	t.Run("metrics", func(t *testing.T) {
		resp, body := a.do(t, "GET", "/metrics", nil, nil)
		require.Equal(t, http.StatusOK, resp.StatusCode)
		assert.True(t, strings.HasPrefix(resp.Header.Get("Content-Type"), "text/plain"), resp.Header.Get("Content-Type"))
		assert.Contains(t, string(body), "troupe_membership_events_total")
		resp, body = a.do(t, "GET", "/metrics", nil, http.Header{"Accept": {"application/openmetrics-text; version=1.0.0"}})
		require.Equal(t, http.StatusOK, resp.StatusCode)
		assert.True(t, strings.HasPrefix(resp.Header.Get("Content-Type"), "application/openmetrics-text"), resp.Header.Get("Content-Type"))
		assert.True(t, strings.HasSuffix(string(body), "# EOF\n"))
		resp, body = a.do(t, "GET", "/healthz", nil, nil)
		assert.Equal(t, http.StatusOK, resp.StatusCode)
		assert.Equal(t, "ok\n", string(body))
	})

	t.Run("split handlers", func(t *testing.T) {
		serving := startAPI(t, c, Config{Gatherer: c.Metrics}, (*Server).ServingHandler, nil)
		admin := startAPI(t, c, Config{Gatherer: c.Metrics}, (*Server).AdminHandler, nil)
		for _, p := range []string{"/v1/replicas", "/metrics"} {
			resp, body := serving.do(t, "GET", p, nil, nil)
			wantError(t, resp, body, http.StatusNotFound, typeNotFound, "not_found")
			resp, _ = admin.do(t, "GET", p, nil, nil)
			assert.Equal(t, http.StatusOK, resp.StatusCode, p)
		}
		resp, body := admin.post(t, "/v1/completions", `{"model":"troupe-omni-sim","prompt":"hi"}`)
		wantError(t, resp, body, http.StatusNotFound, typeNotFound, "not_found")
		resp, _ = admin.do(t, "GET", "/v1/models", nil, nil)
		assert.Equal(t, http.StatusNotFound, resp.StatusCode)
		resp, _ = serving.do(t, "GET", "/v1/models", nil, nil)
		assert.Equal(t, http.StatusOK, resp.StatusCode)
		for _, h := range []*api{serving, admin} {
			resp, _ := h.do(t, "GET", "/healthz", nil, nil)
			assert.Equal(t, http.StatusOK, resp.StatusCode)
			resp, _ = h.do(t, "GET", "/readyz", nil, nil)
			assert.Equal(t, http.StatusOK, resp.StatusCode)
		}
	})
}

// TestAdmissionLimit: beyond MaxInFlight the head answers 429 at once, in
// OpenAI's shape with Retry-After, counted in the HTTP metrics; a slot that
// frees admits the next request.
func TestAdmissionLimit(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{Pipeline: orchestrator.Pipeline{Model: model, Stages: []orchestrator.Stage{{Name: "thinker"}}},
		Sim: sim.Config{DecodeTokenLatency: 20 * time.Millisecond}})
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg)
	require.NoError(t, err)
	a := startAPI(t, c, Config{MaxInFlight: 2, Metrics: m}, nil, nil)
	slow := `{"model":"troupe-omni-sim","messages":[{"role":"user","content":"hi"}],"max_tokens":30,"ignore_eos":true,"stream":true}`

	// Two streams hold both slots: each has sent its first event.
	var streams []*http.Response
	for range 2 {
		req, err := http.NewRequestWithContext(t.Context(), "POST", a.base+"/v1/chat/completions", strings.NewReader(slow))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/json")
		resp, err := a.client.Do(req)
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode)
		_, err = bufio.NewReader(resp.Body).ReadString('\n')
		require.NoError(t, err)
		streams = append(streams, resp)
	}
	resp, body := a.post(t, "/v1/chat/completions", `{"model":"troupe-omni-sim","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`)
	d := wantError(t, resp, body, http.StatusTooManyRequests, typeRateLimit, "too_many_requests")
	assert.Equal(t, "1", resp.Header.Get("Retry-After"))
	assert.Contains(t, d.Message, "limit of 2 requests in flight")
	assert.Equal(t, 1.0, testutil.ToFloat64(m.requests.WithLabelValues("/v1/chat/completions", "post", "429")))

	for _, s := range streams {
		_, err := io.Copy(io.Discard, s.Body)
		require.NoError(t, err)
		s.Body.Close()
	}
	require.Eventually(t, func() bool {
		resp, _ := a.post(t, "/v1/chat/completions", `{"model":"troupe-omni-sim","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`)
		return resp.StatusCode == http.StatusOK
	}, 10*time.Second, 20*time.Millisecond, "a freed slot admits the next request")
}

// TestSlowUploadsTakeNoSlot: connections that send full headers and then
// their body a byte at a time hold no admission slot, however many there
// are: a real request is served meanwhile. (Issue 34: 1,025 such uploads
// used to make every request 429.)
func TestSlowUploadsTakeNoSlot(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{Pipeline: orchestrator.Pipeline{Model: model, Stages: []orchestrator.Stage{{Name: "thinker"}}}})
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg)
	require.NoError(t, err)
	const limit, uploads = 4, 40
	a := startAPI(t, c, Config{MaxInFlight: limit, Metrics: m}, nil, nil)
	addr := strings.TrimPrefix(a.base, "http://")
	var conns []net.Conn
	t.Cleanup(func() {
		for _, conn := range conns {
			conn.Close()
		}
	})
	for range uploads {
		conn, err := net.Dial("tcp", addr)
		require.NoError(t, err)
		conns = append(conns, conn)
		_, err = fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool { return testutil.ToFloat64(m.inFlight) >= uploads },
		10*time.Second, 5*time.Millisecond, "every upload is inside the handler, reading its body")
	for range 2 * limit {
		resp, body := a.post(t, "/v1/chat/completions", `{"model":"troupe-omni-sim","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`)
		require.Equal(t, http.StatusOK, resp.StatusCode, "body: %s", body)
	}
	assert.Zero(t, testutil.ToFloat64(m.requests.WithLabelValues("/v1/chat/completions", "post", "429")))
}

// TestSmallerTokenLimitWins: a client that sends both max_tokens and
// max_completion_tokens gets an answer no longer than the smaller, either
// way round (as OpenAI specifies), through the official client.
func TestSmallerTokenLimitWins(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{Pipeline: orchestrator.Pipeline{Model: model, Stages: []orchestrator.Stage{{Name: "thinker"}}}})
	a := startAPI(t, c, Config{}, nil, nil)
	client := a.openai()
	for _, lim := range []struct{ maxTokens, maxCompletion int64 }{{3, 32}, {32, 3}} {
		params := chatParams("tell me a long story", 1, lim.maxCompletion)
		params.MaxTokens = openai.Int(lim.maxTokens)
		res, err := client.Chat.Completions.New(testCtx(t), params, option.WithJSONSet("ignore_eos", true))
		require.NoError(t, err)
		assert.EqualValues(t, 3, res.Usage.CompletionTokens, "max_tokens %d, max_completion_tokens %d", lim.maxTokens, lim.maxCompletion)
		assert.Equal(t, "length", string(res.Choices[0].FinishReason))
	}
}
