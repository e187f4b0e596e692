package httpapi

import (
	"bytes"
	"encoding/base64"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/tokenizers"
)

// TestParseChatMediaParts: media parts are decoded once, at the head, to
// their bytes (data: URLs, input_audio's base64) or kept as http(s) URLs,
// in order with the text parts; content stays the text parts joined.
func TestParseChatMediaParts(t *testing.T) {
	img, audio := []byte("\x89PNG\x00\x01"), wavFile(wavFormatPCM, 1, 16000, 16, 0, []byte{1, 0, 2, 0})
	// The audio_url's data is percent-encoded, a WAV file's header and a
	// sample.
	escaped := url.PathEscape(string(wavFile(wavFormatPCM, 1, 8000, 16, 0, []byte{0, 'x'})))
	body := fmt.Sprintf(`{"model":"troupe-omni-sim","messages":[{"role":"user","content":"hi"},{"role":"user","content":[
		{"type":"text","text":"look"},
		{"type":"image_url","image_url":{"url":"data:image/png;base64,%s","detail":"low"}},
		{"type":"input_audio","input_audio":{"data":"%s","format":"wav"}},
		{"type":"video_url","video_url":{"url":"https://example.com/v.mp4"}},
		{"type":"audio_url","audio_url":{"url":"data:audio/wav,%s"}},
		{"type":"text","text":"and listen"}]}]}`, base64.StdEncoding.EncodeToString(img), base64.StdEncoding.EncodeToString(audio), escaped)
	j, e := parseChat([]byte(body), testModel)
	require.Nil(t, e)
	require.Len(t, j.messages, 2)
	assert.Empty(t, j.messages[0].GetParts(), "text only: no parts")
	m := j.messages[1]
	assert.Equal(t, "look\nand listen", m.GetContent())
	want := []*stagepb.ContentPart{
		{Kind: "text", Text: "look"},
		{Kind: "image", Data: img, MimeType: "image/png"},
		{Kind: "audio", Data: audio, Format: "wav"},
		{Kind: "video", Url: "https://example.com/v.mp4"},
		{Kind: "audio", Data: wavFile(wavFormatPCM, 1, 8000, 16, 0, []byte{0, 'x'}), MimeType: "audio/wav"},
		{Kind: "text", Text: "and listen"},
	}
	require.Len(t, m.GetParts(), len(want))
	for i, p := range want {
		assert.Equal(t, p.String(), m.GetParts()[i].String(), "part %d", i)
	}
	assert.Equal(t, "user: hi\nuser: look\nand listen", j.prompt)
}

// TestParseChatPartLimits: more media parts than the limit is 400 naming
// the first part over it; a part over the byte limit is 413 naming it.
func TestParseChatPartLimits(t *testing.T) {
	part := `{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}`
	body := `{"model":"troupe-omni-sim","messages":[{"role":"user","content":[` + strings.Repeat(part+",", 2) + `{"type":"text","text":"x"},` + part + `]}]}`
	_, e := parseChatLimited([]byte(body), testModel, newPartBudget(2, 0))
	require.NotNil(t, e)
	assert.Equal(t, http.StatusBadRequest, e.Status)
	assert.Equal(t, "messages[0].content[3]", e.Param)
	_, e = parseChatLimited([]byte(body), testModel, newPartBudget(3, 0))
	assert.Nil(t, e)
	_, e = parseChatLimited([]byte(body), testModel, newPartBudget(3, 2))
	require.NotNil(t, e)
	assert.Equal(t, http.StatusRequestEntityTooLarge, e.Status)
	assert.Equal(t, "request_too_large", e.Code)
	assert.Equal(t, "messages[0].content[0]", e.Param)
}

// TestMediaPartsSim drives media parts through the sim pipeline with the
// official client: the sim makes MediaTokens of each part's bytes, usage
// reports them, a repeated image hits the prefix cache; a part the stage
// cannot take, too many parts and an oversized part are refused before
// any work.
func TestMediaPartsSim(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{})
	a := startAPI(t, c, Config{MaxContentParts: 3, MaxPartBytes: 64 << 10}, nil, nil)
	client := a.openai()
	ctx := testCtx(t)

	img := bytes.Repeat([]byte{0x89, 'P', 'N', 'G'}, 1250)
	audio := wavFile(wavFormatPCM, 1, 16000, 16, 0, bytes.Repeat([]byte{1, 0}, 4500))
	params := openai.ChatCompletionNewParams{
		Model: model,
		Messages: []openai.ChatCompletionMessageParamUnion{
			openai.SystemMessage("be brief"),
			openai.UserMessage([]openai.ChatCompletionContentPartUnionParam{
				openai.TextContentPart("describe"),
				openai.ImageContentPart(openai.ChatCompletionContentPartImageImageURLParam{URL: "data:image/png;base64," + base64.StdEncoding.EncodeToString(img)}),
				openai.InputAudioContentPart(openai.ChatCompletionContentPartInputAudioInputAudioParam{Data: base64.StdEncoding.EncodeToString(audio), Format: "wav"}),
			}),
		},
		Seed:                openai.Int(3),
		MaxCompletionTokens: openai.Int(8),
	}
	text := []*stagepb.ChatMessage{{Role: "system", Content: "be brief"}, {Role: "user", Content: "describe"}}
	wantPrompt := len(tokenizers.Sim(tokenizers.ChatText(text))) + tokenizers.MediaTokens(img) + tokenizers.MediaTokens(audio)

	hits0 := counter(t, c, "troupe_prefix_cache_hits_total", "0", "", "")
	res, err := client.Chat.Completions.New(ctx, params)
	require.NoError(t, err)
	assert.Equal(t, int64(wantPrompt), res.Usage.PromptTokens)
	assert.Equal(t, int64(tokenizers.MediaTokens(audio)), res.Usage.PromptTokensDetails.AudioTokens)
	assert.Contains(t, res.RawJSON(), fmt.Sprintf(`"image_tokens":%d`, tokenizers.MediaTokens(img)))
	assert.NotEmpty(t, res.Choices[0].Message.Content)
	again, err := client.Chat.Completions.New(ctx, params)
	require.NoError(t, err)
	assert.Equal(t, res.Choices[0].Message.Content, again.Choices[0].Message.Content, "deterministic")
	assert.Greater(t, counter(t, c, "troupe_prefix_cache_hits_total", "0", "", ""), hits0, "the same image again: a cached prefix")

	// Streamed, the usage chunk carries the details too.
	params.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
	stream := client.Chat.Completions.NewStreaming(ctx, params)
	var usage openai.CompletionUsage
	for stream.Next() {
		if ch := stream.Current(); len(ch.Choices) == 0 {
			usage = ch.Usage
		}
	}
	require.NoError(t, stream.Err())
	require.NoError(t, stream.Close())
	assert.Equal(t, int64(tokenizers.MediaTokens(audio)), usage.PromptTokensDetails.AudioTokens)

	prompt0 := counter(t, c, "troupe_prompt_tokens_total", "0", "", "")
	url := `{"model":"troupe-omni-sim","messages":[{"role":"user","content":[{"type":"text","text":"what"},{"type":"image_url","image_url":{"url":"https://example.com/cat.png"}}]}]}`
	resp, body := a.post(t, "/v1/chat/completions", url)
	d := wantError(t, resp, body, http.StatusBadRequest, typeInvalidRequest, "unsupported")
	require.NotNil(t, d.Param)
	assert.Equal(t, "messages[0].content[1]", *d.Param)
	assert.Contains(t, d.Message, `stage "thinker"`)
	assert.Contains(t, d.Message, "http(s) URL")
	assertNoInternals(t, d.Message)

	part := `{"type":"input_audio","input_audio":{"data":"` + base64.StdEncoding.EncodeToString(wavFile(wavFormatPCM, 1, 16000, 16, 0, []byte{0, 0})) + `","format":"wav"}}`
	resp, body = a.post(t, "/v1/chat/completions", `{"model":"troupe-omni-sim","messages":[{"role":"user","content":[`+strings.Repeat(part+",", 3)+part+`]}]}`)
	d = wantError(t, resp, body, http.StatusBadRequest, typeInvalidRequest, "invalid_value")
	assert.Equal(t, "messages[0].content[3]", *d.Param)

	big := base64.StdEncoding.EncodeToString(make([]byte, 65<<10))
	resp, body = a.post(t, "/v1/chat/completions", `{"model":"troupe-omni-sim","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,`+big+`"}}]}]}`)
	d = wantError(t, resp, body, http.StatusRequestEntityTooLarge, typeInvalidRequest, "request_too_large")
	assert.Equal(t, "messages[0].content[0]", *d.Param)

	resp, body = a.post(t, "/v1/chat/completions", `{"model":"troupe-omni-sim","messages":[{"role":"user","content":[{"type":"input_audio","input_audio":{"data":"not base64!","format":"wav"}}]}]}`)
	d = wantError(t, resp, body, http.StatusBadRequest, typeInvalidRequest, "invalid_value")
	assert.Equal(t, "messages[0].content[0].input_audio.data", *d.Param)
	assert.Equal(t, prompt0, counter(t, c, "troupe_prompt_tokens_total", "0", "", ""), "refused before any work")
}
