package httpapi

import (
	"bytes"
	"mime/multipart"
	"net/http"
	"strings"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/worker/sim"
)

// form builds a multipart/form-data body: fields, then the file if any.
func form(t *testing.T, fields map[string]string, file []byte, name string) (string, *bytes.Buffer) {
	t.Helper()
	var b bytes.Buffer
	mw := multipart.NewWriter(&b)
	for k, v := range fields {
		require.NoError(t, mw.WriteField(k, v))
	}
	if file != nil {
		fw, err := mw.CreateFormFile("file", name)
		require.NoError(t, err)
		_, err = fw.Write(file)
		require.NoError(t, err)
	}
	require.NoError(t, mw.Close())
	return mw.FormDataContentType(), &b
}

// TestTranscriptions: POST /v1/audio/transcriptions with the official
// client, served by a sim speech recognizer (stage asr): its transcript is
// sim.Transcript of the file's bytes, whole, streamed and as text.
func TestTranscriptions(t *testing.T) {
	p := orchestrator.Pipeline{Model: model, Stages: []orchestrator.Stage{{Name: "asr"}}}
	c := startCluster(t, orchestratortest.Options{Pipeline: p})
	a := startAPI(t, c, Config{MaxPartBytes: 1 << 20}, nil, nil)
	client := a.openai()
	ctx := testCtx(t)
	audio := wavFile(wavFormatPCM, 1, 16000, 16, 0, bytes.Repeat([]byte{3, 1, 4, 1, 5, 9}, 4000))
	want := sim.Transcript(audio, 0)
	require.Len(t, strings.Fields(want), sim.TranscriptWords(audio))

	res, err := client.Audio.Transcriptions.New(ctx, openai.AudioTranscriptionNewParams{
		File: openai.File(bytes.NewReader(audio), "speech.wav", "audio/wav"), Model: model,
		Language: openai.String("en"), Prompt: openai.String("troupe, stages"),
	})
	require.NoError(t, err)
	assert.Equal(t, want, res.Text)
	assert.Contains(t, res.RawJSON(), `"usage":{"type":"tokens"`)

	stream := client.Audio.Transcriptions.NewStreaming(ctx, openai.AudioTranscriptionNewParams{
		File: openai.File(bytes.NewReader(audio), "speech.wav", "audio/wav"), Model: model})
	var deltas strings.Builder
	done := ""
	for stream.Next() {
		switch ev := stream.Current(); ev.Type {
		case "transcript.text.delta":
			deltas.WriteString(ev.Delta)
		case "transcript.text.done":
			done = ev.Text
		}
	}
	require.NoError(t, stream.Err())
	require.NoError(t, stream.Close())
	assert.Equal(t, want, deltas.String())
	assert.Equal(t, want, done)

	ct, body := form(t, map[string]string{"model": model, "response_format": "text", "temperature": "0"}, audio, "a.wav")
	resp, text := a.do(t, http.MethodPost, "/v1/audio/transcriptions", body, http.Header{"Content-Type": {ct}})
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", text)
	assert.Equal(t, want, string(text))
	assert.Equal(t, "temperature", resp.Header.Get(ignoredHeader))

	for _, tc := range []struct {
		fields       map[string]string
		file         []byte
		status       int
		param, code  string
		notMultipart bool
	}{
		{fields: map[string]string{"model": model}, status: 400, param: "file", code: "missing_field"},
		{fields: map[string]string{}, file: audio, status: 400, param: "model", code: "missing_field"},
		{fields: map[string]string{"model": "whisper-1"}, file: audio, status: 404, param: "model", code: "model_not_found"},
		{fields: map[string]string{"model": model, "response_format": "srt"}, file: audio, status: 400, param: "response_format", code: "unsupported"},
		{fields: map[string]string{"model": model, "stream": "maybe"}, file: audio, status: 400, param: "stream", code: "invalid_type"},
		{fields: map[string]string{"model": model}, file: make([]byte, 1<<20+1), status: 413, param: "file", code: "request_too_large"},
		{fields: map[string]string{"model": model}, file: audio, status: 400, code: "invalid_body", notMultipart: true},
	} {
		ct, body := form(t, tc.fields, tc.file, "a.wav")
		if tc.notMultipart {
			ct = "application/json"
		}
		resp, data := a.do(t, http.MethodPost, "/v1/audio/transcriptions", body, http.Header{"Content-Type": {ct}})
		typ := typeInvalidRequest
		if tc.status == 404 {
			typ = typeNotFound
		}
		d := wantError(t, resp, data, tc.status, typ, tc.code)
		if tc.param != "" {
			require.NotNil(t, d.Param, "%s", data)
			assert.Equal(t, tc.param, *d.Param)
		}
	}
}

// TestTranscriptionsNeedRecognizer: a pipeline whose first stage takes
// text has no speech recognition: 400 before any work.
func TestTranscriptionsNeedRecognizer(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{})
	a := startAPI(t, c, Config{}, nil, nil)
	ct, body := form(t, map[string]string{"model": model}, wavFile(wavFormatPCM, 1, 16000, 16, 0, []byte{1, 0}), "a.wav")
	resp, data := a.do(t, http.MethodPost, "/v1/audio/transcriptions", body, http.Header{"Content-Type": {ct}})
	d := wantError(t, resp, data, http.StatusBadRequest, typeInvalidRequest, "invalid_request")
	assert.Contains(t, d.Message, "no speech recognition")
	assert.Zero(t, counter(t, c, "troupe_prompt_tokens_total", "0", "", ""), "no work")
}
