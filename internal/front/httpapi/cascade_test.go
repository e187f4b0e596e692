package httpapi

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
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

	audio := wavFile(wavFormatPCM, 1, 16000, 16, 0, bytes.Repeat([]byte{7, 0, 9, 0}, 3000))
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

	// A typed turn to the same pipeline skips the recognizer: the thinker
	// reads it as it is, and the speech stages speak the answer.
	typed := []*stagepb.ChatMessage{{Role: "system", Content: "be brief"}, {Role: "user", Content: "hello there"}}
	wantTyped, _, _ := sim.ExpectedText(tokenizers.ChatText(typed), 5, 10)
	params.Messages = []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("be brief"), openai.UserMessage("hello there")}
	res, err = client.Chat.Completions.New(ctx, params)
	require.NoError(t, err, "a text turn to a pipeline that starts with asr")
	assert.Equal(t, wantTyped, res.Choices[0].Message.Content)
	pcm, err = base64.StdEncoding.DecodeString(res.Choices[0].Message.Audio.Data)
	require.NoError(t, err)
	assert.NotEmpty(t, pcm, "spoken")
}

// TestCascadeStreamsSpeech: in a streamed chat through a cascade, the
// recognizer ends first (its transcript is the thinker's prompt), and then
// the thinker's text streams into the speech stages while the thinker
// still writes: the first audio event reaches the client before the
// thinker's last text delta. With streaming off the stages run one after
// the other and the first audio comes only after the last text delta;
// both give the same text.
func TestCascadeStreamsSpeech(t *testing.T) {
	audio := wavFile(wavFormatPCM, 1, 16000, 16, 0, bytes.Repeat([]byte{3, 0, 5, 0}, 2000))
	var texts []string
	for _, streaming := range []bool{true, false} {
		t.Run(fmt.Sprintf("streaming=%v", streaming), func(t *testing.T) {
			p := orchestrator.Pipeline{Model: model, Streaming: &streaming,
				Stages: []orchestrator.Stage{{Name: "asr"}, {Name: "thinker"}, {Name: "talker"}, {Name: "vocoder"}}}
			c := startCluster(t, orchestratortest.Options{Pipeline: p, Sim: sim.Config{DecodeTokenLatency: 4 * time.Millisecond}})
			client := startAPI(t, c, Config{}, nil, nil).openai()
			stream := client.Chat.Completions.NewStreaming(testCtx(t), openai.ChatCompletionNewParams{
				Model: model,
				Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage([]openai.ChatCompletionContentPartUnionParam{
					openai.InputAudioContentPart(openai.ChatCompletionContentPartInputAudioInputAudioParam{Data: base64.StdEncoding.EncodeToString(audio), Format: "wav"}),
				})},
				Seed:       openai.Int(2),
				MaxTokens:  openai.Int(48),
				Modalities: []string{"text", "audio"},
				Audio:      openai.ChatCompletionAudioParam{Voice: openai.ChatCompletionAudioParamVoiceUnion{OfString: openai.String("alloy")}, Format: "pcm16"},
			}, option.WithJSONSet("ignore_eos", true))
			firstAudio, lastText, i := -1, -1, 0
			var text strings.Builder
			for ; stream.Next(); i++ {
				ch := stream.Current()
				if len(ch.Choices) == 0 {
					continue
				}
				if d := ch.Choices[0].Delta; d.Content != "" {
					lastText = i
					text.WriteString(d.Content)
				}
				var delta struct {
					Audio struct {
						Data string `json:"data"`
					} `json:"audio"`
				}
				require.NoError(t, json.Unmarshal([]byte(ch.Choices[0].Delta.RawJSON()), &delta))
				if delta.Audio.Data != "" && firstAudio < 0 {
					firstAudio = i
				}
			}
			require.NoError(t, stream.Err())
			require.NoError(t, stream.Close())
			require.GreaterOrEqual(t, firstAudio, 0, "audio was streamed")
			require.GreaterOrEqual(t, lastText, 0, "text was streamed")
			if streaming {
				assert.Less(t, firstAudio, lastText, "the first audio event before the thinker's last text delta (of %d events)", i)
			} else {
				assert.Greater(t, firstAudio, lastText, "one stage after the other: the audio after the text")
			}
			texts = append(texts, text.String())
		})
	}
	require.Len(t, texts, 2)
	assert.Equal(t, texts[0], texts[1], "the same answer either way")
}

// BenchmarkCascadeFirstAudio is the time to first audio of a streamed chat
// through a cascade (asr → thinker → talker → vocoder, a sim decode step of
// 4 ms, 48 tokens), at the client of the HTTP API (openai-go), with the
// stages streaming into each other and one after the other; p50 and p90
// over b.N requests in a row (docs/benchmarks.md, "Streaming between
// stages").
func BenchmarkCascadeFirstAudio(b *testing.B) {
	audio := bytes.Repeat([]byte{3, 0, 5, 0}, 2000)
	for _, streaming := range []bool{true, false} {
		b.Run(fmt.Sprintf("streaming=%v", streaming), func(b *testing.B) {
			p := orchestrator.Pipeline{Model: model, Streaming: &streaming,
				Stages: []orchestrator.Stage{{Name: "asr"}, {Name: "thinker"}, {Name: "talker"}, {Name: "vocoder"}}}
			c := startCluster(b, orchestratortest.Options{Pipeline: p, Sim: sim.Config{DecodeTokenLatency: 4 * time.Millisecond}})
			client := startAPI(b, c, Config{}, nil, nil).openai()
			firsts := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for i := range b.N {
				start := time.Now()
				stream := client.Chat.Completions.NewStreaming(testCtx(b), openai.ChatCompletionNewParams{
					Model: model,
					Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage([]openai.ChatCompletionContentPartUnionParam{
						openai.InputAudioContentPart(openai.ChatCompletionContentPartInputAudioInputAudioParam{Data: base64.StdEncoding.EncodeToString(audio), Format: "wav"}),
					})},
					Seed:       openai.Int(int64(i)),
					MaxTokens:  openai.Int(48),
					Modalities: []string{"text", "audio"},
					Audio:      openai.ChatCompletionAudioParam{Voice: openai.ChatCompletionAudioParamVoiceUnion{OfString: openai.String("alloy")}, Format: "pcm16"},
				}, option.WithJSONSet("ignore_eos", true))
				first := time.Duration(0)
				for stream.Next() {
					ch := stream.Current()
					if first != 0 || len(ch.Choices) == 0 {
						continue
					}
					var delta struct {
						Audio struct {
							Data string `json:"data"`
						} `json:"audio"`
					}
					if json.Unmarshal([]byte(ch.Choices[0].Delta.RawJSON()), &delta) == nil && delta.Audio.Data != "" {
						first = time.Since(start)
					}
				}
				if err := stream.Err(); err != nil || first == 0 {
					b.Fatalf("request %d: %v (first audio %v)", i, err, first)
				}
				_ = stream.Close()
				firsts = append(firsts, first)
			}
			b.StopTimer()
			slices.Sort(firsts)
			b.ReportMetric(float64(firsts[len(firsts)/2].Microseconds())/1000, "ttfa-p50-ms")
			b.ReportMetric(float64(firsts[len(firsts)*9/10].Microseconds())/1000, "ttfa-p90-ms")
		})
	}
}
