package tokenizers_test

import (
	"bytes"
	"fmt"
	"hash/fnv"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/tokenizers"
)

func TestSim(t *testing.T) {
	assert.Equal(t, []uint32{tokenizers.SimBOS}, tokenizers.Sim(""))
	assert.Equal(t, []uint32{tokenizers.SimBOS, tokenizers.SimWordID("hello"), tokenizers.SimWordID("world")}, tokenizers.Sim("  hello\tworld\n"))
	assert.NotEqual(t, tokenizers.SimWordID("hello"), tokenizers.SimWordID("world"))
	// Pinned: the head and every sim worker must agree on these ids.
	assert.Equal(t, []uint32{1, 0x2bd3, 0x2b7f}, tokenizers.Sim("hello world"))
}

// simReference is Sim as first written, over strings.Fields and
// hash/fnv: the tokenizer every sim worker and head must keep agreeing
// with.
func simReference(text string) []uint32 {
	ids := []uint32{tokenizers.SimBOS}
	for _, w := range strings.Fields(text) {
		h := fnv.New32a()
		h.Write([]byte(w))
		ids = append(ids, 2+h.Sum32()%(tokenizers.SimVocabSize-2))
	}
	return ids
}

// FuzzSimMatchesReference checks the allocation-light Sim against the
// reference on any text: Unicode spaces, invalid UTF-8, empty words.
func FuzzSimMatchesReference(f *testing.F) {
	for _, s := range []string{"", " ", "hello world", "a\u00a0b\u2003c", "\xff\xfe x", "tab\tnew\nline\r\v\f", "  lead and trail  "} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, text string) {
		if got, want := tokenizers.Sim(text), simReference(text); !slices.Equal(got, want) {
			t.Fatalf("Sim(%q) = %v, reference %v", text, got, want)
		}
	})
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

// ChatText is one "role: content" line per message, the contents as they
// are (newlines and spaces kept), so a conversation's text is a prefix of
// the text of any conversation that continues it.
func TestChatText(t *testing.T) {
	short := []*stagepb.ChatMessage{{Role: "system", Content: "be brief\nand kind"}, {Role: "user", Content: ""}}
	long := append(slices.Clone(short), &stagepb.ChatMessage{Role: "assistant", Content: "ok  fine"}, &stagepb.ChatMessage{Role: "user", Content: "é"})
	assert.Equal(t, "", tokenizers.ChatText(nil))
	assert.Equal(t, "system: be brief\nand kind\nuser: ", tokenizers.ChatText(short))
	assert.Equal(t, "system: be brief\nand kind\nuser: \nassistant: ok  fine\nuser: é", tokenizers.ChatText(long))
	assert.True(t, strings.HasPrefix(tokenizers.ChatText(long), tokenizers.ChatText(short)))
}

// A message with media reads as its parts: each media part as MediaTokens
// words named by the hash of its bytes (or URL), so equal bytes give the
// same text and Sim makes MediaTokens tokens of it.
func TestChatTextMedia(t *testing.T) {
	img := bytes.Repeat([]byte{7}, 2*tokenizers.MediaBytesPerToken+1)
	msgs := func(p *stagepb.ContentPart) []*stagepb.ChatMessage {
		return []*stagepb.ChatMessage{{Role: "system", Content: "be brief"}, {Role: "user", Content: "what is this", Parts: []*stagepb.ContentPart{
			{Kind: stagepb.PartText, Text: "what is"}, p, {Kind: stagepb.PartText, Text: "this"}}}}
	}
	a := tokenizers.ChatText(msgs(&stagepb.ContentPart{Kind: stagepb.PartImage, Data: img}))
	h := fmt.Sprintf("%016x", tokenizers.MediaHash(&stagepb.ContentPart{Data: img}))
	assert.Equal(t, "system: be brief\nuser: what is <image:"+h+"> <image:"+h+":1> <image:"+h+":2> this", a)
	assert.Equal(t, a, tokenizers.ChatText(msgs(&stagepb.ContentPart{Kind: stagepb.PartImage, Data: bytes.Clone(img)})))
	assert.Len(t, tokenizers.Sim(a), 1+3+3+tokenizers.MediaTokens(img)+1, "BOS, the system line, user: what is, the image, this")

	other := bytes.Clone(img)
	other[0] = 8
	assert.NotEqual(t, a, tokenizers.ChatText(msgs(&stagepb.ContentPart{Kind: stagepb.PartImage, Data: other})))
	byURL := tokenizers.ChatText(msgs(&stagepb.ContentPart{Kind: stagepb.PartAudio, Url: "https://example.com/a.wav"}))
	assert.Equal(t, 1, strings.Count(byURL, "<audio:"), "a part by URL is one word")
	assert.Equal(t, tokenizers.MediaText(&stagepb.ContentPart{Kind: stagepb.PartImage, Data: img}), "<image:"+h+"> <image:"+h+":1> <image:"+h+":2>")
}
