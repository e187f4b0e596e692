package orchestrator

import (
	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/tokenizers"
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
		r.Text = tokenizers.ChatText(x.Chat.GetMessages())
	case *stagepb.GenerateRequest_TokenIds:
		r.Tokens = x.TokenIds.GetIds()
	}
	return r
}
