package openai

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/pkg/sse"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// Engine is a text stage served by an upstream's streaming completions.
// Run must be running for it to become available. Its methods may be
// called concurrently.
type Engine struct {
	*upstream
}

// New builds the engine; it sends nothing until Run or Generate.
func New(cfg Config) (*Engine, error) {
	u, err := newUpstream(cfg)
	if err != nil {
		return nil, err
	}
	return &Engine{upstream: u}, nil
}

// Health reports a text stage (text in, text out), the upstream's
// availability and its load, and whether it continues chat answers.
func (e *Engine) Health() *stagepb.HealthResponse {
	h := e.health(EngineName, stagepb.RoleText)
	h.ContinuesChat = e.caps().continueChat
	h.InputParts, h.InputPartUrls = upstreamParts, true
	return h
}

// chatRequest is the body of POST /v1/chat/completions and, with Prompt
// instead of Messages, of POST /v1/completions.
type chatRequest struct {
	Model         string         `json:"model"`
	Messages      []chatMessage  `json:"messages,omitempty"`
	Prompt        any            `json:"prompt,omitempty"` // string or token ids
	Stream        bool           `json:"stream"`
	StreamOptions *streamOptions `json:"stream_options,omitempty"`
	// The sampling parameters the client set, under their OpenAI and vLLM
	// names; unset ones are not sent (the upstream's defaults apply).
	MaxTokens           uint32             `json:"max_tokens,omitempty"`
	MaxCompletionTokens uint32             `json:"max_completion_tokens,omitempty"`
	Temperature         *float32           `json:"temperature,omitempty"`
	TopP                *float32           `json:"top_p,omitempty"`
	TopK                *int32             `json:"top_k,omitempty"` // vLLM, SGLang, llama.cpp, Ollama
	MinP                *float32           `json:"min_p,omitempty"` // vLLM, SGLang, llama.cpp, Ollama
	FrequencyPenalty    *float32           `json:"frequency_penalty,omitempty"`
	PresencePenalty     *float32           `json:"presence_penalty,omitempty"`
	RepetitionPenalty   *float32           `json:"repetition_penalty,omitempty"` // vLLM, SGLang, llama.cpp
	LogitBias           map[string]float32 `json:"logit_bias,omitempty"`
	MinTokens           uint32             `json:"min_tokens,omitempty"` // vLLM, SGLang
	Seed                *int64             `json:"seed,omitempty"`
	Stop                []string           `json:"stop,omitempty"`
	IgnoreEOS           bool               `json:"ignore_eos,omitempty"` // vLLM, SGLang, llama.cpp; sent only when true
	// A continuation: the last message is the assistant's unfinished turn,
	// continued rather than answered (vLLM's chat template options; other
	// servers continue the text prompt below).
	ContinueFinalMessage bool  `json:"continue_final_message,omitempty"`
	AddGenerationPrompt  *bool `json:"add_generation_prompt,omitempty"`
}

type chatMessage struct {
	Role    string `json:"role"`
	Content any    `json:"content"` // a string, or []contentPart (parts.go)
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
	// vLLM and SGLang: usage (cumulative) on every chunk, so each chunk's
	// token count is exact. Sent only to them (see upstream.caps).
	ContinuousUsageStats bool `json:"continuous_usage_stats,omitempty"`
}

// streamEvent is one SSE data event of a streamed completion.
type streamEvent struct {
	Choices []struct {
		Delta struct {
			Content *string `json:"content"`
		} `json:"delta"`
		Text         *string `json:"text"` // /v1/completions
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *usage `json:"usage"`
	// Errors sent in the stream: {"error":{...}} or vLLM's older
	// {"object":"error","message":...}.
	Error   json.RawMessage `json:"error"`
	Object  string          `json:"object"`
	Message string          `json:"message"`
}

type usage struct {
	PromptTokens        uint64 `json:"prompt_tokens"`
	CompletionTokens    uint64 `json:"completion_tokens"`
	PromptTokensDetails *struct {
		CachedTokens uint64 `json:"cached_tokens"`
		AudioTokens  uint64 `json:"audio_tokens"` // servers that count them (OpenAI's)
		ImageTokens  uint64 `json:"image_tokens"`
	} `json:"prompt_tokens_details"`
}

// body builds the upstream request: a chat input goes to the chat
// completions (the upstream applies its chat template), text and token
// ids to the text completions (the prompt as given).
func (e *Engine) body(req *stagepb.GenerateRequest) (path string, body chatRequest, err error) {
	sp := req.GetSampling()
	caps := e.caps()
	body = chatRequest{
		Model:         e.Model(),
		Stream:        true,
		StreamOptions: &streamOptions{IncludeUsage: true, ContinuousUsageStats: caps.continuousUsage},
		Stop:          sp.GetStop(),
		IgnoreEOS:     sp.GetIgnoreEos(),
		LogitBias:     sp.GetLogitBias(),
		MinTokens:     sp.GetMinTokens(),
	}
	// Every OpenAI-compatible server reads max_tokens (Ollama reads no
	// other); the client's own name goes along when it used it.
	body.MaxTokens = sp.GetMaxTokens()
	if sp.GetMaxCompletionTokens() {
		body.MaxCompletionTokens = sp.GetMaxTokens()
	}
	if sp != nil {
		body.Temperature, body.Seed, body.TopP, body.TopK, body.MinP = sp.Temperature, sp.Seed, sp.TopP, sp.TopK, sp.MinP
		body.FrequencyPenalty, body.PresencePenalty, body.RepetitionPenalty = sp.FrequencyPenalty, sp.PresencePenalty, sp.RepetitionPenalty
	}
	switch in := req.GetInput().(type) {
	case *stagepb.GenerateRequest_Chat:
		msgs := in.Chat.GetMessages()
		if len(msgs) == 0 {
			return "", body, status.Error(codes.InvalidArgument, "openai: chat input without messages")
		}
		body.Messages = make([]chatMessage, len(msgs))
		for i, m := range msgs {
			body.Messages[i] = chatMessage{Role: m.GetRole(), Content: messageContent(m)}
		}
		if c := req.GetContinuation(); c != "" {
			if !caps.continueChat {
				// Sent without continue_final_message, the upstream would
				// answer the unfinished turn instead of continuing it.
				return "", body, status.Errorf(codes.FailedPrecondition, "openai: upstream %s cannot continue a chat answer (it has no continue_final_message; vLLM has)", e.root)
			}
			no := false
			body.Messages = append(body.Messages, chatMessage{Role: "assistant", Content: c})
			body.ContinueFinalMessage, body.AddGenerationPrompt = true, &no
		}
		return "/chat/completions", body, nil
	case *stagepb.GenerateRequest_Text:
		body.Prompt = in.Text + req.GetContinuation()
		return "/completions", body, nil
	case *stagepb.GenerateRequest_TokenIds:
		body.Prompt = in.TokenIds.GetIds()
		return "/completions", body, nil
	}
	return "", body, status.Errorf(codes.InvalidArgument, "openai: a text stage takes text, chat or token_ids input, got %T", req.GetInput())
}

// Generate streams one completion from the upstream. Each text delta is
// one chunk, as the upstream sent it, carrying the tokens it holds
// (tokenCounter); the final chunk carries the finish reason, what the
// upstream's final usage adds to the counts sent before it, and timings
// measured here (prefill: until the first delta; decode: from the first
// delta to the last). Token ids are not sent. Cancelling ctx aborts the
// upstream HTTP request.
//
// max_tokens holds even where the upstream ignores it: text past the
// limit is not sent, the upstream request is cancelled and the answer
// ends with length. A stream broken before its end is an Unavailable
// error, never a short success; one read to its end after text ended
// normally, with or without [DONE] and a finish reason.
func (e *Engine) Generate(ctx context.Context, req *stagepb.GenerateRequest, emit func(*stagepb.GenerateChunk) error) error {
	if err := e.admit(); err != nil {
		return err
	}
	path, body, err := e.body(req)
	if err != nil {
		return err
	}
	limit := uint64(req.GetSampling().GetMaxTokens()) // 0: none
	untrack := e.track()
	defer untrack()
	// upCtx also ends the upstream request when the answer reaches its limit.
	upCtx, cancelUp := context.WithCancel(ctx)
	defer cancelUp()
	start := time.Now()
	resp, err := e.postJSON(upCtx, path, body)
	if err != nil {
		return err
	}
	defer closeBody(resp)
	if resp.StatusCode != http.StatusOK {
		return statusError(resp)
	}

	var (
		first, last time.Time
		finish      string
		done        bool // [DONE]: the upstream ended the stream itself
		count       tokenCounter
	)
	events := sse.NewReader(resp.Body)
	for {
		data, err := events.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return status.Errorf(codes.Unavailable, "openai: upstream stream broken after %d deltas: %v", count.deltas, err)
		}
		if string(data) == sse.Done {
			done = true
			break
		}
		var ev streamEvent
		if err := json.Unmarshal(data, &ev); err != nil {
			return status.Errorf(codes.Internal, "openai: malformed stream event %.200q: %v", data, err)
		}
		if len(ev.Error) > 0 || ev.Object == "error" {
			return status.Errorf(codes.Unavailable, "openai: upstream failed mid-stream after %d deltas: %s", count.deltas, errorMessage(data))
		}
		text := ""
		for _, c := range ev.Choices {
			t := c.Text
			if c.Delta.Content != nil {
				t = c.Delta.Content
			}
			if t != nil {
				text += *t
			}
			if c.FinishReason != nil && *c.FinishReason != "" {
				finish = *c.FinishReason
			}
		}
		if text == "" {
			count.usage(ev.Usage)
			continue
		}
		if limit > 0 && count.generated >= limit {
			// Text past the limit: the upstream reads neither name it
			// was sent under. Acting here rather than at the last token
			// the limit allows lets an upstream that keeps it end its
			// answer itself, with its own reason and usage, unaborted.
			cancelUp()
			finish = "length"
			break
		}
		last = time.Now()
		if first.IsZero() {
			first = last
		}
		stats := e.gauges()
		count.delta(ev.Usage, stats)
		if err := emit(&stagepb.GenerateChunk{Text: text, Stats: stats}); err != nil {
			return err
		}
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if finish == "" {
		if !done && count.deltas == 0 {
			return status.Errorf(codes.Unavailable, "openai: upstream stream ended without text, a finish reason or [DONE]")
		}
		// The upstream ended the stream itself, with [DONE] and a null
		// reason or, after text, by ending the response (Ollama, when it
		// stops a generation that repeats itself): the answer ended as
		// the upstream chose, which is a stop.
		finish = "stop"
	}
	end := time.Now()
	if first.IsZero() {
		first, last = end, end
	}
	untrack() // the final chunk's load no longer holds this request
	stats := e.gauges()
	count.final(stats)
	e.takeCounters(stats)
	return emit(&stagepb.GenerateChunk{
		FinishReason: finishReason(finish),
		Stats:        stats,
		Timings: &stagepb.Timings{
			PrefillSeconds: first.Sub(start).Seconds(),
			DecodeSeconds:  last.Sub(first).Seconds(),
		},
	})
}

// tokenCounter gives each text chunk the number of tokens it holds, so
// that the head's counts (metrics, usage, what is left of max_tokens after
// a migration) are right at every chunk, also when the answer is cut:
//
//   - an upstream that reports usage on every chunk (vLLM and SGLang with
//     continuous_usage_stats; the usage is cumulative) gives the exact
//     count: a chunk holds what its usage adds to the one before, and the
//     first text chunk carries the prompt tokens;
//   - otherwise a chunk of text counts as one token (Ollama, llama.cpp and
//     OpenAI stream one token per delta);
//
// and the upstream's final usage is authoritative: the final chunk carries
// what it adds to the counts already sent (prompt tokens included). An
// upstream that reports no usage at all counts one token per delta and no
// prompt tokens.
//
// Usage is believed only while it is consistent: a chunk's usage must add
// at least one token to the count sent so far (Ollama puts zeros on every
// /v1/completions chunk), or the stream is counted one token per delta
// from that chunk on; and the final usage must count at least the tokens
// sent, or it is ignored.
type tokenCounter struct {
	generated, prompt uint64 // sent so far
	deltas            int    // text chunks
	perDelta          bool   // a chunk's usage contradicted its text
	// use is the latest usage that may be the final count: one that came
	// after the last text chunk, or that chunk's own when it was believed.
	use *usage
}

// usage notes a usage report that came without text (the final one).
func (t *tokenCounter) usage(u *usage) {
	if u != nil {
		t.use = u
	}
}

// delta counts a text chunk into s.
func (t *tokenCounter) delta(u *usage, s *stagepb.EngineStats) {
	t.deltas++
	t.use = nil
	n := uint64(1)
	switch {
	case u == nil:
	case !t.perDelta && u.CompletionTokens > t.generated:
		t.use = u
		n = u.CompletionTokens - t.generated
		t.promptInto(u, s)
	default:
		t.perDelta = true
	}
	t.generated += n
	s.GenerationTokens = n
}

// final puts on the final chunk what the last usage adds to the counts
// sent before, when that usage is consistent with them.
func (t *tokenCounter) final(s *stagepb.EngineStats) {
	u := t.use
	if u == nil || u.CompletionTokens < t.generated {
		return
	}
	s.GenerationTokens = u.CompletionTokens - t.generated
	t.generated = u.CompletionTokens
	t.promptInto(u, s)
}

// promptInto adds u's prompt tokens to s the first time usage has them.
func (t *tokenCounter) promptInto(u *usage, s *stagepb.EngineStats) {
	if t.prompt > 0 || u.PromptTokens == 0 {
		return
	}
	t.prompt = u.PromptTokens
	cached := uint64(0)
	if u.PromptTokensDetails != nil {
		cached = min(u.PromptTokensDetails.CachedTokens, u.PromptTokens)
		s.PromptAudioTokens, s.PromptImageTokens = u.PromptTokensDetails.AudioTokens, u.PromptTokensDetails.ImageTokens
	}
	s.PromptTokens = u.PromptTokens
	s.PromptTokensLocalCacheHit = cached
	s.PromptTokensLocalCompute = u.PromptTokens - cached
}

// finishReason maps the upstream's finish_reason. stop and length are
// kept exactly; abort (vLLM) is an abort; any other reason (tool_calls,
// content_filter, ...) ended the answer normally and is stop.
func finishReason(s string) stagepb.FinishReason {
	switch s {
	case "length":
		return stagepb.FinishReason_FINISH_REASON_LENGTH
	case "abort":
		return stagepb.FinishReason_FINISH_REASON_ABORT
	}
	return stagepb.FinishReason_FINISH_REASON_STOP
}
