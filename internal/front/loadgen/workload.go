// Package loadgen is the engine of `troupe bench`: it sends chat completions
// to an OpenAI-compatible server (a troupe head, or any server for the text
// workloads) in open loop (Poisson or constant arrivals at a rate, or a
// replayed trace) or closed loop (a fixed concurrency), measures what a
// client sees of each answer (time to first token, inter-token latency,
// time to first audio, real-time factor and underruns of the audio, end to
// end) and summarises a run (percentiles, throughput, goodput under SLOs,
// shed and failed shares).
//
// It talks HTTP only and imports nothing of troupe's core, so it measures
// troupe exactly as any other client would.
package loadgen

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"strings"
	"sync"
	"time"
)

// Workloads are the built-in request shapes.
const (
	// WorkloadChat is a single-turn text chat, answered whole (TTFT is then
	// the time to the whole answer).
	WorkloadChat = "chat"
	// WorkloadStream is a single-turn text chat, streamed.
	WorkloadStream = "stream"
	// WorkloadAudio is a single-turn chat answered with text and streamed
	// audio: modalities text and audio, audio format pcm16.
	WorkloadAudio = "audio"
	// WorkloadMultiTurn is streamed text chat in conversations that start
	// with one of a few shared system prompts, each turn's messages being
	// the whole conversation so far.
	WorkloadMultiTurn = "multiturn"
)

// Workloads lists the built-in workloads.
var Workloads = []string{WorkloadChat, WorkloadStream, WorkloadAudio, WorkloadMultiTurn}

// Message is one chat message.
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// Request is one request to send. In a trace (JSONL, one Request a line)
// at_ms is its arrival time from the start of the run, and either prompt
// (one user message) or messages is set; stream defaults to true.
type Request struct {
	AtMS       float64   `json:"at_ms"`
	Prompt     string    `json:"prompt,omitempty"`
	Messages   []Message `json:"messages,omitempty"`
	MaxTokens  int       `json:"max_tokens,omitempty"`
	Modalities []string  `json:"modalities,omitempty"`
	Stream     *bool     `json:"stream,omitempty"`
	// Session is sent as the OpenAI user field (a troupe head may route on
	// it with --session-user).
	Session string `json:"session,omitempty"`

	// conv is the multi-turn conversation the request is a turn of.
	conv *conversation
}

func (r Request) streamed() bool { return r.Stream == nil || *r.Stream }

func (r Request) audio() bool {
	for _, m := range r.Modalities {
		if m == "audio" {
			return true
		}
	}
	return false
}

// ReadTrace reads a JSONL trace: one Request a line, blank lines skipped.
// Requests are returned in the order of their arrival times.
func ReadTrace(r io.Reader) ([]Request, error) {
	var out []Request
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 64*1024*1024)
	line := 0
	for sc.Scan() {
		line++
		text := strings.TrimSpace(sc.Text())
		if text == "" {
			continue
		}
		var req Request
		if err := json.Unmarshal([]byte(text), &req); err != nil {
			return nil, fmt.Errorf("loadgen: trace line %d: %w", line, err)
		}
		if req.Prompt == "" && len(req.Messages) == 0 {
			return nil, fmt.Errorf("loadgen: trace line %d: neither prompt nor messages", line)
		}
		if req.AtMS < 0 {
			return nil, fmt.Errorf("loadgen: trace line %d: at_ms %v is negative", line, req.AtMS)
		}
		out = append(out, req)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("loadgen: reading the trace: %w", err)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("loadgen: the trace holds no request")
	}
	for i := 1; i < len(out); i++ {
		if out[i].AtMS < out[i-1].AtMS {
			return nil, fmt.Errorf("loadgen: trace line order: request %d arrives before the one before it", i+1)
		}
	}
	return out, nil
}

// generator makes the requests of a built-in workload. It is deterministic
// for a seed given the same order of calls, and safe for concurrent use.
type generator struct {
	workload    string
	maxTokens   int
	promptWords int
	turns       int

	mu      sync.Mutex
	rng     *rand.Rand
	systems []string
	idle    []*conversation // multi-turn conversations waiting for their user
	nextID  int
}

type conversation struct {
	id   string
	msgs []Message
	left int // turns still to send
}

func newGenerator(cfg Config) *generator {
	g := &generator{
		workload: cfg.Workload, maxTokens: cfg.MaxTokens, promptWords: cfg.PromptWords, turns: cfg.Turns,
		rng: rand.New(rand.NewPCG(cfg.Seed, 0x62656e6368)),
	}
	for range cfg.SystemPrompts {
		g.systems = append(g.systems, g.words(cfg.SystemWords))
	}
	return g
}

func (g *generator) words(n int) string {
	ws := make([]string, n)
	for i := range ws {
		ws[i] = fmt.Sprint("w", g.rng.IntN(8000))
	}
	return strings.Join(ws, " ")
}

// next is the workload's next request.
func (g *generator) next() Request {
	g.mu.Lock()
	defer g.mu.Unlock()
	stream := g.workload != WorkloadChat
	req := Request{MaxTokens: g.maxTokens, Stream: &stream}
	switch g.workload {
	case WorkloadAudio:
		req.Modalities = []string{"text", "audio"}
	case WorkloadMultiTurn:
		var c *conversation
		if n := len(g.idle); n > 0 {
			i := g.rng.IntN(n)
			c = g.idle[i]
			g.idle = append(g.idle[:i], g.idle[i+1:]...)
		} else {
			c = &conversation{id: fmt.Sprint("conv-", g.nextID), left: g.turns}
			g.nextID++
			c.msgs = []Message{{Role: "system", Content: g.systems[g.rng.IntN(len(g.systems))]}}
		}
		c.left--
		c.msgs = append(c.msgs, Message{Role: "user", Content: g.words(g.promptWords)})
		req.Messages = append([]Message(nil), c.msgs...)
		req.Session = c.id
		req.conv = c
		return req
	}
	req.Messages = []Message{{Role: "user", Content: g.words(g.promptWords)}}
	return req
}

// reply records a multi-turn answer: the conversation waits for its next
// turn, unless it has sent them all or the turn failed (then it ends).
func (g *generator) reply(req Request, answer string, ok bool) {
	c := req.conv
	if c == nil {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if !ok || c.left <= 0 {
		return
	}
	c.msgs = append(c.msgs, Message{Role: "assistant", Content: answer})
	g.idle = append(g.idle, c)
}

// arrivals returns the gaps between arrivals at rate per second: Poisson
// (exponential gaps) or constant.
func arrivals(rate float64, poisson bool, rng *rand.Rand) func() time.Duration {
	mean := float64(time.Second) / rate
	if !poisson {
		return func() time.Duration { return time.Duration(mean) }
	}
	return func() time.Duration { return time.Duration(rng.ExpFloat64() * mean) }
}
