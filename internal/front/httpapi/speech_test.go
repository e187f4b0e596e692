package httpapi

import (
	"bufio"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"io"
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

// TestSpeech: POST /v1/audio/speech with the official client. The audio
// stages (talker → vocoder) speak the input as if the thinker had written
// it: the PCM is exactly the audio the chat endpoint answers for the same
// text and voice, as raw PCM, as a WAV and as SSE events.
func TestSpeech(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{})
	a := startAPI(t, c, Config{}, nil, nil)
	client := a.openai()
	ctx := testCtx(t)

	chat, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
		Model:               model,
		Messages:            []openai.ChatCompletionMessageParamUnion{openai.UserMessage("say something about rivers")},
		MaxCompletionTokens: openai.Int(12),
		Modalities:          []string{"text", "audio"},
		Audio:               openai.ChatCompletionAudioParam{Voice: openai.ChatCompletionAudioParamVoiceUnion{OfString: openai.String("alloy")}, Format: "pcm16"},
	})
	require.NoError(t, err)
	text := chat.Choices[0].Message.Content
	require.NotEmpty(t, text)
	want, err := base64.StdEncoding.DecodeString(chat.Choices[0].Message.Audio.Data)
	require.NoError(t, err)
	require.NotEmpty(t, want)

	params := openai.AudioSpeechNewParams{Model: model, Input: text, Voice: openai.AudioSpeechNewParamsVoiceUnion{OfString: openai.String("alloy")},
		ResponseFormat: openai.AudioSpeechNewParamsResponseFormatPCM}
	resp, err := client.Audio.Speech.New(ctx, params)
	require.NoError(t, err)
	pcm, err := io.ReadAll(resp.Body)
	require.NoError(t, resp.Body.Close())
	require.NoError(t, err)
	assert.Equal(t, "audio/pcm", resp.Header.Get("Content-Type"))
	assert.Equal(t, "24000", resp.Header.Get(sampleRateHeader))
	assert.Equal(t, want, pcm, "the chat endpoint's audio for the same text and voice")

	params.ResponseFormat = openai.AudioSpeechNewParamsResponseFormatWAV
	resp, err = client.Audio.Speech.New(ctx, params)
	require.NoError(t, err)
	wav, err := io.ReadAll(resp.Body)
	require.NoError(t, resp.Body.Close())
	require.NoError(t, err)
	assert.Equal(t, "audio/wav", resp.Header.Get("Content-Type"))
	require.Greater(t, len(wav), 44)
	assert.Equal(t, "RIFF", string(wav[:4]))
	assert.Equal(t, uint32(sim.SampleRate), binary.LittleEndian.Uint32(wav[24:28]))
	assert.Equal(t, want, wav[44:])

	// SSE: speech.audio.delta events, then speech.audio.done with usage.
	resp2, body := a.post(t, "/v1/audio/speech", `{"model":"troupe-omni-sim","input":`+quote(text)+`,"voice":"alloy","response_format":"pcm","stream_format":"sse"}`)
	require.Equal(t, http.StatusOK, resp2.StatusCode, "%s", body)
	assert.Equal(t, "text/event-stream", resp2.Header.Get("Content-Type"))
	var got []byte
	var done *speechEvent
	sc := bufio.NewScanner(strings.NewReader(string(body)))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		var ev speechEvent
		require.NoError(t, json.Unmarshal([]byte(line), &ev))
		switch ev.Type {
		case "speech.audio.delta":
			require.Nil(t, done, "no delta after done")
			b, err := base64.StdEncoding.DecodeString(ev.Audio)
			require.NoError(t, err)
			got = append(got, b...)
		case "speech.audio.done":
			done = &ev
		default:
			t.Fatalf("unexpected event %q: %s", ev.Type, line)
		}
	}
	assert.Equal(t, want, got)
	require.NotNil(t, done)
	require.NotNil(t, done.Usage)
	assert.Positive(t, done.Usage.InputTokens)
	assert.Equal(t, done.Usage.InputTokens+done.Usage.OutputTokens, done.Usage.TotalTokens)

	// Fields the client may not have right.
	for _, tc := range []struct {
		body, param, code string
		status            int
	}{
		{`{"model":"troupe-omni-sim","input":"hi","response_format":"mp3"}`, "response_format", "unsupported", 400},
		{`{"model":"troupe-omni-sim","input":"hi","speed":2}`, "speed", "unsupported", 400},
		{`{"model":"troupe-omni-sim","input":"hi","speed":9}`, "speed", "invalid_value", 400},
		{`{"model":"troupe-omni-sim","input":"hi","stream_format":"sse"}`, "stream_format", "unsupported", 400},
		{`{"model":"troupe-omni-sim","input":"hi","stream_format":"ws"}`, "stream_format", "invalid_value", 400},
		{`{"model":"troupe-omni-sim","input":""}`, "input", "invalid_value", 400},
		{`{"model":"troupe-omni-sim"}`, "input", "missing_field", 400},
		{`{"model":"troupe-omni-sim","input":"hi","voice":3}`, "voice", "invalid_type", 400},
		{`{"model":"tts-1","input":"hi"}`, "model", "model_not_found", 404},
	} {
		resp, body := a.post(t, "/v1/audio/speech", tc.body)
		typ := typeInvalidRequest
		if tc.status == 404 {
			typ = typeNotFound
		}
		d := wantError(t, resp, body, tc.status, typ, tc.code)
		require.NotNil(t, d.Param, "%s", body)
		assert.Equal(t, tc.param, *d.Param, "%s", tc.body)
	}
	resp3, body := a.post(t, "/v1/audio/speech", `{"model":"troupe-omni-sim","input":"hi","response_format":"mp3"}`)
	require.Equal(t, http.StatusBadRequest, resp3.StatusCode)
	assert.Contains(t, string(body), `\"wav\" (the default) and \"pcm\"`)
	resp4, _ := a.post(t, "/v1/audio/speech", `{"model":"troupe-omni-sim","input":"hi","instructions":"cheerful","response_format":"pcm"}`)
	assert.Equal(t, http.StatusOK, resp4.StatusCode)
	assert.Equal(t, "instructions", resp4.Header.Get(ignoredHeader))
}

// TestSpeechTextOnlyPipeline: a pipeline whose last stage gives text makes
// no speech: 400, before any audio.
func TestSpeechTextOnlyPipeline(t *testing.T) {
	p := orchestrator.Pipeline{Model: model, Stages: []orchestrator.Stage{{Name: "thinker"}}}
	c := startCluster(t, orchestratortest.Options{Pipeline: p})
	a := startAPI(t, c, Config{}, nil, nil)
	resp, body := a.post(t, "/v1/audio/speech", `{"model":"troupe-omni-sim","input":"hi"}`)
	d := wantError(t, resp, body, http.StatusBadRequest, typeInvalidRequest, "invalid_request")
	assert.Contains(t, d.Message, "makes no speech")
}

func quote(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

// TestSpeechWithoutTheThinker: /v1/audio/speech runs the speech stages
// alone, so it answers while the thinker has no replica.
func TestSpeechWithoutTheThinker(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{})
	a := startAPI(t, c, Config{}, nil, nil)
	client := a.openai()
	ctx := testCtx(t)
	params := openai.AudioSpeechNewParams{Model: model, Input: "rivers run to the sea", Voice: openai.AudioSpeechNewParamsVoiceUnion{OfString: openai.String("alloy")},
		ResponseFormat: openai.AudioSpeechNewParamsResponseFormatPCM}
	speak := func() []byte {
		resp, err := client.Audio.Speech.New(ctx, params)
		require.NoError(t, err)
		pcm, err := io.ReadAll(resp.Body)
		require.NoError(t, resp.Body.Close())
		require.NoError(t, err)
		return pcm
	}
	want := speak()
	require.NotEmpty(t, want)
	for _, w := range c.Workers() {
		if w.Stage == "thinker" {
			w.Stop(t)
			c.WaitState(t, "thinker", w.ReplicaID(), "detached")
		}
	}
	assert.Equal(t, want, speak(), "the same speech without a thinker")
}
