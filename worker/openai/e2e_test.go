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
