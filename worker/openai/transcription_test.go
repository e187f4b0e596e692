package openai_test

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	oa "github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/worker/openai"
)

// TestTranscriptionThroughHead: a transcription request to the head is
// served by --engine openai-transcription: the file reaches the upstream's
// /v1/audio/transcriptions byte for byte, with the upstream's model, the
// language and the prompt, and its text comes back.
func TestTranscriptionThroughHead(t *testing.T) {
	var mu sync.Mutex
	got := map[string]string{}
	var file []byte
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.Method + " " + r.URL.Path {
		case "GET /health":
		case "GET /v1/models":
			_, _ = io.WriteString(w, `{"object":"list","data":[{"id":"whisper","object":"model"}]}`)
		case "POST /v1/audio/transcriptions":
			if err := r.ParseMultipartForm(1 << 20); err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			f, h, err := r.FormFile("file")
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			data, _ := io.ReadAll(f)
			mu.Lock()
			file = data
			got["filename"] = h.Filename
			got["content_type"] = h.Header.Get("Content-Type")
			for _, k := range []string{"model", "language", "prompt", "response_format"} {
				got[k] = r.FormValue(k)
			}
			mu.Unlock()
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"text":"hello from the river","usage":{"type":"tokens","input_tokens":12,"output_tokens":4,"total_tokens":16}}`)
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(up.Close)

	b := orchestratortest.Start(t, orchestratortest.Options{Pipeline: orchestrator.Pipeline{Model: "troupe-omni-sim", Stages: []orchestrator.Stage{{Name: "asr"}}}, ReplicasPerStage: -1})
	e, err := openai.NewTranscription(openai.Config{URL: up.URL + "/v1", Logger: quiet()})
	require.NoError(t, err)
	h := e.Health()
	assert.Equal(t, "audio", h.GetInputRole())
	assert.Equal(t, "text", h.GetRole())
	srv := startWorker(t, b, "asr", e)
	b.WaitState(t, "asr", srv.Member().ReplicaID, "attached")
	base := serveAPI(t, b)
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	client := oa.NewClient(option.WithBaseURL(base+"/v1/"), option.WithAPIKey("unused"), option.WithHTTPClient(&http.Client{Transport: tr}), option.WithMaxRetries(0))

	audio := append([]byte("ID3\x04"), bytes.Repeat([]byte{0xff, 0xfb, 0x90, 0x00}, 2000)...)
	res, err := client.Audio.Transcriptions.New(testCtx(t), oa.AudioTranscriptionNewParams{
		File: oa.File(bytes.NewReader(audio), "voice.mp3", "audio/mpeg"), Model: "troupe-omni-sim",
		Language: oa.String("de"), Prompt: oa.String("Flüsse"),
	})
	require.NoError(t, err)
	assert.Equal(t, "hello from the river", res.Text)
	mu.Lock()
	defer mu.Unlock()
	assert.Equal(t, audio, file, "the file byte for byte")
	assert.Equal(t, map[string]string{"filename": "audio.mp3", "content_type": "audio/mpeg", "model": "whisper", "language": "de", "prompt": "Flüsse", "response_format": "json"}, got)
}
