package sim

import (
	"fmt"
	"slices"

	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/tokenizers"
)

// mediaParts are the media part kinds the sim's text role takes, with
// their bytes only: the sim fetches nothing.
var mediaParts = stagepb.MediaPartKinds[:]

// chatTokens is the sim's prompt of a conversation: tokenizers.Sim of
// tokenizers.ChatText(msgs), the text the head routes on, so the head's
// blocks of a chat with media are the sim's. A media part is
// tokenizers.MediaTokens of its bytes, in its place among its message's
// text parts; the sim takes media parts with their bytes only (it fetches
// nothing).
func chatTokens(msgs []*stagepb.ChatMessage) ([]uint32, error) {
	for i, m := range msgs {
		for k, p := range m.GetParts() {
			if p.GetKind() == stagepb.PartText {
				continue
			}
			if p.GetUrl() != "" || len(p.GetData()) == 0 {
				return nil, invalidArgument(fmt.Sprintf("messages[%d].content[%d]: the sim takes media parts with their bytes, not by URL", i, k))
			}
			if !slices.Contains(mediaParts, p.GetKind()) {
				return nil, invalidArgument(fmt.Sprintf("messages[%d].content[%d]: unknown part kind %q", i, k, p.GetKind()))
			}
		}
	}
	return tokenizers.Sim(tokenizers.ChatText(msgs)), nil
}

// countMediaTokens adds the prompt tokens of msgs' media parts, by kind,
// to st (which chatTokens made of them).
func countMediaTokens(msgs []*stagepb.ChatMessage, st *stagepb.EngineStats) {
	for _, m := range msgs {
		for _, p := range m.GetParts() {
			n := uint64(tokenizers.MediaTokens(p.GetData()))
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
