package httpapi

import (
	"strings"
	"testing"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// FuzzContentParts: whatever a message's content array holds, the part
// decoder answers parts or a 4xx naming a path under the content, never
// panics, and every media part it accepts has its bytes or an http(s) URL,
// within the limits.
func FuzzContentParts(f *testing.F) {
	for _, s := range []string{
		`[{"type":"text","text":"hi"}]`,
		`[{"type":"image_url","image_url":{"url":"data:image/png;base64,iVBORw0KGgo="}},{"type":"text","text":"what"}]`,
		`[{"type":"input_audio","input_audio":{"data":"UklGRg==","format":"wav"}}]`,
		`[{"type":"audio_url","audio_url":{"url":"data:audio/wav,RIFF%00"}},{"type":"video_url","video_url":{"url":"https://h/v.mp4"}}]`,
		`[{"type":"image_url","image_url":{"url":"data:;base64"}},{"type":"image_url","image_url":"x"}]`,
		`[{"type":"input_audio","input_audio":{"data":"!!","format":"mp3"}},{"type":"file"}]`,
		`[1,"a",null,{"type":null}]`,
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, content string) {
		body := `{"model":"troupe-omni-sim","messages":[{"role":"user","content":` + content + `}]}`
		j, e := parseChatLimited([]byte(body), testModel, newPartBudget(4, 64))
		if e != nil {
			checkAPIError(t, e)
			if e.Param != "" && !strings.HasPrefix(e.Param, "messages") {
				t.Fatalf("param %q names no field of the messages", e.Param)
			}
			return
		}
		media := 0
		for _, p := range j.messages[0].GetParts() {
			switch p.GetKind() {
			case stagepb.PartText:
				continue
			case stagepb.PartImage, stagepb.PartAudio, stagepb.PartVideo:
			default:
				t.Fatalf("unknown kind %q", p.GetKind())
			}
			media++
			switch {
			case p.GetUrl() != "":
				if len(p.GetData()) > 0 || !(strings.HasPrefix(strings.ToLower(p.GetUrl()), "http://") || strings.HasPrefix(strings.ToLower(p.GetUrl()), "https://")) {
					t.Fatalf("URL part %q: bytes too, or not http(s)", p.GetUrl())
				}
			case len(p.GetData()) == 0 || len(p.GetData()) > 64:
				t.Fatalf("media part of %d bytes accepted", len(p.GetData()))
			}
		}
		if media > 4 {
			t.Fatalf("%d media parts accepted, the limit is 4", media)
		}
	})
}

// FuzzTranscriptionForm: whatever a transcription's multipart body holds,
// the form parser answers a job or a 4xx, never panics, and an accepted
// job has the model, a file within the limit and a known format.
func FuzzTranscriptionForm(f *testing.F) {
	const boundary = "XyZ"
	f.Add("--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\ntroupe-omni-sim\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\nRIFF\r\n--XyZ--\r\n")
	f.Add("--XyZ\r\nContent-Disposition: form-data; name=\"stream\"\r\n\r\ntrue\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nx\r\n--XyZ--\r\n")
	f.Add("--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\ntroupe-omni-sim\r\n--XyZ\r\nContent-Disposition: form-data; name=\"response_format\"\r\n\r\nsrt\r\n--XyZ")
	f.Add("garbage")
	f.Fuzz(func(t *testing.T, body string) {
		j, e := parseTranscription([]byte(body), "multipart/form-data; boundary="+boundary, testModel, 64)
		if e != nil {
			checkAPIError(t, e)
			return
		}
		if j.model != testModel || len(j.audio) == 0 || len(j.audio) > 64 || (j.format != "json" && j.format != "text") {
			t.Fatalf("accepted %+v", j)
		}
	})
}
