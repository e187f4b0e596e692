package sim

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"slices"
	"strings"

	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/tokenizers"
)

// MediaBytesPerToken sizes the sim's media tokens: a media part (image,
// audio or video, ContentPart.data) becomes MediaTokens(data) prompt
// tokens, a marker of its kind then one token per MediaBytesPerToken
// bytes, each drawn from a hash of all its bytes and its position. Equal
// bytes give equal tokens, so the prefix cache and prefix-aware routing
// see a repeated image as a repeated prefix.
const MediaBytesPerToken = 1024

// MediaTokens is how many prompt tokens the sim makes of a media part of
// data's bytes: 1 + len(data)/MediaBytesPerToken.
func MediaTokens(data []byte) int { return 1 + len(data)/MediaBytesPerToken }

// mediaParts are the media part kinds the sim's text role takes, with
// their bytes only: the sim fetches nothing.
var mediaParts = stagepb.MediaPartKinds[:]

// chatTokens is the sim's prompt of a conversation: tokenizers.Sim of
// tokenizers.ChatText(msgs) when it is text only; otherwise the same words, with
// each media part's tokens in its place among its message's text parts.
func chatTokens(msgs []*stagepb.ChatMessage) ([]uint32, error) {
	hasParts := false
	for _, m := range msgs {
		hasParts = hasParts || len(m.GetParts()) > 0
	}
	if !hasParts {
		return tokenizers.Sim(tokenizers.ChatText(msgs)), nil
	}
	ids := []uint32{tokenizers.SimBOS}
	words := func(s string) {
		for _, w := range strings.Fields(s) {
			ids = append(ids, tokenizers.SimWordID(w))
		}
	}
	for i, m := range msgs {
		words(m.GetRole() + ":")
		if len(m.GetParts()) == 0 {
			words(m.GetContent())
			continue
		}
		for k, p := range m.GetParts() {
			if p.GetKind() == stagepb.PartText {
				words(p.GetText())
				continue
			}
			if p.GetUrl() != "" || len(p.GetData()) == 0 {
				return nil, invalidArgument(fmt.Sprintf("messages[%d].content[%d]: the sim takes media parts with their bytes, not by URL", i, k))
			}
			if !slices.Contains(mediaParts, p.GetKind()) {
				return nil, invalidArgument(fmt.Sprintf("messages[%d].content[%d]: unknown part kind %q", i, k, p.GetKind()))
			}
			ids = appendMediaTokens(ids, p.GetKind(), p.GetData(), MediaTokens(p.GetData()))
		}
	}
	return ids, nil
}

// countMediaTokens adds the prompt tokens of msgs' media parts, by kind,
// to st (which chatTokens made of them).
func countMediaTokens(msgs []*stagepb.ChatMessage, st *stagepb.EngineStats) {
	for _, m := range msgs {
		for _, p := range m.GetParts() {
			n := uint64(MediaTokens(p.GetData()))
			switch p.GetKind() {
			case stagepb.PartAudio:
				st.PromptAudioTokens += n
			case stagepb.PartImage:
				st.PromptImageTokens += n
			case stagepb.PartVideo:
				st.PromptVideoTokens += n
			}
		}
	}
}

// appendMediaTokens appends a media part's n tokens: its kind's marker,
// then n-1 tokens from the hash of its bytes and their position.
func appendMediaTokens(ids []uint32, kind string, data []byte, n int) []uint32 {
	ids = append(ids, tokenizers.SimWordID("<"+kind+">"))
	h := fnv.New64a()
	h.Write(data)
	sum := h.Sum64()
	var buf [16]byte
	binary.LittleEndian.PutUint64(buf[:8], sum)
	for j := 1; j < n; j++ {
		binary.LittleEndian.PutUint64(buf[8:], uint64(j))
		th := fnv.New32a()
		th.Write(buf[:])
		ids = append(ids, 2+th.Sum32()%(tokenizers.SimVocabSize-2))
	}
	return ids
}
