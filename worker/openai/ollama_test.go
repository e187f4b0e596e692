package openai_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	oa "github.com/openai/openai-go/v3"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker/openai"
)

// The tests of this file hold the worker to what Ollama does that other
// servers do not: zeros as usage on every /v1/completions chunk, limits it
// ignores, and streams it ends without a finish reason or [DONE].

// words is " w<from>" … " w<to-1>", as deltas of one word each.
func words(from, to int) []string {
	var out []string
	for i := from; i < to; i++ {
		out = append(out, fmt.Sprintf(" w%d", i))
	}
	return out
}

// textEnd is a /v1/completions chunk that ends the answer.
func textEnd(reason string) string {
	return `{"object":"text_completion","choices":[{"index":0,"text":"","finish_reason":"` + reason + `"}]}`
}

// TestZeroUsageMigration: an Ollama-like upstream puts zero usage on
// every /v1/completions chunk. The chunks still count one token each, so
// an answer cut after 4 of its 10 tokens continues with 6 left, the client
// gets 10 deltas and usage 10, and a cancelled request's deltas reach the
// head's counters.
func TestZeroUsageMigration(t *testing.T) {
	const limit, cutAfter = 10, 4
	handler := func(f *fake) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			b := f.lastBody()
			prompt, _ := b["prompt"].(string)
			max, _ := b["max_tokens"].(float64)
			switch {
			case prompt == "count":
				for _, s := range words(0, cutAfter) {
					sse(w, ollamaText(s))
				}
				panic(http.ErrAbortHandler) // the engine dies
			case strings.HasPrefix(prompt, "count "): // the continuation, as limited as asked
				from := len(strings.Fields(strings.TrimPrefix(prompt, "count")))
				for _, s := range words(from, from+int(max)) {
					sse(w, ollamaText(s))
				}
				sse(w, textEnd("length"), usageEvent(1+from, int(max), 0), "[DONE]")
			case prompt == "endless":
				sse(w, ollamaText(" a"), ollamaText(" b"), ollamaText(" c"))
				<-r.Context().Done()
			}
		}
	}
	a1, a2 := newFake(t), newFake(t)
	a1.route("POST /v1/completions", handler(a1))
	a2.route("POST /v1/completions", handler(a2))
	b, client := headWithWorkers(t, a1, a2)
	ctx := testCtx(t)

	stream := client.Completions.NewStreaming(ctx, oa.CompletionNewParams{
		Model: "troupe-omni-sim", Prompt: oa.CompletionNewParamsPromptUnion{OfString: oa.String("count")},
		MaxTokens: oa.Int(limit), StreamOptions: oa.ChatCompletionStreamOptionsParam{IncludeUsage: oa.Bool(true)},
	})
	var text strings.Builder
	var usage oa.CompletionUsage
	deltas := 0
	for stream.Next() {
		ch := stream.Current()
		if len(ch.Choices) == 0 {
			usage = ch.Usage
			continue
		}
		if ch.Choices[0].Text != "" {
			deltas++
		}
		text.WriteString(ch.Choices[0].Text)
	}
	require.NoError(t, stream.Err())
	require.NoError(t, stream.Close())
	assert.Equal(t, strings.Join(words(0, limit), ""), text.String())
	assert.Equal(t, limit, deltas, "max_tokens holds across the migration")
	assert.Equal(t, int64(limit), usage.CompletionTokens, "usage is what the client received")

	cont := a2.lastBody()
	if cont["prompt"] == "count" {
		cont = a1.lastBody()
	}
	require.NotEqual(t, "count", cont["prompt"], "the answer was continued")
	assert.EqualValues(t, limit-cutAfter, cont["max_tokens"], "what is left of max_tokens after 4 delivered")
	assert.Equal(t, float64(limit), total(t, b.Metrics, "troupe_generation_tokens_total"), "the cut attempt's tokens are counted too")

	// A cancelled request's deltas count.
	before := total(t, b.Metrics, "troupe_generation_tokens_total")
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	cs := client.Completions.NewStreaming(cctx, oa.CompletionNewParams{
		Model: "troupe-omni-sim", Prompt: oa.CompletionNewParamsPromptUnion{OfString: oa.String("endless")}, MaxTokens: oa.Int(50),
	})
	got := ""
	for got != " a b c" && cs.Next() {
		if ch := cs.Current(); len(ch.Choices) > 0 {
			got += ch.Choices[0].Text
		}
	}
	require.Equal(t, " a b c", got)
	cancel()
	_ = cs.Close()
	require.Eventually(t, func() bool {
		return total(t, b.Metrics, "troupe_generation_tokens_total") == before+3
	}, wait, 5*time.Millisecond, "the cancelled request's 3 deltas are counted")
}

// ignoring answers as Ollama does a limit it ignores: word after word
// past it. A worker that keeps the limit goes away after the word past it,
// which the handler waits for (bounded) and reports on ends: true when
// the request was cancelled there.
func ignoring(f *fake, ends chan<- bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		limit, _ := f.lastBody()["max_tokens"].(float64)
		ev := delta
		if r.URL.Path == "/v1/completions" {
			ev = ollamaText
		}
		for i, s := range words(0, 1000) {
			sse(w, ev(s))
			if i == int(limit) {
				select {
				case <-r.Context().Done():
					ends <- true
					return
				case <-time.After(wait):
				}
			}
		}
		sse(w, finish("stop"), "[DONE]")
		ends <- false
	}
}

// TestMaxTokensEnforced: {"max_tokens":32,"max_completion_tokens":5}
// reaches the upstream as both names with the head's limit (5), and an
// upstream that ignores it is cut there by the worker: 5 deltas, finish
// length, usage 5, the upstream request cancelled. Likewise max_tokens on
// /v1/completions, answered whole.
func TestMaxTokensEnforced(t *testing.T) {
	f := newFake(t)
	ends := make(chan bool, 2)
	f.route("POST /v1/chat/completions", ignoring(f, ends))
	f.route("POST /v1/completions", ignoring(f, ends))
	_, client := headWithWorkers(t, f)
	ctx := testCtx(t)
	cancelled := func() bool {
		t.Helper()
		select {
		case c := <-ends:
			return c
		case <-ctx.Done():
			t.Fatal("the upstream request never ended")
			return false
		}
	}

	stream := client.Chat.Completions.NewStreaming(ctx, oa.ChatCompletionNewParams{
		Model: "troupe-omni-sim", Messages: []oa.ChatCompletionMessageParamUnion{oa.UserMessage("talk")},
		MaxTokens: oa.Int(32), MaxCompletionTokens: oa.Int(5), StreamOptions: oa.ChatCompletionStreamOptionsParam{IncludeUsage: oa.Bool(true)},
	})
	var text strings.Builder
	var usage oa.CompletionUsage
	deltas, reason := 0, ""
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
		if r := ch.Choices[0].FinishReason; r != "" {
			reason = r
		}
	}
	require.NoError(t, stream.Err())
	require.NoError(t, stream.Close())
	assert.Equal(t, strings.Join(words(0, 5), ""), text.String())
	assert.Equal(t, 5, deltas)
	assert.Equal(t, "length", reason)
	assert.Equal(t, int64(5), usage.CompletionTokens)
	body := f.lastBody()
	assert.EqualValues(t, 5, body["max_tokens"], "the name every server reads")
	assert.EqualValues(t, 5, body["max_completion_tokens"], "the client's name")
	assert.True(t, cancelled(), "the worker cancelled the upstream request at the limit")

	res, err := client.Completions.New(ctx, oa.CompletionNewParams{
		Model: "troupe-omni-sim", Prompt: oa.CompletionNewParamsPromptUnion{OfString: oa.String("talk")}, MaxTokens: oa.Int(3),
	})
	require.NoError(t, err)
	require.Len(t, res.Choices, 1)
	assert.Equal(t, strings.Join(words(0, 3), ""), res.Choices[0].Text)
	assert.Equal(t, "length", string(res.Choices[0].FinishReason))
	assert.Equal(t, int64(3), res.Usage.CompletionTokens)
	body = f.lastBody()
	assert.EqualValues(t, 3, body["max_tokens"])
	assert.NotContains(t, body, "max_completion_tokens")
	assert.True(t, cancelled(), "the worker cancelled the upstream request at the limit")
}

// TestLimitKeptByUpstream: an upstream that keeps the limit is not cut:
// an answer that stops on its own at exactly max_tokens keeps its reason
// (stop) and its final usage (the prompt tokens).
func TestLimitKeptByUpstream(t *testing.T) {
	f := newFake(t)
	f.route("POST /v1/chat/completions", func(w http.ResponseWriter, _ *http.Request) {
		sse(w, delta("a"), delta(" b"), delta(" c"), finish("stop"), usageEvent(7, 3, 0), "[DONE]")
	})
	e := startText(t, openai.Config{URL: f.URL})
	chunks, err := collect(testCtx(t), e, chatReq(&stagepb.SamplingParams{MaxTokens: 3}, msg("user", "x")))
	require.NoError(t, err)
	assert.Equal(t, "a b c", joinText(chunks))
	assert.Equal(t, stagepb.FinishReason_FINISH_REASON_STOP, chunks[len(chunks)-1].GetFinishReason())
	prompt, generated := sumStats(chunks)
	assert.Equal(t, uint64(7), prompt)
	assert.Equal(t, uint64(3), generated)
}

// TestCleanEndWithoutFinishIsStop: an upstream that ends its response
// (read to its end) after text, with neither a finish reason nor [DONE],
// as Ollama does when it stops a generation that repeats itself, ended
// the answer normally: stop, on both endpoints.
func TestCleanEndWithoutFinishIsStop(t *testing.T) {
	f := newFake(t)
	f.route("POST /v1/chat/completions", func(w http.ResponseWriter, _ *http.Request) { sse(w, delta("one"), delta(" two")) })
	f.route("POST /v1/completions", func(w http.ResponseWriter, _ *http.Request) { sse(w, ollamaText("one"), ollamaText(" two")) })
	e := startText(t, openai.Config{URL: f.URL})
	for name, req := range map[string]*stagepb.GenerateRequest{
		"chat":        chatReq(nil, msg("user", "x")),
		"completions": {Input: &stagepb.GenerateRequest_Text{Text: "x"}},
	} {
		chunks, err := collect(testCtx(t), e, req)
		require.NoError(t, err, name)
		assert.Equal(t, "one two", joinText(chunks), name)
		assert.Equal(t, stagepb.FinishReason_FINISH_REASON_STOP, chunks[len(chunks)-1].GetFinishReason(), name)
		_, generated := sumStats(chunks)
		assert.Equal(t, uint64(2), generated, name)
	}
}

// TestCleanEndThroughHead: the same end reaches an OpenAI client of the
// head as a normal answer (200, finish_reason stop), on chat and
// completions, streamed and whole, and nothing is retried.
func TestCleanEndThroughHead(t *testing.T) {
	f := newFake(t)
	f.route("POST /v1/chat/completions", func(w http.ResponseWriter, _ *http.Request) { sse(w, delta("one"), delta(" two")) })
	f.route("POST /v1/completions", func(w http.ResponseWriter, _ *http.Request) { sse(w, ollamaText("one"), ollamaText(" two")) })
	_, client := headWithWorkers(t, f)
	ctx := testCtx(t)
	chat := oa.ChatCompletionNewParams{Model: "troupe-omni-sim", Messages: []oa.ChatCompletionMessageParamUnion{oa.UserMessage("x")},
		StreamOptions: oa.ChatCompletionStreamOptionsParam{IncludeUsage: oa.Bool(true)}}
	text := oa.CompletionNewParams{Model: "troupe-omni-sim", Prompt: oa.CompletionNewParamsPromptUnion{OfString: oa.String("x")},
		StreamOptions: oa.ChatCompletionStreamOptionsParam{IncludeUsage: oa.Bool(true)}}

	t.Run("chat whole", func(t *testing.T) {
		res, err := client.Chat.Completions.New(ctx, chat)
		require.NoError(t, err)
		assert.Equal(t, "one two", res.Choices[0].Message.Content)
		assert.Equal(t, "stop", res.Choices[0].FinishReason)
		assert.Equal(t, int64(2), res.Usage.CompletionTokens)
	})
	t.Run("chat streamed", func(t *testing.T) {
		s := client.Chat.Completions.NewStreaming(ctx, chat)
		got, reason := "", ""
		for s.Next() {
			if ch := s.Current(); len(ch.Choices) > 0 {
				got += ch.Choices[0].Delta.Content
				if ch.Choices[0].FinishReason != "" {
					reason = ch.Choices[0].FinishReason
				}
			}
		}
		require.NoError(t, s.Err())
		require.NoError(t, s.Close())
		assert.Equal(t, "one two", got)
		assert.Equal(t, "stop", reason)
	})
	t.Run("completions whole", func(t *testing.T) {
		res, err := client.Completions.New(ctx, text)
		require.NoError(t, err)
		assert.Equal(t, "one two", res.Choices[0].Text)
		assert.Equal(t, "stop", string(res.Choices[0].FinishReason))
	})
	t.Run("completions streamed", func(t *testing.T) {
		s := client.Completions.NewStreaming(ctx, text)
		got, reason := "", ""
		for s.Next() {
			if ch := s.Current(); len(ch.Choices) > 0 {
				got += ch.Choices[0].Text
				if ch.Choices[0].FinishReason != "" {
					reason = string(ch.Choices[0].FinishReason)
				}
			}
		}
		require.NoError(t, s.Err())
		require.NoError(t, s.Close())
		assert.Equal(t, "one two", got)
		assert.Equal(t, "stop", reason)
	})
	assert.Equal(t, 4, f.posts(), "one upstream request per client request: nothing retried")
}
