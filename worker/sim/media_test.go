package sim

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/tokenizers"
)

// TestChatTokensTextOnly: a conversation without media parts is read as
// before, the words of tokenizers.ChatText; one whose parts are all text gives the
// same tokens as its joined content.
func TestChatTokensTextOnly(t *testing.T) {
	msgs := []*stagepb.ChatMessage{{Role: "system", Content: "be brief"}, {Role: "user", Content: "hello\nworld"}}
	ids, err := chatTokens(msgs)
	require.NoError(t, err)
	assert.Equal(t, tokenizers.Sim(tokenizers.ChatText(msgs)), ids)
	withParts := []*stagepb.ChatMessage{msgs[0], {Role: "user", Content: "hello\nworld", Parts: []*stagepb.ContentPart{
		{Kind: stagepb.PartText, Text: "hello"}, {Kind: stagepb.PartText, Text: "world"}}}}
	got, err := chatTokens(withParts)
	require.NoError(t, err)
	assert.Equal(t, ids, got)
}

// TestChatTokensMedia: a media part becomes MediaTokens of its bytes, in
// its place; equal bytes give equal tokens, other bytes others; a URL part
// is refused.
func TestChatTokensMedia(t *testing.T) {
	img := bytes.Repeat([]byte{7}, 3*tokenizers.MediaBytesPerToken+5)
	msgs := func(data []byte) []*stagepb.ChatMessage {
		return []*stagepb.ChatMessage{{Role: "user", Content: "what is this", Parts: []*stagepb.ContentPart{
			{Kind: stagepb.PartText, Text: "what is"}, {Kind: stagepb.PartImage, Data: data}, {Kind: stagepb.PartText, Text: "this"}}}}
	}
	a, err := chatTokens(msgs(img))
	require.NoError(t, err)
	assert.Equal(t, 4, tokenizers.MediaTokens(img))
	assert.Len(t, a, 1+1+2+4+1, "BOS, role, two words, the image's 4 tokens, one word")
	b, err := chatTokens(msgs(bytes.Clone(img)))
	require.NoError(t, err)
	assert.Equal(t, a, b, "deterministic: equal bytes, equal tokens")
	other := bytes.Clone(img)
	other[0] = 8
	c, err := chatTokens(msgs(other))
	require.NoError(t, err)
	assert.NotEqual(t, a[4:8], c[4:8], "other bytes, other tokens")
	assert.Equal(t, a[:4], c[:4])
	assert.Equal(t, tokenizers.Sim(tokenizers.ChatText(msgs(img))), a, "the head's tokenization of the routing text is the sim's")

	_, err = chatTokens([]*stagepb.ChatMessage{{Role: "user", Parts: []*stagepb.ContentPart{{Kind: stagepb.PartImage, Url: "https://example.com/a.png"}}}})
	assert.Equal(t, codes.InvalidArgument, status.Code(err))
}

// TestGenerateCountsMediaTokens: the prompt tokens of a chat with audio
// and an image include theirs, reported by kind; Health lists the kinds.
func TestGenerateCountsMediaTokens(t *testing.T) {
	e := newEngine(t, Config{})
	assert.ElementsMatch(t, []string{"image", "audio", "video"}, e.Health().GetInputParts())
	assert.False(t, e.Health().GetInputPartUrls())
	audio := bytes.Repeat([]byte{1, 2}, 2*tokenizers.MediaBytesPerToken)
	req := &stagepb.GenerateRequest{RequestId: "m", Sampling: &stagepb.SamplingParams{MaxTokens: 4},
		Input: &stagepb.GenerateRequest_Chat{Chat: &stagepb.Chat{Messages: []*stagepb.ChatMessage{{Role: "user", Parts: []*stagepb.ContentPart{
			{Kind: stagepb.PartAudio, Data: audio, Format: "wav"}, {Kind: stagepb.PartImage, Data: []byte("png")}}}}}}}
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	chunks, err := generate(ctx, e, req)
	require.NoError(t, err)
	st := sums(chunks)
	assert.Equal(t, uint64(5), st.PromptAudioTokens)
	assert.Equal(t, uint64(1), st.PromptImageTokens)
	assert.Equal(t, uint64(1+1+5+1), st.PromptTokens, "BOS, role, audio, image")
	assert.Zero(t, st.PromptVideoTokens)
}

// TestEncoderCache: each media part of a request is one query of the
// encoder cache, a hit when its bytes were encoded and not evicted since
// (least recently used first); a miss costs EncodeTimePerKiB per KiB.
func TestEncoderCache(t *testing.T) {
	e := newEngine(t, Config{EncoderCacheEntries: 2, EncodeTimePerKiB: time.Millisecond})
	img := func(b byte) []byte { return bytes.Repeat([]byte{b}, tokenizers.MediaBytesPerToken) }
	ask := func(images ...[]byte) *stagepb.EngineStats {
		parts := []*stagepb.ContentPart{{Kind: stagepb.PartText, Text: "compare"}}
		for _, data := range images {
			parts = append(parts, &stagepb.ContentPart{Kind: stagepb.PartImage, Data: data})
		}
		req := &stagepb.GenerateRequest{RequestId: "m", Sampling: &stagepb.SamplingParams{MaxTokens: 2},
			Input: &stagepb.GenerateRequest_Chat{Chat: &stagepb.Chat{Messages: []*stagepb.ChatMessage{{Role: "user", Parts: parts}}}}}
		ctx, cancel := context.WithTimeout(context.Background(), wait)
		defer cancel()
		chunks, err := generate(ctx, e, req)
		require.NoError(t, err)
		return sums(chunks)
	}
	type qh struct{ queries, hits uint64 }
	got := func(st *stagepb.EngineStats) qh { return qh{st.GetMmCacheQueries(), st.GetMmCacheHits()} }
	assert.Equal(t, qh{2, 1}, got(ask(img(1), img(1))), "the second copy is a hit")
	assert.Equal(t, qh{1, 0}, got(ask(img(2))))
	assert.Equal(t, qh{1, 1}, got(ask(img(1))), "cached: [1 2]")
	assert.Equal(t, qh{1, 0}, got(ask(img(3))), "evicts 2, the least recently used")
	assert.Equal(t, qh{2, 1}, got(ask(img(1), img(2))), "1 kept, 2 evicted")
	snap := e.Snapshot()
	assert.Equal(t, uint64(7), snap.MMCacheQueries)
	assert.Equal(t, uint64(3), snap.MMCacheHits)

	assert.Equal(t, 2*time.Millisecond, e.stepDuration(&batch{encodeBytes: 2 * tokenizers.MediaBytesPerToken}))
	assert.Zero(t, newEngine(t, Config{EncodeTimePerKiB: -1}).stepDuration(&batch{encodeBytes: 1 << 20}), "negative: instant")
	assert.Equal(t, 1024*DefaultEncodeTimePerKiB, newEngine(t, Config{}).stepDuration(&batch{encodeBytes: 1 << 20}), "the default, a MiB")
}
