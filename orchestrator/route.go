package orchestrator

import (
	"strings"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// routeOf is what a policy sees of a stage attempt's input: its text, a
// chat rendered as the engine reads it (so the head names the engine's
// cached blocks), or its token ids. An input of codes has no routing key.
func routeOf(in *stagepb.GenerateRequest, sessionKey string) *router.Request {
	r := &router.Request{SessionKey: sessionKey}
	switch x := in.GetInput().(type) {
	case *stagepb.GenerateRequest_Text:
		r.Text = x.Text
	case *stagepb.GenerateRequest_Chat:
		r.Text = chatRendering(x.Chat.GetMessages())
	case *stagepb.GenerateRequest_TokenIds:
		r.Tokens = x.TokenIds.GetIds()
	}
	return r
}

// chatRendering is a conversation as an engine without a chat template
// reads it (stagepb.Chat): one "role: content" line per message, joined by
// "\n". It must give the same bytes as the sim's sim.ChatPrompt, which the
// sim tokenizes (a test holds them equal); the head does not import the
// engine.
func chatRendering(msgs []*stagepb.ChatMessage) string {
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
		b.WriteString(m.GetContent())
	}
	return b.String()
}
