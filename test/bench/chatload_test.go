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
