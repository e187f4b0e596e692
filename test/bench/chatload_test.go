package bench

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestChatWorkloadShape(t *testing.T) {
	cfg := ChatConfig{Seed: 7, SystemPrompts: 2, SystemWords: 20, Conversations: 3, MinTurns: 2, MaxTurns: 3, UserWords: 5}
	w := NewChatWorkload(cfg)
	again := NewChatWorkload(cfg)

	last := map[string]string{}
	turns := map[string]int{}
	systems := map[string]bool{}
	for i := range 40 {
		turn, ok := w.Next()
		require.True(t, ok)
		twin, _ := again.Next()
		assert.Equal(t, turn.Prompt, twin.Prompt, "deterministic for a seed")
		lines := make([]string, len(turn.Messages))
		for i, m := range turn.Messages {
			lines[i] = m.Role + ": " + m.Content
		}
		assert.Equal(t, turn.Prompt, strings.Join(lines, "\n"), "the messages render as the prompt")

		require.True(t, strings.HasPrefix(turn.Prompt, "system: "))
		systems[strings.SplitN(turn.Prompt, "\n", 2)[0]] = true
		if prev, ok := last[turn.Session]; ok {
			assert.True(t, strings.HasPrefix(turn.Prompt, prev+"\nassistant: answer "), "a turn extends the conversation so far")
		}
		assert.Len(t, strings.Fields(turn.Prompt[strings.LastIndex(turn.Prompt, "\nuser: ")+len("\nuser: "):]), cfg.UserWords)
		turns[turn.Session]++
		assert.LessOrEqual(t, turns[turn.Session], cfg.MaxTurns, "a user leaves after their turns")
		last[turn.Session] = turn.Prompt
		answer := "answer " + string(rune('a'+i%26))
		w.Reply(turn, answer)
		again.Reply(twin, answer)
	}
	assert.Greater(t, len(turns), cfg.Conversations, "users who are done are replaced")
	assert.Len(t, systems, cfg.SystemPrompts, "users share the few system prompts")

	// Every conversation waiting for its answer: nothing to send.
	for range cfg.Conversations {
		_, ok := w.Next()
		require.True(t, ok)
	}
	_, ok := w.Next()
	assert.False(t, ok)
}

func TestChatWorkloadHotShare(t *testing.T) {
	w := NewChatWorkload(ChatConfig{Seed: 3, SystemPrompts: 3, SystemWords: 4, Conversations: 400, MinTurns: 1, MaxTurns: 1, UserWords: 1, HotShare: 0.5})
	bySystem := map[int]int{}
	for range 400 {
		turn, ok := w.Next()
		require.True(t, ok)
		bySystem[turn.System]++
	}
	assert.InDelta(t, 200, bySystem[0], 40, "about half the conversations start with the hot prefix")
	assert.InDelta(t, 100, bySystem[1], 35)
	assert.InDelta(t, 100, bySystem[2], 35)
}
