package httpapi

import (
	"context"
	"encoding/base64"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/omnisim"
	"github.com/troupe-serving/troupe/worker/sim"
)

const hiddenWidth = 256

// chained is what omnisim's thinker and talker and the sim vocoder make
// chained directly in this process for prompt (a chat of one user
// message): the text, and the audio of the talker's codes for every
// hidden row.
func chained(t *testing.T, prompt string, tokens int, seed int64, voice string) (string, []byte) {
	t.Helper()
	ctx := context.Background()
	var text strings.Builder
	var codes []uint32
	th := &omnisim.Thinker{Width: hiddenWidth, MaxTokens: tokens}
	req := &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Chat{Chat: &stagepb.Chat{Messages: []*stagepb.ChatMessage{{Role: "user", Content: prompt}}}}}
	require.NoError(t, th.Generate(ctx, req, func(c *stagepb.GenerateChunk) error {
		text.WriteString(c.GetText())
		for _, r := range c.GetTensors() {
			codes = append(codes, omnisim.CodesOf(r.GetData(), 2, 1024)...)
		}
		return nil
	}))
	voc := sim.New(sim.Config{Role: stagepb.RoleAudio})
	defer voc.Close()
	var pcm []byte
	require.NoError(t, voc.Generate(ctx, &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Codes{Codes: &stagepb.Codes{Codes: codes}},
		Sampling: &stagepb.SamplingParams{Seed: &seed}, Voice: voice}, func(c *stagepb.GenerateChunk) error {
		pcm = append(pcm, c.GetAudioPcm16()...)
		return nil
	}))
	return text.String(), pcm
}

// tensorCluster is thinker (omnisim, hidden rows) → talker (omnisim, two
// replicas, each wrapped by talker) → vocoder (sim).
func tensorCluster(t *testing.T, talker func(worker.Engine) worker.Engine) *orchestratortest.Cluster {
	c := startCluster(t, orchestratortest.Options{ReplicasPerStage: -1})
	th := c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{Engine: func(*sim.Engine) worker.Engine { return &omnisim.Thinker{Width: hiddenWidth, MaxTokens: 24} }})
	c.WaitState(t, "thinker", th.ReplicaID(), "attached")
	for range 2 {
		w := c.AddWorker(t, "talker", orchestratortest.WorkerOptions{Engine: func(*sim.Engine) worker.Engine { return talker(&omnisim.Talker{}) }})
		c.WaitState(t, "talker", w.ReplicaID(), "attached")
	}
	v := c.AddWorker(t, "vocoder", orchestratortest.WorkerOptions{})
	c.WaitState(t, "vocoder", v.ReplicaID(), "attached")
	return c
}

// TestTensorPipeline: a chat with audio through thinker → talker → vocoder
// whose talker reads the thinker's hidden states, worker to worker: the
// client gets the text, and audio equal to the three stages chained in
// one process, whole and streamed.
func TestTensorPipeline(t *testing.T) {
	c := tensorCluster(t, func(e worker.Engine) worker.Engine { return e })
	client := startAPI(t, c, Config{}, nil, nil).openai()
	ctx := testCtx(t)
	wantText, wantPCM := chained(t, "tell me", 24, 7, "alloy")
	params := openai.ChatCompletionNewParams{
		Model:      model,
		Messages:   []openai.ChatCompletionMessageParamUnion{openai.UserMessage("tell me")},
		Seed:       openai.Int(7),
		Modalities: []string{"text", "audio"},
		Audio:      openai.ChatCompletionAudioParam{Voice: openai.ChatCompletionAudioParamVoiceUnion{OfString: openai.String("alloy")}, Format: "pcm16"},
	}
	res, err := client.Chat.Completions.New(ctx, params)
	require.NoError(t, err)
	assert.Equal(t, wantText, res.Choices[0].Message.Content)
	pcm, err := base64.StdEncoding.DecodeString(res.Choices[0].Message.Audio.Data)
	require.NoError(t, err)
	require.NotEmpty(t, wantPCM)
	assert.Equal(t, wantPCM, pcm, "the audio of the thinker's hidden states")

	stream := client.Chat.Completions.NewStreaming(ctx, params)
	var text strings.Builder
	var streamed []byte
	for stream.Next() {
		for _, ch := range stream.Current().Choices {
			text.WriteString(ch.Delta.Content)
			if ch.Delta.Audio.Data != "" {
				b, err := base64.StdEncoding.DecodeString(ch.Delta.Audio.Data)
				require.NoError(t, err)
				streamed = append(streamed, b...)
			}
		}
	}
	require.NoError(t, stream.Err())
	assert.Equal(t, wantText, text.String())
	assert.Equal(t, wantPCM, streamed, "streamed: the same audio")
}

// TestTensorConsumerFails: the talker that takes the request fails right
// after answering its first segment; the head retries the talker on the other replica,
// where the thinker's worker sends every hidden row again: the client's
// audio is still whole and equal.
func TestTensorConsumerFails(t *testing.T) {
	var failed atomic.Bool
	c := tensorCluster(t, func(e worker.Engine) worker.Engine { return &failOnce{Engine: e, failed: &failed} })
	client := startAPI(t, c, Config{}, nil, nil).openai()
	wantText, wantPCM := chained(t, "once more", 24, 3, "alloy")
	res, err := client.Chat.Completions.New(testCtx(t), openai.ChatCompletionNewParams{
		Model:      model,
		Messages:   []openai.ChatCompletionMessageParamUnion{openai.UserMessage("once more")},
		Seed:       openai.Int(3),
		Modalities: []string{"text", "audio"},
		Audio:      openai.ChatCompletionAudioParam{Voice: openai.ChatCompletionAudioParamVoiceUnion{OfString: openai.String("alloy")}, Format: "pcm16"},
	})
	require.NoError(t, err)
	require.True(t, failed.Load(), "a talker failed mid-request")
	assert.Equal(t, wantText, res.Choices[0].Message.Content)
	pcm, err := base64.StdEncoding.DecodeString(res.Choices[0].Message.Audio.Data)
	require.NoError(t, err)
	assert.Equal(t, wantPCM, pcm)
}

// failOnce fails right after the first segment it answers, once across its
// replicas: a talker that breaks mid-request, with part of its output
// already forwarded.
type failOnce struct {
	worker.Engine
	failed *atomic.Bool
}

func (f *failOnce) Generate(ctx context.Context, req *stagepb.GenerateRequest, emit func(*stagepb.GenerateChunk) error) error {
	if err := f.Engine.Generate(ctx, req, emit); err != nil {
		return err
	}
	if f.failed.CompareAndSwap(false, true) {
		return status.Error(codes.Unavailable, "talker: lost its device")
	}
	return nil
}

func (f *failOnce) ContinuesInput() bool { return true }
