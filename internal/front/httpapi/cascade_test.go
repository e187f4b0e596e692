package httpapi

import (
	"bytes"
	"encoding/base64"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/tokenizers"
	"github.com/troupe-serving/troupe/worker/sim"
)

// TestCascade: asr → thinker → talker → vocoder. A chat whose user message
// is input_audio is transcribed by the asr, answered by the thinker as if
// the transcript had been typed, and spoken; a text-only answer runs the
// asr and the thinker.
func TestCascade(t *testing.T) {
	p := orchestrator.Pipeline{Model: model, Stages: []orchestrator.Stage{{Name: "asr"}, {Name: "thinker"}, {Name: "talker"}, {Name: "vocoder"}}}
	c := startCluster(t, orchestratortest.Options{Pipeline: p})
	a := startAPI(t, c, Config{}, nil, nil)
	client := a.openai()
	ctx := testCtx(t)

	audio := bytes.Repeat([]byte{7, 0, 9, 0}, 3000)
	transcript := sim.Transcript(audio, 5)
	want, _, _ := sim.ExpectedText(tokenizers.ChatText([]*stagepb.ChatMessage{{Role: "system", Content: "be brief"}, {Role: "user", Content: transcript}}), 5, 10)
	params := openai.ChatCompletionNewParams{
		Model: model,
		Messages: []openai.ChatCompletionMessageParamUnion{
			openai.SystemMessage("be brief"),
			openai.UserMessage([]openai.ChatCompletionContentPartUnionParam{
				openai.InputAudioContentPart(openai.ChatCompletionContentPartInputAudioInputAudioParam{Data: base64.StdEncoding.EncodeToString(audio), Format: "wav"}),
			}),
		},
		Seed:                openai.Int(5),
		MaxCompletionTokens: openai.Int(10),
	}
	res, err := client.Chat.Completions.New(ctx, params)
	require.NoError(t, err)
	assert.Equal(t, want, res.Choices[0].Message.Content, "the thinker's answer to what was said")

	params.Modalities = []string{"text", "audio"}
	params.Audio = openai.ChatCompletionAudioParam{Voice: openai.ChatCompletionAudioParamVoiceUnion{OfString: openai.String("alloy")}, Format: "pcm16"}
	res, err = client.Chat.Completions.New(ctx, params)
	require.NoError(t, err)
	assert.Equal(t, want, res.Choices[0].Message.Content)
	pcm, err := base64.StdEncoding.DecodeString(res.Choices[0].Message.Audio.Data)
	require.NoError(t, err)
	assert.NotEmpty(t, pcm, "spoken")

	assert.Equal(t, 2, c.Head.SpeechStages(), "the speech endpoint starts at the talker, after the thinker")
}
