package bench

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
)

// ChatConfig shapes a ChatWorkload. Sizes are in words, which the sim
// engine counts as tokens.
type ChatConfig struct {
	Seed          uint64
	SystemPrompts int // a few long system prompts, shared by every user
	SystemWords   int
	Conversations int // conversations open at once
	// Each conversation lasts a number of turns drawn from [MinTurns,
	// MaxTurns]; then its user leaves and a new one arrives.
	MinTurns, MaxTurns int
	UserWords          int // words per user message
	// HotShare, when above 0, is the share of conversations that start
	// with system prompt 0 (a hot prefix); the rest pick among the others.
	// 0: every system prompt is equally likely.
	HotShare float64
}

// Message is one message of a conversation.
type Message struct {
	Role, Content string
}

// ChatWorkload is chat traffic in the shape of real chat: many users, each
// holding a multi-turn conversation that starts with one of a few long
// shared system prompts, each turn's prompt being the whole conversation so
// far (as a chat template renders it: one "role: content" line per
// message). It is deterministic for a seed, given the same answers and the
// same order of calls. Safe for concurrent use.
type ChatWorkload struct {
	cfg     ChatConfig
	systems []string

	mu     sync.Mutex
	rng    *rand.Rand
	convs  []*conversation
	nextID int
}

type conversation struct {
	id     string
	system int
	left   int // turns still to send
	prompt strings.Builder
	msgs   []Message
	busy   bool // a turn is in flight
}

// Turn is one request of a conversation.
type Turn struct {
	Session string // the conversation's id: a session key
	System  int    // which system prompt it uses
	Prompt  string
	// Messages is the same conversation as chat messages: Prompt is
	// their "role: content" lines joined by "\n".
	Messages []Message
	conv     *conversation
}

// NewChatWorkload opens cfg.Conversations conversations.
func NewChatWorkload(cfg ChatConfig) *ChatWorkload {
	w := &ChatWorkload{cfg: cfg, rng: rand.New(rand.NewPCG(cfg.Seed, 0x6368617420))}
	for range cfg.SystemPrompts {
		w.systems = append(w.systems, w.words(cfg.SystemWords))
	}
	for range cfg.Conversations {
		w.convs = append(w.convs, w.open())
	}
	return w
}

// words returns n random words (about 5 bytes each).
func (w *ChatWorkload) words(n int) string {
	ws := make([]string, n)
	for i := range ws {
		ws[i] = fmt.Sprint("w", w.rng.IntN(8000))
	}
	return strings.Join(ws, " ")
}

func (w *ChatWorkload) open() *conversation {
	c := &conversation{id: fmt.Sprint("user-", w.nextID)}
	switch {
	case w.cfg.HotShare <= 0 || len(w.systems) == 1:
		c.system = w.rng.IntN(len(w.systems))
	case w.rng.Float64() < w.cfg.HotShare:
		c.system = 0
	default:
		c.system = 1 + w.rng.IntN(len(w.systems)-1)
	}
	c.left = w.cfg.MinTurns + w.rng.IntN(w.cfg.MaxTurns-w.cfg.MinTurns+1)
	w.nextID++
	c.prompt.WriteString("system: " + w.systems[c.system])
	c.msgs = append(c.msgs, Message{"system", w.systems[c.system]})
	return c
}

// Next returns the next turn of a conversation picked at random among those
// waiting for their user (none: every conversation has a turn in flight).
// The conversation is busy until Reply.
func (w *ChatWorkload) Next() (Turn, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	var idle []*conversation
	for _, c := range w.convs {
		if !c.busy {
			idle = append(idle, c)
		}
	}
	if len(idle) == 0 {
		return Turn{}, false
	}
	c := idle[w.rng.IntN(len(idle))]
	c.busy = true
	c.left--
	user := w.words(w.cfg.UserWords)
	c.prompt.WriteString("\nuser: " + user)
	c.msgs = append(c.msgs, Message{"user", user})
	return Turn{Session: c.id, System: c.system, Prompt: c.prompt.String(), Messages: slices.Clone(c.msgs), conv: c}, true
}

// Reply records the assistant's answer to t. A conversation that has sent
// all its turns is replaced by a new user's.
func (w *ChatWorkload) Reply(t Turn, answer string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	c := t.conv
	c.busy = false
	c.prompt.WriteString("\nassistant: " + answer)
	c.msgs = append(c.msgs, Message{"assistant", answer})
	if c.left > 0 {
		return
	}
	for i, x := range w.convs {
		if x == c {
			w.convs[i] = w.open()
		}
	}
}
