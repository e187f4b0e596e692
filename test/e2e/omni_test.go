//go:build unix

package e2e

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"testing"

	oa "github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestMediaThroughUpstreamTroupe: an independent troupe (cluster A: its
// own etcd, head and sim thinker) is the upstream of cluster B's
// `--engine openai` thinker. A chat with an image (data: URL) and an
// input_audio part, sent to B with the official client, reaches A byte for
// byte: the sim's answer and usage are made of the media bytes (each part
// is tokenizers.MediaTokens of its size, its words name the FNV hash of its
// bytes), so B's answer, finish and usage, media token counts included,
// equal what A answers directly for the same request and seed, and one
// changed media byte changes the answer.
func TestMediaThroughUpstreamTroupe(t *testing.T) {
	requireBinary(t)
	ctx := testCtx(t)

	etcdA := startEtcd(t)
	a := startHead(t, etcdA, "--pipeline", thinkerOnly(t))
	wa := startWorker(t, etcdA, "thinker", "--replica-id", "auto")
	a.waitState(ctx, t, "thinker", wa.replica, "attached")

	etcdB := startEtcd(t)
	b := startHead(t, etcdB, "--pipeline", thinkerOnly(t))
	wb := startWorker(t, etcdB, "thinker", "--replica-id", "auto", "--engine", "openai", "--upstream", a.base+"/v1")
	b.waitState(ctx, t, "thinker", wb.replica, "attached")

	png := append([]byte("\x89PNG\r\n\x1a\n"), bytes.Repeat([]byte{0, 0xff, 0x10, 0x7f}, 900)...)
	wav := pcm16WAV(bytes.Repeat([]byte{1, 0x80, 0x33}, 1700), 16000) // the heads take only well-formed WAV files
	params := func(png, wav []byte) oa.ChatCompletionNewParams {
		return oa.ChatCompletionNewParams{
			Model:     modelName,
			Seed:      oa.Int(11),
			MaxTokens: oa.Int(24),
			Messages: []oa.ChatCompletionMessageParamUnion{
				oa.SystemMessage("describe what you are given"),
				oa.UserMessage([]oa.ChatCompletionContentPartUnionParam{
					oa.TextContentPart("what is in"),
					oa.ImageContentPart(oa.ChatCompletionContentPartImageImageURLParam{URL: "data:image/png;base64," + base64.StdEncoding.EncodeToString(png)}),
					oa.TextContentPart("and what is said in"),
					oa.InputAudioContentPart(oa.ChatCompletionContentPartInputAudioInputAudioParam{Data: base64.StdEncoding.EncodeToString(wav), Format: "wav"}),
				}),
			},
		}
	}
	ask := func(h *head, p oa.ChatCompletionNewParams) *oa.ChatCompletion {
		t.Helper()
		client := oa.NewClient(option.WithBaseURL(h.base+"/v1/"), option.WithAPIKey("unused"),
			option.WithHTTPClient(h.client), option.WithMaxRetries(0))
		res, err := client.Chat.Completions.New(ctx, p)
		require.NoError(t, err, "%s", h.name)
		require.Len(t, res.Choices, 1)
		return res
	}

	direct := ask(a, params(png, wav))
	through := ask(b, params(png, wav))
	require.NotEmpty(t, direct.Choices[0].Message.Content)
	assert.Equal(t, direct.Choices[0].Message.Content, through.Choices[0].Message.Content, "the same answer through B")
	assert.Equal(t, direct.Choices[0].FinishReason, through.Choices[0].FinishReason)
	assert.Equal(t, direct.Usage.PromptTokens, through.Usage.PromptTokens)
	assert.Equal(t, direct.Usage.CompletionTokens, through.Usage.CompletionTokens)
	// The sim's media tokens: 1 + bytes/MediaBytesPerToken per part, which
	// the upstream could only count from the bytes themselves.
	assert.Positive(t, direct.Usage.PromptTokensDetails.AudioTokens)
	assert.Equal(t, direct.Usage.PromptTokensDetails.AudioTokens, through.Usage.PromptTokensDetails.AudioTokens)
	assert.Equal(t, mediaDetail(t, direct.RawJSON(), "image_tokens"), mediaDetail(t, through.RawJSON(), "image_tokens"))
	assert.Positive(t, mediaDetail(t, direct.RawJSON(), "image_tokens"))
	assert.Greater(t, direct.Usage.PromptTokens, direct.Usage.PromptTokensDetails.AudioTokens+mediaDetail(t, direct.RawJSON(), "image_tokens"),
		"the media tokens are part of the prompt")

	// One byte of the image, then of the audio, changed: same sizes, so the
	// same token counts, but other words, so another answer, through B as
	// directly.
	for name, p := range map[string]oa.ChatCompletionNewParams{
		"image": params(flipped(png, len(png)/2), wav),
		"audio": params(png, flipped(wav, len(wav)-1)),
	} {
		d, th := ask(a, p), ask(b, p)
		assert.Equal(t, d.Choices[0].Message.Content, th.Choices[0].Message.Content, "%s: the same answer through B", name)
		assert.NotEqual(t, direct.Choices[0].Message.Content, th.Choices[0].Message.Content, "%s: one byte changed the answer", name)
		assert.Equal(t, direct.Usage.PromptTokens, th.Usage.PromptTokens, "%s: the same sizes", name)
	}
}

// pcm16WAV is a WAV file of PCM16 mono samples at rate.
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

// flipped is a copy of b with byte i changed.
func flipped(b []byte, i int) []byte {
	c := bytes.Clone(b)
	c[i] ^= 0x01
	return c
}

// mediaDetail is usage.prompt_tokens_details[key] of a raw chat completion
// (openai-go's PromptTokensDetails has no image_tokens).
func mediaDetail(t *testing.T, raw, key string) int64 {
	t.Helper()
	var v struct {
		Usage struct {
			Details map[string]int64 `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	require.NoError(t, json.Unmarshal([]byte(raw), &v))
	return v.Usage.Details[key]
}
