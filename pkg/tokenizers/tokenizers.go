// Package tokenizers holds the engines' tokenizers the head can run itself,
// by engine name as Health reports it, so prefix_aware names an engine's
// prompt blocks as the engine does (docs/routing.md). Today that is the
// sim's deterministic word tokenizer, which the sim engine (worker/sim)
// takes from here too, and the one rendering of a conversation as text
// (ChatText) that the sim reads and the head routes on. It is a bottom
// layer: it imports only pkg/stagepb.
package tokenizers

import (
	"fmt"
	"hash/fnv"
	"maps"
	"strconv"
	"strings"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// ChatText is a conversation as an engine without a chat template reads it
// (the sim does): one "role: content" line per message, joined by "\n". A
// message with a media part reads as its parts in order, joined by " ":
// a text part its text, a media part MediaTokens words named by its
// MediaHash, so the head routes a repeated image or audio clip as a
// repeated prefix. The head routes a chat request on it, so its blocks are
// the ones the sim caches; a chat input and the text input
// ChatText(messages) give the same output.
func ChatText(msgs []*stagepb.ChatMessage) string {
	n := 0
	for _, m := range msgs {
		n += len(m.GetRole()) + len(m.GetContent()) + 3
	}
	var b strings.Builder
	b.Grow(n)
	for i, m := range msgs {
		if i > 0 {
			b.WriteByte('\n')
		}
		b.WriteString(m.GetRole())
		b.WriteString(": ")
		if !hasMedia(m) {
			b.WriteString(m.GetContent())
			continue
		}
		for k, p := range m.GetParts() {
			if k > 0 {
				b.WriteByte(' ')
			}
			if p.GetKind() == stagepb.PartText {
				b.WriteString(p.GetText())
				continue
			}
			writeMediaWords(&b, p)
		}
	}
	return b.String()
}

// hasMedia reports whether m has a part other than text.
func hasMedia(m *stagepb.ChatMessage) bool {
	for _, p := range m.GetParts() {
		if p.GetKind() != stagepb.PartText {
			return true
		}
	}
	return false
}

// MediaBytesPerToken sizes media tokens: a media part with bytes
// (ContentPart.data) is MediaTokens(data) prompt tokens.
const MediaBytesPerToken = 1024

// MediaTokens is how many prompt tokens a media part of data's bytes
// becomes: 1 + len(data)/MediaBytesPerToken. A part by URL (no bytes) is 1.
func MediaTokens(data []byte) int { return 1 + len(data)/MediaBytesPerToken }

// MediaHash names a media part by its content: the FNV-1a hash of its
// bytes, or of its URL when it has none. Equal bytes, equal hash: the sim's
// encoder cache and the routing key both use it.
func MediaHash(p *stagepb.ContentPart) uint64 {
	h := fnv.New64a()
	if len(p.GetData()) > 0 {
		h.Write(p.GetData())
	} else {
		h.Write([]byte(p.GetUrl()))
	}
	return h.Sum64()
}

// MediaText is a media part as ChatText writes it: its MediaTokens words.
func MediaText(p *stagepb.ContentPart) string {
	var b strings.Builder
	writeMediaWords(&b, p)
	return b.String()
}

// writeMediaWords writes a media part as MediaTokens words, each one token
// of the sim: "<kind:hash>" then "<kind:hash:j>" for j = 1..n-1, hash being
// MediaHash in 16 hex digits.
func writeMediaWords(b *strings.Builder, p *stagepb.ContentPart) {
	head := fmt.Sprintf("<%s:%016x", p.GetKind(), MediaHash(p))
	b.WriteString(head)
	b.WriteByte('>')
	for j := 1; j < MediaTokens(p.GetData()); j++ {
		b.WriteByte(' ')
		b.WriteString(head)
		b.WriteByte(':')
		b.WriteString(strconv.Itoa(j))
		b.WriteByte('>')
	}
}

// SimEngine is the sim engine's name, as its Health reports it.
const SimEngine = "sim"

// The sim tokenizer's ids.
const (
	SimBOS       uint32 = 1     // prepended to every tokenized text
	SimVocabSize uint32 = 32000 // token ids are in [0, SimVocabSize)
)

// Sim is the sim's tokenizer: SimBOS, then one token per
// whitespace-separated word (SimWordID). The empty text is [SimBOS].
func Sim(text string) []uint32 {
	// A word is about six bytes: one allocation for most texts, and no
	// slice of words (the head tokenizes on every prefix_aware pick).
	ids := make([]uint32, 0, len(text)/6+2)
	ids = append(ids, SimBOS)
	for w := range strings.FieldsSeq(text) {
		ids = append(ids, SimWordID(w))
	}
	return ids
}

// SimWordID is the sim's token id of one word: a hash of its bytes (FNV-1a,
// 32 bits), in (SimBOS, SimVocabSize).
func SimWordID(word string) uint32 {
	h := uint32(fnvOffset32)
	for i := range len(word) {
		h ^= uint32(word[i])
		h *= fnvPrime32
	}
	return 2 + h%(SimVocabSize-2)
}

// FNV-1a's 32-bit constants (hash/fnv), inline so that a word is hashed
// without a hash.Hash32 and a copy of its bytes.
const (
	fnvOffset32 = 2166136261
	fnvPrime32  = 16777619
)

// byEngine is every tokenizer by engine name. It is fixed: nothing
// registers at run time, so what the head runs is known from the code.
var byEngine = map[string]func(text string) []uint32{
	SimEngine: Sim,
}

// ByEngine returns the tokenizer of the named engine; ok is false for an
// engine whose tokenizer troupe does not have.
func ByEngine(engine string) (tokenize func(text string) []uint32, ok bool) {
	tokenize, ok = byEngine[engine]
	return tokenize, ok
}

// All returns every tokenizer by engine name, in a new map the caller owns
// (orchestrator.Config.Tokenizers takes it).
func All() map[string]func(text string) []uint32 { return maps.Clone(byEngine) }
