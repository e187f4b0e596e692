package openai

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

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
// availability and its scraped load.
func (e *Engine) Health() *stagepb.HealthResponse {
	h := e.health(EngineName, stagepb.RoleText)
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
	MaxTokens     uint32         `json:"max_tokens,omitempty"`
	Temperature   *float32       `json:"temperature,omitempty"`
	Seed          *int64         `json:"seed,omitempty"`
	Stop          []string       `json:"stop,omitempty"`
	IgnoreEOS     bool           `json:"ignore_eos,omitempty"` // vLLM, SGLang, llama.cpp; sent only when true
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
	body = chatRequest{
		Model:         e.Model(),
		Stream:        true,
		StreamOptions: &streamOptions{IncludeUsage: true},
		MaxTokens:     sp.GetMaxTokens(),
		Stop:          sp.GetStop(),
		IgnoreEOS:     sp.GetIgnoreEos(),
	}
	if sp != nil {
		body.Temperature, body.Seed = sp.Temperature, sp.Seed
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
// one chunk, as the upstream sent it; the final chunk carries the finish
// reason, the upstream's usage (prompt and completion tokens; 0 when it
// reports none), and timings measured here (prefill: until the first
// delta; decode: from the first delta to the last). Token ids are not
// sent. Cancelling ctx aborts the upstream HTTP request. A stream that
// ends before a finish reason is an Unavailable error, never a short
// success.
func (e *Engine) Generate(ctx context.Context, req *stagepb.GenerateRequest, emit func(*stagepb.GenerateChunk) error) error {
	if err := e.admit(); err != nil {
		return err
	}
	path, body, err := e.body(req)
	if err != nil {
		return err
	}
	start := time.Now()
	resp, err := e.postJSON(ctx, path, body)
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
		use         *usage
		deltas      int
	)
	events := newSSEReader(resp.Body)
	for {
		data, err := events.next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return status.Errorf(codes.Unavailable, "openai: upstream stream broken after %d deltas: %v", deltas, err)
		}
		if string(data) == "[DONE]" {
			break
		}
		var ev streamEvent
		if err := json.Unmarshal(data, &ev); err != nil {
			return status.Errorf(codes.Internal, "openai: malformed stream event %.200q: %v", data, err)
		}
		if len(ev.Error) > 0 || ev.Object == "error" {
			return status.Errorf(codes.Unavailable, "openai: upstream failed mid-stream after %d deltas: %s", deltas, errorMessage(data))
		}
		if ev.Usage != nil {
			use = ev.Usage
		}
		for _, c := range ev.Choices {
			text := c.Text
			if c.Delta.Content != nil {
				text = c.Delta.Content
			}
			if text != nil && *text != "" {
				last = time.Now()
				if first.IsZero() {
					first = last
				}
				deltas++
				if err := emit(&stagepb.GenerateChunk{Text: *text, Stats: e.gauges()}); err != nil {
					return err
				}
			}
			if c.FinishReason != nil && *c.FinishReason != "" {
				finish = *c.FinishReason
			}
		}
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if finish == "" {
		return status.Errorf(codes.Unavailable, "openai: upstream stream ended after %d deltas without a finish reason", deltas)
	}
	end := time.Now()
	if first.IsZero() {
		first, last = end, end
	}
	stats := e.gauges()
	if use != nil {
		stats.PromptTokens = use.PromptTokens
		stats.GenerationTokens = use.CompletionTokens
		cached := uint64(0)
		if use.PromptTokensDetails != nil {
			cached = min(use.PromptTokensDetails.CachedTokens, use.PromptTokens)
			stats.PromptAudioTokens, stats.PromptImageTokens = use.PromptTokensDetails.AudioTokens, use.PromptTokensDetails.ImageTokens
		}
		stats.PromptTokensLocalCacheHit = cached
		stats.PromptTokensLocalCompute = use.PromptTokens - cached
	}
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

// sseReader reads the data of server-sent events.
type sseReader struct {
	sc   *bufio.Scanner
	data bytes.Buffer
}

// maxEventBytes bounds one SSE line.
const maxEventBytes = 8 << 20

func newSSEReader(r io.Reader) *sseReader {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), maxEventBytes)
	return &sseReader{sc: sc}
}

// next returns the data of the next event (its data lines joined by
// "\n"). Comments and other fields are skipped. At the end of the stream
// an unterminated event is still returned; then io.EOF. Transport errors
// (a connection cut mid-stream) are returned as they are.
func (r *sseReader) next() ([]byte, error) {
	r.data.Reset()
	has := false
	for r.sc.Scan() {
		line := r.sc.Bytes()
		switch {
		case len(line) == 0:
			if has {
				return r.data.Bytes(), nil
			}
		case line[0] == ':':
		case bytes.HasPrefix(line, []byte("data:")):
			v := bytes.TrimPrefix(line[5:], []byte(" "))
			if has {
				r.data.WriteByte('\n')
			}
			r.data.Write(v)
			has = true
		}
	}
	if err := r.sc.Err(); err != nil {
		return nil, err
	}
	if has {
		return r.data.Bytes(), nil
	}
	return nil, io.EOF
}
