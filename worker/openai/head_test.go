package openai_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/tokenizers"
	"github.com/troupe-serving/troupe/worker/openai"
	"github.com/troupe-serving/troupe/worker/sim"
)

var thinkerOnly = orchestrator.Pipeline{Model: "troupe-omni-sim", Stages: []orchestrator.Stage{{Name: "thinker"}}}

// TestChatFromTroupeHead: a real OpenAI-compatible server (a troupe head
// over sim workers) behind the engine. The conversation goes to the chat
// completions as messages, and the streamed text, finish and usage are
// exactly what the upstream's sim makes of it.
func TestChatFromTroupeHead(t *testing.T) {
	up := startUpstreamHead(t, orchestratortest.Options{Pipeline: thinkerOnly})
	e := startText(t, openai.Config{URL: up.base})
	assert.Equal(t, "troupe-omni-sim", e.Model(), "the first model of /v1/models")
	h := e.Health()
	assert.Equal(t, stagepb.ServingStatus_SERVING_STATUS_SERVING, h.GetStatus())
	assert.Equal(t, "openai", h.GetEngine())
	assert.Equal(t, "text", h.GetRole())
	assert.Equal(t, "text", h.GetInputRole())

	msgs := []*stagepb.ChatMessage{msg("system", "be brief"), msg("user", "tell me about rivers")}
	prompt := tokenizers.ChatText(msgs)
	for _, tc := range []struct {
		name string
		sp   *stagepb.SamplingParams
	}{
		{"natural end", &stagepb.SamplingParams{MaxTokens: 64, Seed: proto.Int64(5)}},
		{"length", &stagepb.SamplingParams{MaxTokens: 3, Seed: proto.Int64(5), Temperature: proto.Float32(0.7)}},
		{"ignore_eos", &stagepb.SamplingParams{MaxTokens: 40, Seed: proto.Int64(5), IgnoreEos: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			chunks, err := collect(testCtx(t), e, chatReq(tc.sp, msgs...))
			require.NoError(t, err)
			x, err := sim.Expect(stagepb.RoleText, &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Text{Text: prompt}, Sampling: tc.sp})
			require.NoError(t, err)
			wantText, wantTokens, wantFinish := x.Text, x.GenerationTokens, x.Finish
			assert.Equal(t, wantText, joinText(chunks))
			last := chunks[len(chunks)-1]
			assert.Equal(t, wantFinish, last.GetFinishReason())
			assert.Equal(t, uint64(len(tokenizers.Sim(prompt))), last.GetStats().GetPromptTokens(), "usage: prompt tokens as the upstream counted them")
			_, generated := sumStats(chunks)
			assert.Equal(t, uint64(wantTokens), generated, "the chunks' counts add up to the upstream's usage")
			assert.Equal(t, last.GetStats().GetPromptTokens(), last.GetStats().GetPromptTokensLocalCompute())
			require.NotNil(t, last.GetTimings())
			assert.GreaterOrEqual(t, last.GetTimings().GetPrefillSeconds(), 0.0)
			for _, c := range chunks[:len(chunks)-1] {
				assert.Equal(t, stagepb.FinishReason_FINISH_REASON_UNSPECIFIED, c.GetFinishReason())
				assert.NotEmpty(t, c.GetText())
				assert.Empty(t, c.GetTokenIds(), "no token ids from an upstream")
			}
			if wantTokens > 1 {
				assert.Greater(t, len(chunks), 2, "streamed, not one blob")
			}
		})
	}

	// A stop string: the text is cut before it, finish stop.
	full, _, _ := sim.ExpectedText(prompt, 9, 0)
	words := strings.Fields(full)
	require.Greater(t, len(words), 3)
	stop := " " + words[2]
	chunks, err := collect(testCtx(t), e, chatReq(&stagepb.SamplingParams{Seed: proto.Int64(9), Stop: []string{stop}}, msgs...))
	require.NoError(t, err)
	assert.Equal(t, full[:strings.Index(full, stop)], joinText(chunks))
	assert.Equal(t, stagepb.FinishReason_FINISH_REASON_STOP, chunks[len(chunks)-1].GetFinishReason())
}

// TestCompletionFromTroupeHead: text input goes to the text completions,
// as given (no chat template); the URL without /v1 works too.
func TestCompletionFromTroupeHead(t *testing.T) {
	up := startUpstreamHead(t, orchestratortest.Options{Pipeline: thinkerOnly})
	e := startText(t, openai.Config{URL: strings.TrimSuffix(up.base, "/v1"), Model: "troupe-omni-sim"})
	chunks, err := collect(testCtx(t), e, &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Text{Text: "once upon a time"}, Sampling: &stagepb.SamplingParams{MaxTokens: 7, Seed: proto.Int64(2)}})
	require.NoError(t, err)
	want, tokens, fin := sim.ExpectedText("once upon a time", 2, 7)
	assert.Equal(t, want, joinText(chunks))
	assert.Equal(t, fin, chunks[len(chunks)-1].GetFinishReason())
	_, generated := sumStats(chunks)
	assert.Equal(t, uint64(tokens), generated)
}

// TestUpstreamRefusesInput: the upstream's 400 is InvalidArgument carrying
// its message.
func TestUpstreamRefusesInput(t *testing.T) {
	up := startUpstreamHead(t, orchestratortest.Options{Pipeline: thinkerOnly})
	e := startText(t, openai.Config{URL: up.base})
	_, err := collect(testCtx(t), e, chatReq(&stagepb.SamplingParams{Temperature: proto.Float32(3)}, msg("user", "hi")))
	require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
	assert.Equal(t, "temperature must be between 0 and 2, got 3", status.Convert(err).Message())
}

// TestModelNotFound: a model the upstream does not serve is a startup
// error, at once, not a wait.
func TestModelNotFound(t *testing.T) {
	up := startUpstreamHead(t, orchestratortest.Options{Pipeline: thinkerOnly})
	e, err := openai.New(openai.Config{URL: up.base, Model: "no-such-model", Logger: quiet()})
	require.NoError(t, err)
	start := time.Now()
	err = run(t, e).result(t)
	require.ErrorIs(t, err, openai.ErrModelNotFound)
	assert.Contains(t, err.Error(), `does not serve model "no-such-model"`)
	assert.Contains(t, err.Error(), "troupe-omni-sim")
	assert.Less(t, time.Since(start), 10*time.Second)
	ok, _ := e.Available()
	assert.False(t, ok)
}

// TestCancelAbortsUpstream: cancelling the request aborts the upstream
// HTTP request: the upstream's engine counts an abort and holds nothing.
func TestCancelAbortsUpstream(t *testing.T) {
	up := startUpstreamHead(t, orchestratortest.Options{Pipeline: thinkerOnly, Sim: sim.Config{DecodeTokenLatency: 20 * time.Millisecond}})
	e := startText(t, openai.Config{URL: up.base})
	ctx, cancel := context.WithCancel(testCtx(t))
	got := 0
	err := e.Generate(ctx, chatReq(&stagepb.SamplingParams{MaxTokens: 2000, IgnoreEos: true}, msg("user", "talk forever")),
		func(c *stagepb.GenerateChunk) error {
			got++
			if got == 2 {
				cancel()
			}
			return nil
		})
	require.ErrorIs(t, err, context.Canceled)
	upEngine := up.Workers()[0].Engine
	require.Eventually(t, func() bool {
		s := upEngine.Snapshot()
		return s.Finished[stagepb.FinishReason_FINISH_REASON_ABORT] == 1 && s.Running == 0
	}, wait, 5*time.Millisecond, "the upstream aborted the request")
	assert.Less(t, got, 100, "stopped well before 2000 tokens")
}
