package orchestrator

import (
	"fmt"
	"slices"
	"strings"

	"go.opentelemetry.io/otel/attribute"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// MediaTokens counts the prompt tokens an engine made of media parts, by
// kind (EngineStats.prompt_*_tokens); they are part of the prompt tokens.
type MediaTokens struct {
	Audio, Image, Video int
}

func (m *MediaTokens) add(s *stagepb.EngineStats) {
	m.Audio += int(s.GetPromptAudioTokens())
	m.Image += int(s.GetPromptImageTokens())
	m.Video += int(s.GetPromptVideoTokens())
}

// PartError is the cause of an ErrBadRequest whose request holds a content
// part that the stage consuming the conversation does not take (errors.As
// finds it in an *Error): Message and Part index the part in the request's
// messages and their content arrays.
type PartError struct {
	Message, Part int
	Kind          string // stagepb.Part*
	ByURL         bool   // the part is an http(s) URL, not bytes
	Stage         string
}

func (e *PartError) Error() string {
	return fmt.Sprintf("orchestrator: messages[%d].content[%d] (%s) not taken by stage %s", e.Message, e.Part, e.Kind, e.Stage)
}

// checkParts refuses, before any work, a conversation with a media part
// that stage 0 (the stage that consumes it) cannot take: a stage takes a
// kind when every routable replica of it does, so any replica routing
// picks can run the request. A part given by URL also needs engines that
// fetch URLs themselves.
func checkParts(snap *router.Snapshot, msgs []*stagepb.ChatMessage, stage string) error {
	for i, m := range msgs {
		for k, p := range m.GetParts() {
			if p.GetKind() == stagepb.PartText {
				continue
			}
			byURL := p.GetUrl() != ""
			if snap.EveryReplicaTakesPart(0, p.GetKind(), byURL) {
				continue // the snapshot's counts: no replica read
			}
			for rep := range snap.Stage(0).All() {
				if takesPart(rep.Engine, p.GetKind(), byURL) {
					continue
				}
				pe := &PartError{Message: i, Part: k, Kind: p.GetKind(), ByURL: byURL, Stage: stage}
				return &Error{Kind: ErrBadRequest, Message: partRefusal(pe, rep.Engine), Cause: pe}
			}
		}
	}
	return nil
}

func takesPart(e router.EngineInfo, kind string, byURL bool) bool {
	return slices.Contains(e.InputParts, kind) && (!byURL || e.InputPartURLs)
}

// partRefusal tells the client which part the stage does not take and
// what it does take.
func partRefusal(pe *PartError, e router.EngineInfo) string {
	what := fmt.Sprintf("an %s part", pe.Kind)
	if pe.Kind == stagepb.PartVideo {
		what = "a video part"
	}
	takes := "text only"
	if len(e.InputParts) > 0 {
		takes = "text and " + strings.Join(e.InputParts, ", ") + " parts"
		if !e.InputPartURLs {
			takes += " with their bytes (base64 or data: URLs), not http(s) URLs, which it cannot fetch"
		}
	}
	if pe.ByURL && slices.Contains(e.InputParts, pe.Kind) {
		what += " given by http(s) URL"
	}
	return fmt.Sprintf("messages[%d].content[%d] is %s, which stage %q cannot take: its engine (%s) takes %s", pe.Message, pe.Part, what, pe.Stage, e.Name, takes)
}

// partAttributes describe a conversation's media parts on the request
// span: their kinds and sizes in bytes (URL parts: the URL's length), in
// order. None for a text-only conversation.
func partAttributes(msgs []*stagepb.ChatMessage) []attribute.KeyValue {
	var kinds []string
	var sizes []int
	for _, m := range msgs {
		for _, p := range m.GetParts() {
			if p.GetKind() == stagepb.PartText {
				continue
			}
			kinds = append(kinds, p.GetKind())
			sizes = append(sizes, len(p.GetData())+len(p.GetUrl()))
		}
	}
	if len(kinds) == 0 {
		return nil
	}
	return []attribute.KeyValue{attribute.StringSlice("troupe.request.part_kinds", kinds), attribute.IntSlice("troupe.request.part_bytes", sizes)}
}

// CheckParts is the refusal Execute gives, before any work, to a
// conversation with a media part that stage 0's routable replicas cannot
// take (an *Error of kind ErrBadRequest whose cause is a *PartError); nil
// when they take every part. A client that holds a part until its turn
// (a realtime session's committed audio) asks before keeping it.
func (h *Head) CheckParts(msgs []*stagepb.ChatMessage) error {
	return checkParts(h.router.Snapshot(), msgs, h.cfg.Pipeline.Stages[0].Name)
}
