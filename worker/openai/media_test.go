package openai_test

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	oa "github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/worker/openai"
)

// TestMediaPartsReachUpstream: an OpenAI client's image and audio parts
// cross the head and the openai engine to the upstream byte for byte, in
// order and in the shape the client sent them (data: URLs, input_audio,
// http(s) URLs the upstream fetches); the upstream's media token counts
// come back in usage.prompt_tokens_details.
func TestMediaPartsReachUpstream(t *testing.T) {
	f := newFake(t)
	f.route("POST /v1/chat/completions", func(w http.ResponseWriter, _ *http.Request) {
		sse(w, delta("a cat"), finish("stop"),
			`{"object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2,"total_tokens":42,"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":7,"image_tokens":11}}}`)
	})
	b := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, ReplicasPerStage: -1})
	e, err := openai.New(openai.Config{URL: f.URL + "/v1", Logger: quiet()})
	require.NoError(t, err)
	assert.ElementsMatch(t, []string{"image", "audio", "video"}, e.Health().GetInputParts())
	assert.True(t, e.Health().GetInputPartUrls())
	srv := startWorker(t, b, "thinker", e)
	b.WaitState(t, "thinker", srv.Member().ReplicaID, "attached")
	base := serveAPI(t, b)
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	httpClient := &http.Client{Transport: tr}
	client := oa.NewClient(option.WithBaseURL(base+"/v1/"), option.WithAPIKey("unused"), option.WithHTTPClient(httpClient), option.WithMaxRetries(0))

	png := append([]byte("\x89PNG\r\n\x1a\n"), bytes.Repeat([]byte{0, 0xff, 0x10}, 3000)...)
	wav := pcm16WAV(bytes.Repeat([]byte{1, 0x80}, 5000), 16000) // the head checks the header
	pngURL := "data:image/png;base64," + base64.StdEncoding.EncodeToString(png)
	res, err := client.Chat.Completions.New(testCtx(t), oa.ChatCompletionNewParams{
		Model: "troupe-omni-sim",
		Messages: []oa.ChatCompletionMessageParamUnion{
			oa.SystemMessage("be brief"),
			oa.UserMessage([]oa.ChatCompletionContentPartUnionParam{
				oa.TextContentPart("what is in"),
				oa.ImageContentPart(oa.ChatCompletionContentPartImageImageURLParam{URL: pngURL}),
				oa.TextContentPart("and what is said in"),
				oa.InputAudioContentPart(oa.ChatCompletionContentPartInputAudioInputAudioParam{Data: base64.StdEncoding.EncodeToString(wav), Format: "wav"}),
				oa.ImageContentPart(oa.ChatCompletionContentPartImageImageURLParam{URL: "https://example.com/cat.jpg"}),
			}),
		},
	})
	require.NoError(t, err)
	assert.Equal(t, "a cat", res.Choices[0].Message.Content)
	assert.Equal(t, int64(7), res.Usage.PromptTokensDetails.AudioTokens)
	assert.Contains(t, res.RawJSON(), `"prompt_tokens_details":{"audio_tokens":7,"image_tokens":11}`)
	assert.Equal(t, int64(40), res.Usage.PromptTokens)

	var got struct {
		Messages []struct {
			Role    string          `json:"role"`
			Content json.RawMessage `json:"content"`
		} `json:"messages"`
	}
	raw, err := json.Marshal(f.lastBody())
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(raw, &got))
	require.Len(t, got.Messages, 2)
	assert.JSONEq(t, `"be brief"`, string(got.Messages[0].Content), "a text-only message stays a string")
	type url struct {
		URL string `json:"url"`
	}
	var parts []struct {
		Type       string `json:"type"`
		Text       string `json:"text"`
		ImageURL   url    `json:"image_url"`
		AudioURL   url    `json:"audio_url"`
		VideoURL   url    `json:"video_url"`
		InputAudio struct {
			Data   string `json:"data"`
			Format string `json:"format"`
		} `json:"input_audio"`
	}
	require.NoError(t, json.Unmarshal(got.Messages[1].Content, &parts))
	require.Len(t, parts, 5)
	assert.Equal(t, []string{"text", "image_url", "text", "input_audio", "image_url"},
		[]string{parts[0].Type, parts[1].Type, parts[2].Type, parts[3].Type, parts[4].Type})
	assert.Equal(t, "what is in", parts[0].Text)
	assert.Equal(t, "and what is said in", parts[2].Text)
	assert.Equal(t, pngURL, parts[1].ImageURL.URL, "the data: URL as sent")
	sentPNG, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(parts[1].ImageURL.URL, "data:image/png;base64,"))
	require.NoError(t, err)
	assert.Equal(t, png, sentPNG, "the image byte for byte")
	sentWAV, err := base64.StdEncoding.DecodeString(parts[3].InputAudio.Data)
	require.NoError(t, err)
	assert.Equal(t, wav, sentWAV, "the audio byte for byte")
	assert.Equal(t, "wav", parts[3].InputAudio.Format)
	assert.Equal(t, "https://example.com/cat.jpg", parts[4].ImageURL.URL, "the URL, for the upstream to fetch")

	// vLLM's audio_url and video_url, by data: URL and by URL.
	mp4 := bytes.Repeat([]byte("ftypmp42"), 100)
	body := `{"model":"troupe-omni-sim","messages":[{"role":"user","content":[` +
		`{"type":"audio_url","audio_url":{"url":"data:audio/mpeg;base64,` + base64.StdEncoding.EncodeToString(wav) + `"}},` +
		`{"type":"video_url","video_url":{"url":"data:video/mp4;base64,` + base64.StdEncoding.EncodeToString(mp4) + `"}},` +
		`{"type":"video_url","video_url":{"url":"http://example.com/v.mp4"}}]}]}`
	resp, err := httpClient.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(body))
	require.NoError(t, err)
	answer, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", answer)
	raw, err = json.Marshal(f.lastBody())
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(raw, &got))
	parts = nil
	require.NoError(t, json.Unmarshal(got.Messages[0].Content, &parts))
	require.Len(t, parts, 3)
	assert.Equal(t, "data:audio/mpeg;base64,"+base64.StdEncoding.EncodeToString(wav), parts[0].AudioURL.URL)
	assert.Equal(t, "data:video/mp4;base64,"+base64.StdEncoding.EncodeToString(mp4), parts[1].VideoURL.URL)
	assert.Equal(t, "http://example.com/v.mp4", parts[2].VideoURL.URL)
}

// TestMMCacheCountersReachHead: the upstream's vLLM multimodal-cache
// counters (vllm:mm_cache_queries, vllm:mm_cache_hits, summed over its
// engines) reach the head's per-replica troupe_mm_cache_* counters as
// their increases, each exactly once, as the prefix-cache counters do.
func TestMMCacheCountersReachHead(t *testing.T) {
	vllm, err := os.ReadFile(filepath.Join("testdata", "vllm.prom"))
	require.NoError(t, err)
	text := string(vllm)
	var current atomic.Pointer[string]
	current.Store(&text)
	f := newFake(t)
	chatting(f)
	scrapes := metricsFrom(f, &current)
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, ReplicasPerStage: -1})
	e, err := openai.New(openai.Config{URL: f.URL, HealthInterval: 20 * time.Millisecond, Logger: quiet()})
	require.NoError(t, err)
	srv := startWorker(t, c, "thinker", e)
	c.WaitState(t, "thinker", srv.Member().ReplicaID, "attached")
	client := oa.NewClient(option.WithBaseURL(serveAPI(t, c)+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	ask := func() {
		t.Helper()
		_, err := client.Chat.Completions.New(testCtx(t), oa.ChatCompletionNewParams{
			Model: "troupe-omni-sim", Messages: []oa.ChatCompletionMessageParamUnion{oa.UserMessage("x")}})
		require.NoError(t, err)
	}
	replica := strconv.FormatUint(uint64(srv.Member().ReplicaID), 10)
	counter := func(name string) float64 {
		t.Helper()
		fams, err := c.Metrics.Gather()
		require.NoError(t, err)
		for _, fam := range fams {
			if fam.GetName() != name {
				continue
			}
			for _, m := range fam.GetMetric() {
				for _, l := range m.GetLabel() {
					if l.GetName() == "replica" && l.GetValue() == replica {
						return m.GetCounter().GetValue()
					}
				}
			}
		}
		t.Fatalf("no %s series of replica %s", name, replica)
		return 0
	}
	ask()
	assert.Zero(t, counter("troupe_mm_cache_queries_total"), "the first scrape is the baseline")

	// The upstream encoded 7 more media items (engine 0: 4, engine 1: 3),
	// 5 of them from its cache.
	more := replaceAll(text, map[string]string{
		`vllm:mm_cache_queries_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 50.0`: `vllm:mm_cache_queries_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 54.0`,
		`vllm:mm_cache_queries_total{engine="1",model_name="Qwen/Qwen3-0.6B"} 10.0`: `vllm:mm_cache_queries_total{engine="1",model_name="Qwen/Qwen3-0.6B"} 13.0`,
		`vllm:mm_cache_hits_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 20.0`:    `vllm:mm_cache_hits_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 23.0`,
		`vllm:mm_cache_hits_total{engine="1",model_name="Qwen/Qwen3-0.6B"} 4.0`:     `vllm:mm_cache_hits_total{engine="1",model_name="Qwen/Qwen3-0.6B"} 6.0`,
	})
	n := scrapes.Load()
	current.Store(&more)
	require.Eventually(t, func() bool { return scrapes.Load() >= n+2 }, wait, time.Millisecond)
	ask()
	require.Eventually(t, func() bool { return counter("troupe_mm_cache_queries_total") == 7 }, time.Second, time.Millisecond,
		"the increase reaches the head with the request's last chunk")
	assert.Equal(t, 5.0, counter("troupe_mm_cache_hits_total"))
	ask()
	assert.Equal(t, 7.0, counter("troupe_mm_cache_queries_total"), "counted once")
	assert.Equal(t, 5.0, counter("troupe_mm_cache_hits_total"))
}

// pcm16WAV is pcm in a WAV file: PCM16 mono at rate.
func pcm16WAV(pcm []byte, rate uint32) []byte {
	le := binary.LittleEndian
	b := []byte("RIFF\x00\x00\x00\x00WAVEfmt \x10\x00\x00\x00\x01\x00\x01\x00")
	b = le.AppendUint32(b, rate)
	b = le.AppendUint32(b, 2*rate)
	b = append(b, "\x02\x00\x10\x00data"...)
	b = le.AppendUint32(b, uint32(len(pcm)))
	b = append(b, pcm...)
	le.PutUint32(b[4:8], uint32(len(b)-8))
	return b
}
