package openai

import (
	"encoding/base64"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// upstreamParts are the media kinds the engine passes on: all of them, by
// bytes or by URL. The upstream fetches URLs and decides what its model
// takes; what it refuses comes back as its 400.
var upstreamParts = stagepb.MediaPartKinds[:]

// contentPart is one element of an OpenAI (and vLLM) array content.
type contentPart struct {
	Type       string      `json:"type"`
	Text       *string     `json:"text,omitempty"`
	ImageURL   *partURL    `json:"image_url,omitempty"`
	AudioURL   *partURL    `json:"audio_url,omitempty"`
	VideoURL   *partURL    `json:"video_url,omitempty"`
	InputAudio *inputAudio `json:"input_audio,omitempty"`
}

type partURL struct {
	URL string `json:"url"`
}

type inputAudio struct {
	Data   string `json:"data"`
	Format string `json:"format"`
}

// messageContent is m's content as the upstream takes it: the text, or,
// when m has media parts, the parts in order in the shape the client sent
// them: an audio part with a format as input_audio (base64), any other
// media part as <kind>_url with its URL or a data: URL of its bytes and
// media type.
func messageContent(m *stagepb.ChatMessage) any {
	if len(m.GetParts()) == 0 {
		return m.GetContent()
	}
	out := make([]contentPart, len(m.GetParts()))
	for i, p := range m.GetParts() {
		if p.GetKind() == stagepb.PartText {
			text := p.GetText()
			out[i] = contentPart{Type: "text", Text: &text}
			continue
		}
		if p.GetKind() == stagepb.PartAudio && p.GetFormat() != "" {
			out[i] = contentPart{Type: "input_audio", InputAudio: &inputAudio{Data: base64.StdEncoding.EncodeToString(p.GetData()), Format: p.GetFormat()}}
			continue
		}
		u := &partURL{URL: p.GetUrl()}
		if u.URL == "" {
			u.URL = "data:" + p.GetMimeType() + ";base64," + base64.StdEncoding.EncodeToString(p.GetData())
		}
		switch p.GetKind() {
		case stagepb.PartImage:
			out[i] = contentPart{Type: "image_url", ImageURL: u}
		case stagepb.PartAudio:
			out[i] = contentPart{Type: "audio_url", AudioURL: u}
		default:
			out[i] = contentPart{Type: "video_url", VideoURL: u}
		}
	}
	return out
}
