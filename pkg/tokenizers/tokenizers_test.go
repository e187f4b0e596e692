package tokenizers_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/pkg/tokenizers"
)

func TestSim(t *testing.T) {
	assert.Equal(t, []uint32{tokenizers.SimBOS}, tokenizers.Sim(""))
	assert.Equal(t, []uint32{tokenizers.SimBOS, tokenizers.SimWordID("hello"), tokenizers.SimWordID("world")}, tokenizers.Sim("  hello\tworld\n"))
	assert.NotEqual(t, tokenizers.SimWordID("hello"), tokenizers.SimWordID("world"))
	// Pinned: the head and every sim worker must agree on these ids.
	assert.Equal(t, []uint32{1, 0x2bd3, 0x2b7f}, tokenizers.Sim("hello world"))
}

func TestByEngine(t *testing.T) {
	f, ok := tokenizers.ByEngine(tokenizers.SimEngine)
	require.True(t, ok)
	assert.Equal(t, tokenizers.Sim("a b c"), f("a b c"))
	_, ok = tokenizers.ByEngine("vllm")
	assert.False(t, ok)

	all := tokenizers.All()
	require.Len(t, all, 1)
	delete(all, tokenizers.SimEngine) // the caller's copy
	_, ok = tokenizers.ByEngine(tokenizers.SimEngine)
	assert.True(t, ok, "All returns a copy")
}
