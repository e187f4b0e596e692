package httpapi

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// Limits of a chat request's media parts (Config.MaxContentParts,
// MaxPartBytes): how many media parts one request may hold, and how many
// decoded bytes one of them may hold. The body limit bounds them all.
const (
	DefaultMaxContentParts = 32
	DefaultMaxPartBytes    = 8 << 20
)

// The content part types of a chat message (OpenAI's and vLLM's), each
// with its field and the kind it carries through the stage protocol.
var partTypes = map[string]string{
	"text":        stagepb.PartText,
	"image_url":   stagepb.PartImage,
	"input_audio": stagepb.PartAudio,
	"audio_url":   stagepb.PartAudio,
	"video_url":   stagepb.PartVideo,
}

const partTypeList = `"text", "image_url", "input_audio", "audio_url" or "video_url"`

// contentPart is one element of an array content. Media parts carry their
// bytes (input_audio's base64, a data: URL) or an http(s) URL, which only
// an engine that fetches URLs takes: the head never fetches one.
type contentPart struct {
	Type       *string     `json:"type"`
	Text       *string     `json:"text"`
	ImageURL   *mediaURL   `json:"image_url"`
	AudioURL   *mediaURL   `json:"audio_url"`
	VideoURL   *mediaURL   `json:"video_url"`
	InputAudio *inputAudio `json:"input_audio"`
}

type mediaURL struct {
	URL *string `json:"url"`
}

type inputAudio struct {
	Data   *string `json:"data"`
	Format *string `json:"format"`
}

// inputAudioFormats are the input_audio formats accepted: OpenAI's, and
// what vLLM's audio loader reads.
var inputAudioFormats = []string{"wav", "mp3", "flac", "ogg", "opus", "webm", "m4a", "aac", "pcm16"}

// partBudget carries a request's part limits across its messages.
type partBudget struct {
	maxParts int
	maxBytes int64
	parts    int // media parts so far
}

func newPartBudget(maxParts int, maxBytes int64) *partBudget {
	if maxParts <= 0 {
		maxParts = DefaultMaxContentParts
	}
	if maxBytes <= 0 {
		maxBytes = DefaultMaxPartBytes
	}
	return &partBudget{maxParts: maxParts, maxBytes: maxBytes}
}

// contentParts decodes an array content: its text parts joined by "\n",
// and, when it has a media part, every part in order as the protocol
// carries them (nil for text only).
func contentParts(param string, raw json.RawMessage, budget *partBudget) (string, []*stagepb.ContentPart, *apiError) {
	var parts []json.RawMessage
	if e := decodeValue(raw, &parts, param); e != nil {
		return "", nil, e
	}
	texts := make([]string, 0, len(parts))
	out := make([]*stagepb.ContentPart, 0, len(parts))
	media := false
	for k, rawPart := range parts {
		pp := param + "[" + strconv.Itoa(k) + "]"
		p, e := decodePart(pp, rawPart, budget)
		if e != nil {
			return "", nil, e
		}
		if p.GetKind() == stagepb.PartText {
			texts = append(texts, p.GetText())
		} else {
			media = true
		}
		out = append(out, p)
	}
	if !media {
		out = nil
	}
	return strings.Join(texts, "\n"), out, nil
}

// decodePart decodes and checks one content part at param.
func decodePart(param string, raw json.RawMessage, budget *partBudget) (*stagepb.ContentPart, *apiError) {
	if t := bytes.TrimSpace(raw); t[0] != '{' {
		return nil, badRequest(param, "invalid_type", "invalid type for %q: expected an object, got %s", param, jsonKind(t))
	}
	var p contentPart
	if e := decodeValue(raw, &p, param); e != nil {
		return nil, e
	}
	if p.Type == nil {
		return nil, badRequest(param+".type", "missing_field", "missing required field %q", param+".type")
	}
	kind, ok := partTypes[*p.Type]
	if !ok {
		return nil, unsupported(param+".type", "content part type %q is not supported: the types are %s", *p.Type, partTypeList)
	}
	if kind == stagepb.PartText {
		if p.Text == nil {
			return nil, badRequest(param+".text", "missing_field", "missing required field %q", param+".text")
		}
		return &stagepb.ContentPart{Kind: kind, Text: *p.Text}, nil
	}
	budget.parts++
	if budget.parts > budget.maxParts {
		return nil, badRequest(param, "invalid_value", "the request holds more than %d media parts, the limit of this server", budget.maxParts)
	}
	field := *p.Type
	var part *stagepb.ContentPart
	var e *apiError
	switch field {
	case "input_audio":
		part, e = inputAudioPart(param+".input_audio", p.InputAudio)
	case "image_url":
		part, e = urlPart(param+"."+field, kind, p.ImageURL)
	case "audio_url":
		part, e = urlPart(param+"."+field, kind, p.AudioURL)
	case "video_url":
		part, e = urlPart(param+"."+field, kind, p.VideoURL)
	}
	if e != nil {
		return nil, e
	}
	if int64(len(part.Data)) > budget.maxBytes {
		return nil, &apiError{Status: http.StatusRequestEntityTooLarge, Type: typeInvalidRequest, Code: "request_too_large", Param: param,
			Message: fmt.Sprintf("%s holds %d bytes once decoded, over the limit of %d bytes per media part", param, len(part.Data), budget.maxBytes)}
	}
	return part, nil
}

func inputAudioPart(param string, a *inputAudio) (*stagepb.ContentPart, *apiError) {
	switch {
	case a == nil:
		return nil, badRequest(param, "missing_field", "missing required field %q", param)
	case a.Data == nil:
		return nil, badRequest(param+".data", "missing_field", "missing required field %q", param+".data")
	case a.Format == nil:
		return nil, badRequest(param+".format", "missing_field", "missing required field %q", param+".format")
	}
	if !slices.Contains(inputAudioFormats, *a.Format) {
		return nil, badRequest(param+".format", "invalid_value", "unknown audio format %q: expected one of %s", *a.Format, strings.Join(inputAudioFormats, ", "))
	}
	data, err := base64.StdEncoding.DecodeString(*a.Data)
	if err != nil {
		return nil, badRequest(param+".data", "invalid_value", "%q is not valid base64: %v", param+".data", err)
	}
	if len(data) == 0 {
		return nil, badRequest(param+".data", "invalid_value", "%q holds no audio", param+".data")
	}
	if err := checkAudio(*a.Format, data); err != nil {
		return nil, invalidAudio(param+".data", err)
	}
	return &stagepb.ContentPart{Kind: stagepb.PartAudio, Data: data, Format: *a.Format}, nil
}

// urlPart decodes {"url": …} at param: a data: URL to its bytes, an
// http(s) URL kept as it is for the engine to fetch; other schemes are
// refused.
func urlPart(param, kind string, m *mediaURL) (*stagepb.ContentPart, *apiError) {
	if m == nil {
		return nil, badRequest(param, "missing_field", "missing required field %q", param)
	}
	if m.URL == nil {
		return nil, badRequest(param+".url", "missing_field", "missing required field %q", param+".url")
	}
	u := *m.URL
	scheme, _, _ := strings.Cut(u, ":")
	switch strings.ToLower(scheme) {
	case "data":
		mime, data, err := decodeDataURL(u)
		if err != nil {
			return nil, badRequest(param+".url", "invalid_value", "%q is not a valid data: URL: %v", param+".url", err)
		}
		if kind == stagepb.PartAudio {
			if err := checkAudio(audioFormatOfMIME(mime), data); err != nil {
				return nil, invalidAudio(param+".url", err)
			}
		}
		return &stagepb.ContentPart{Kind: kind, Data: data, MimeType: mime}, nil
	case "http", "https":
		if pu, err := url.Parse(u); err != nil || pu.Host == "" {
			return nil, badRequest(param+".url", "invalid_value", "%q is not a valid http(s) URL", param+".url")
		}
		return &stagepb.ContentPart{Kind: kind, Url: u}, nil
	}
	return nil, unsupported(param+".url", "%q must be a data: URL or an http(s) URL", param+".url")
}

// decodeDataURL decodes data:[<mediatype>][;base64],<data> (RFC 2397): the
// media type without its parameters, and the bytes.
func decodeDataURL(u string) (mime string, data []byte, err error) {
	// The scheme matched case-insensitively, and a bare "data" (no colon)
	// reaches here too: cut at the colon, not at a fixed length.
	_, rest, ok := strings.Cut(u, ":")
	if !ok {
		return "", nil, errors.New("no colon after data")
	}
	header, payload, ok := strings.Cut(rest, ",")
	if !ok {
		return "", nil, errors.New("no comma before the data")
	}
	params := strings.Split(header, ";")
	mime = strings.ToLower(strings.TrimSpace(params[0]))
	isBase64 := len(params) > 1 && strings.EqualFold(params[len(params)-1], "base64")
	if isBase64 {
		data, err = base64.StdEncoding.DecodeString(payload)
		if err != nil {
			return "", nil, fmt.Errorf("invalid base64: %w", err)
		}
	} else {
		s, err := url.PathUnescape(payload)
		if err != nil {
			return "", nil, fmt.Errorf("invalid percent-encoding: %w", err)
		}
		data = []byte(s)
	}
	if len(data) == 0 {
		return "", nil, errors.New("no data")
	}
	return mime, data, nil
}

// partRefused is the answer to a request whose part the consuming stage
// does not take (orchestrator.PartError): 400 unsupported naming the
// part; nil for any other error.
func partRefused(err error, msg string) *apiError {
	var pe *orchestrator.PartError
	if !errors.As(err, &pe) {
		return nil
	}
	return unsupported(fmt.Sprintf("messages[%d].content[%d]", pe.Message, pe.Part), "%s", msg)
}
