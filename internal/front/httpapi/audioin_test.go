package httpapi

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/coder/websocket"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/worker/sim"
)

// wavFile is a WAV file of pcm with the given fmt chunk fields and any
// chunks before the data chunk; 0 for blockAlign computes it.
func wavFile(tag, channels uint16, rate uint32, bits, blockAlign uint16, pcm []byte, before ...[]byte) []byte {
	if blockAlign == 0 {
		blockAlign = channels * bits / 8
	}
	le := binary.LittleEndian
	var b []byte
	b = append(b, "RIFF\x00\x00\x00\x00WAVEfmt \x10\x00\x00\x00"...)
	b = le.AppendUint16(b, tag)
	b = le.AppendUint16(b, channels)
	b = le.AppendUint32(b, rate)
	b = le.AppendUint32(b, rate*uint32(blockAlign))
	b = le.AppendUint16(b, blockAlign)
	b = le.AppendUint16(b, bits)
	for _, c := range before {
		b = append(b, c...)
	}
	b = append(b, "data"...)
	b = le.AppendUint32(b, uint32(len(pcm)))
	b = append(b, pcm...)
	le.PutUint32(b[4:8], uint32(len(b)-8))
	return b
}

// extensibleWAV is a WAVE_FORMAT_EXTENSIBLE file of 16-bit mono samples
// whose sub-format GUID begins with subTag.
func extensibleWAV(subTag uint16, pcm []byte) []byte {
	le := binary.LittleEndian
	fmtChunk := []byte("fmt \x28\x00\x00\x00")
	fmtChunk = le.AppendUint16(fmtChunk, wavFormatExtensible)
	fmtChunk = le.AppendUint16(fmtChunk, 1)
	fmtChunk = le.AppendUint32(fmtChunk, 24000)
	fmtChunk = le.AppendUint32(fmtChunk, 48000)
	fmtChunk = le.AppendUint16(fmtChunk, 2)
	fmtChunk = le.AppendUint16(fmtChunk, 16)
	fmtChunk = le.AppendUint16(fmtChunk, 22) // cbSize
	fmtChunk = le.AppendUint16(fmtChunk, 16) // valid bits
	fmtChunk = le.AppendUint32(fmtChunk, 4)  // channel mask: front center
	guid := wavSubFormatPCM
	le.PutUint16(guid[0:2], subTag)
	fmtChunk = append(fmtChunk, guid[:]...)
	b := append([]byte("RIFF\x00\x00\x00\x00WAVE"), fmtChunk...)
	b = append(b, "data"...)
	b = le.AppendUint32(b, uint32(len(pcm)))
	b = append(b, pcm...)
	le.PutUint32(b[4:8], uint32(len(b)-8))
	return b
}

// patched is b with at replaced by v (a string, uint16 or uint32).
func patched(b []byte, at int, v any) []byte {
	out := bytes.Clone(b)
	switch v := v.(type) {
	case string:
		copy(out[at:], v)
	case uint16:
		binary.LittleEndian.PutUint16(out[at:], v)
	case uint32:
		binary.LittleEndian.PutUint32(out[at:], v)
	}
	return out
}

// noise is n seeded random bytes.
func noise(n int) []byte {
	r := rand.New(rand.NewPCG(44, 6))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// goodPCM is a tenth of a second of a tone at 24 kHz.
func goodPCM() []byte { return tone(100, 0.3) }

// malformedCase is one malformed audio file of issue 44 and what each
// path answers it: the HTTP paths' error code and a piece of its message,
// and the realtime error event's (rtCode "" when the bytes are valid raw
// PCM16, which a realtime session takes).
type malformedCase struct {
	name        string
	file        []byte
	code, says  string
	rtCode      string
	rtSays      string
	realtimeRaw bool
}

// malformedAudio: the 17 malformed WAV files of issue 44, and random bytes
// of an even length, which are malformed as a file but are valid raw
// samples.
func malformedAudio() []malformedCase {
	pcm := goodPCM()
	good := wavFile(wavFormatPCM, 1, 24000, 16, 0, pcm)
	const wavRT = "not a WAV file"
	return []malformedCase{
		{name: "empty", file: []byte{}, code: "invalid_value", says: "", rtCode: "invalid_value", rtSays: "got 0"},
		{name: "ten bytes", file: good[:10], code: "invalid_audio", says: "10 bytes are too few", rtCode: "invalid_audio", rtSays: wavRT},
		{name: "wrong magic", file: patched(good, 8, "WAVX"), code: "invalid_audio", says: `type "WAVX", not WAVE`, rtCode: "invalid_audio", rtSays: wavRT},
		{name: "big-endian RIFX", file: patched(good, 0, "RIFX"), code: "invalid_audio", says: "big-endian RIFX", rtCode: "invalid_audio", rtSays: wavRT},
		{name: "0 Hz", file: patched(good, 24, uint32(0)), code: "invalid_audio", says: "a sample rate of 0 Hz", rtCode: "invalid_audio", rtSays: wavRT},
		{name: "4294967295 Hz", file: patched(good, 24, uint32(0xFFFFFFFF)), code: "invalid_audio", says: "a sample rate of 4294967295 Hz", rtCode: "invalid_audio", rtSays: wavRT},
		{name: "65535 channels", file: patched(good, 22, uint16(0xFFFF)), code: "invalid_audio", says: "65535 channels", rtCode: "invalid_audio", rtSays: wavRT},
		{name: "float", file: wavFile(3, 1, 24000, 32, 0, append(pcm, pcm...)), code: "invalid_audio", says: "IEEE float", rtCode: "invalid_audio", rtSays: wavRT},
		{name: "MP3 in WAV", file: wavFile(0x55, 1, 24000, 0, 1, pcm), code: "invalid_audio", says: "MP3 (format tag 0x0055)", rtCode: "invalid_audio", rtSays: wavRT},
		{name: "extensible float", file: extensibleWAV(3, pcm), code: "invalid_audio", says: "extensible samples of IEEE float", rtCode: "invalid_audio", rtSays: wavRT},
		{name: "4 GiB data size", file: patched(good, 40, uint32(0xFFFFFFFF)), code: "invalid_audio", says: "declares 4294967295 bytes of samples, but only 4800", rtCode: "invalid_audio", rtSays: wavRT},
		{name: "cut short", file: good[:len(good)-1000], code: "invalid_audio", says: "declares 4800 bytes of samples, but only 3800", rtCode: "invalid_audio", rtSays: wavRT},
		{name: "8-bit", file: wavFile(wavFormatPCM, 1, 24000, 8, 0, pcm), code: "invalid_audio", says: "8-bit samples", rtCode: "invalid_audio", rtSays: wavRT},
		{name: "short fmt chunk", file: patched(good, 16, uint32(14)), code: "invalid_audio", says: "a fmt chunk of 14 bytes", rtCode: "invalid_audio", rtSays: wavRT},
		{name: "no data chunk", file: good[:36], code: "invalid_audio", says: "no data chunk", rtCode: "invalid_audio", rtSays: wavRT},
		{name: "chunk past the end", file: wavFile(wavFormatPCM, 1, 24000, 16, 0, pcm, []byte("LIST\xff\xff\xff\x7f")), code: "invalid_audio", says: `the "LIST" chunk declares 2147483647 bytes`, rtCode: "invalid_audio", rtSays: wavRT},
		{name: "noise", file: noise(4097), code: "invalid_audio", says: "not a RIFF/WAVE file", rtCode: "invalid_value", rtSays: "got 4097"},
		// Every even number of bytes is raw PCM16: a realtime session,
		// whose appends carry no header, hears this as white noise.
		{name: "noise of whole samples", file: noise(4096), code: "invalid_audio", says: "not a RIFF/WAVE file", realtimeRaw: true},
	}
}

// TestReadWAVMalformed: readWAV refuses each malformed file, saying what
// is wrong, and reads the files it takes.
func TestReadWAVMalformed(t *testing.T) {
	for _, tc := range malformedAudio() {
		_, err := readWAV(tc.file)
		require.Error(t, err, tc.name)
		assert.Contains(t, err.Error(), tc.says, tc.name)
		_, ok := err.(*audioError)
		assert.True(t, ok, "%s: %T", tc.name, err)
	}
	pcm := goodPCM()
	stereo := append(bytes.Clone(pcm), pcm...)
	for name, tc := range map[string]struct {
		file             []byte
		rate, channels   int
		data             []byte
		checkAsWAVFormat string
	}{
		"mono 24 kHz":          {wavFile(wavFormatPCM, 1, 24000, 16, 0, pcm), 24000, 1, pcm, "wav"},
		"stereo 44.1 kHz":      {wavFile(wavFormatPCM, 2, 44100, 16, 0, stereo), 44100, 2, stereo, "mp3"},
		"8 kHz, odd LIST":      {wavFile(wavFormatPCM, 1, 8000, 16, 0, pcm, []byte("LIST\x03\x00\x00\x00abc\x00")), 8000, 1, pcm, "wav"},
		"extensible PCM":       {extensibleWAV(wavFormatPCM, pcm), 24000, 1, pcm, ""},
		"chunk after the data": {append(wavFile(wavFormatPCM, 1, 16000, 16, 0, pcm), "JUNK\x02\x00\x00\x00ab"...), 16000, 1, pcm, "flac"},
		"written by appendWAV": {wavOf(t, pcm), realtimeSampleRate, 1, pcm, "wav"},
	} {
		w, err := readWAV(tc.file)
		require.NoError(t, err, name)
		assert.Equal(t, tc.rate, w.sampleRate, name)
		assert.Equal(t, tc.channels, w.channels, name)
		assert.Equal(t, tc.data, w.data, name)
		// Whatever format its sender names, a WAV file is read as one.
		assert.NoError(t, checkAudio(tc.checkAsWAVFormat, tc.file), name)
	}
}

// TestCheckAudioFormats: the compressed formats are taken by their
// signature (troupe does not decode them), raw pcm16 must be whole
// samples and no file, and bytes that no format starts with are refused.
func TestCheckAudioFormats(t *testing.T) {
	for _, tc := range []struct {
		format string
		b      []byte
		says   string // "" when taken
	}{
		{"mp3", []byte("ID3\x04\x00\x00\x00\x00\x00\x00\xff\xfb\x90\x00"), ""},
		{"mp3", []byte{0xff, 0xfb, 0x90, 0x64, 0, 0}, ""},
		{"aac", []byte{0xff, 0xf1, 0x50, 0x80, 0, 0}, ""},
		{"flac", []byte("fLaC\x00\x00\x00\x22"), ""},
		{"ogg", []byte("OggS\x00\x02"), ""},
		{"opus", []byte("OggS\x00\x02"), ""},
		{"webm", []byte("\x1a\x45\xdf\xa3\x01\x00"), ""},
		{"m4a", []byte("\x00\x00\x00\x20ftypM4A "), ""},
		{"", []byte("ID3\x03rest"), ""}, // a transcription file without an extension
		{"pcm16", goodPCM(), ""},
		{"mp3", noise(4096), "not an audio file"},
		{"", []byte("hello world"), "not an audio file"},
		{"pcm16", []byte{1, 2, 3}, "3 bytes are not a whole number of 16-bit samples"},
		{"pcm16", wavOf(t, goodPCM()), "a WAV file where raw PCM16 samples are expected"},
		{"pcm16", []byte("fLaC\x00\x00"), "a FLAC file where raw PCM16"},
		{"wav", []byte("ID3\x04\x00\x00\x00\x00\x00\x00\xff\xfb"), `not a RIFF/WAVE file: it starts with "ID3\x04"`},
		{"mp3", patched(wavOf(t, goodPCM()), 24, uint32(0)), "a sample rate of 0 Hz"}, // a WAV named mp3 is still read
	} {
		err := checkAudio(tc.format, tc.b)
		if tc.says == "" {
			assert.NoError(t, err, "%s %q", tc.format, tc.b[:min(8, len(tc.b))])
			continue
		}
		require.Error(t, err, "%s %q", tc.format, tc.b[:min(8, len(tc.b))])
		assert.Contains(t, err.Error(), tc.says)
	}
}

// TestMalformedAudioAtTheFrontDoor sends each malformed file of issue 44
// as a client would: a transcription's file, a chat's input_audio part
// and a realtime input_audio_buffer.append. Each is answered 400 (an
// error event on the realtime session, which goes on) naming what is
// wrong, before any stage runs: no stage counts a token. A good file
// then passes each path.
func TestMalformedAudioAtTheFrontDoor(t *testing.T) {
	p := orchestrator.Pipeline{Model: model, Stages: []orchestrator.Stage{{Name: "asr"}, {Name: "thinker"}}}
	c := startCluster(t, orchestratortest.Options{Pipeline: p})
	a := startAPI(t, c, Config{}, nil, nil)
	chat := func(format string, audio []byte) (*http.Response, []byte) {
		part, err := json.Marshal(map[string]any{"type": "input_audio", "input_audio": map[string]string{"data": base64.StdEncoding.EncodeToString(audio), "format": format}})
		require.NoError(t, err)
		return a.post(t, "/v1/chat/completions", `{"model":"troupe-omni-sim","max_tokens":3,"messages":[{"role":"user","content":[`+string(part)+`]}]}`)
	}
	transcribe := func(audio []byte) (*http.Response, []byte) {
		ct, body := form(t, map[string]string{"model": model}, audio, "speech.wav")
		return a.do(t, http.MethodPost, "/v1/audio/transcriptions", body, http.Header{"Content-Type": {ct}})
	}
	conn := rawConn(t, a)
	send := func(event string) {
		require.NoError(t, conn.Write(testCtx(t), websocket.MessageText, []byte(event)))
	}
	// No server VAD: noise would start speech, and commit on its own.
	send(`{"type":"session.update","session":{"type":"realtime","output_modalities":["text"],"audio":{"input":{"turn_detection":null}}}}`)
	updated := readRaw(t, conn)
	require.Equal(t, "session.updated", updated["type"])
	in := updated["session"].(map[string]any)["audio"].(map[string]any)["input"].(map[string]any)
	require.Contains(t, in, "turn_detection")
	require.Nil(t, in["turn_detection"], "turn_detection null turns server VAD off")
	tokens := func() float64 {
		return counter(t, c, "troupe_prompt_tokens_total", "0", "", "") + counter(t, c, "troupe_prompt_tokens_total", "1", "", "")
	}

	for _, tc := range malformedAudio() {
		t.Run(tc.name, func(t *testing.T) {
			resp, body := transcribe(tc.file)
			e := wantError(t, resp, body, http.StatusBadRequest, typeInvalidRequest, tc.code)
			assert.Equal(t, "file", *e.Param)
			assert.Contains(t, e.Message, tc.says)

			resp, body = chat("wav", tc.file)
			e = wantError(t, resp, body, http.StatusBadRequest, typeInvalidRequest, tc.code)
			assert.Equal(t, "messages[0].content[0].input_audio.data", *e.Param)
			assert.Contains(t, e.Message, tc.says)

			id := "append-" + strings.ReplaceAll(tc.name, " ", "-")
			send(`{"type":"input_audio_buffer.append","event_id":"` + id + `","audio":"` + base64.StdEncoding.EncodeToString(tc.file) + `"}`)
			send(`{"type":"input_audio_buffer.commit"}`)
			ev := readRaw(t, conn)
			if tc.realtimeRaw {
				assert.Equal(t, "input_audio_buffer.committed", ev["type"], "valid raw samples are appended: %v", ev)
				for _, want := range []string{"conversation.item.added", "conversation.item.done"} {
					require.Equal(t, want, readRaw(t, conn)["type"])
				}
				return
			}
			require.Equal(t, "error", ev["type"], "%v", ev)
			rtErr := ev["error"].(map[string]any)
			assert.Equal(t, tc.rtCode, rtErr["code"])
			assert.Equal(t, "invalid_request_error", rtErr["type"])
			assert.Equal(t, "audio", rtErr["param"])
			assert.Equal(t, id, rtErr["event_id"])
			assert.Contains(t, rtErr["message"], tc.rtSays)
			// Nothing was appended: the commit finds the buffer empty.
			ev = readRaw(t, conn)
			require.Equal(t, "error", ev["type"], "%v", ev)
			assert.Equal(t, "input_audio_buffer_commit_empty", ev["error"].(map[string]any)["code"])
		})
	}
	assert.Zero(t, tokens(), "no stage ran for a malformed file")

	// A good file passes each path, and runs the stages.
	good := wavFile(wavFormatPCM, 1, 16000, 16, 0, goodPCM())
	resp, body := transcribe(good)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", body)
	assert.Contains(t, string(body), strconv.Quote(sim.Transcript(good, 0)))
	resp, body = chat("wav", good)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", body)
	send(`{"type":"input_audio_buffer.append","audio":"` + base64.StdEncoding.EncodeToString(goodPCM()) + `"}`)
	send(`{"type":"input_audio_buffer.commit"}`)
	assert.Equal(t, "input_audio_buffer.committed", readRaw(t, conn)["type"])
	assert.Positive(t, tokens())

	// An input_audio item takes raw samples as an append does.
	send(`{"type":"conversation.item.create","event_id":"item","item":{"type":"message","role":"user","content":[{"type":"input_audio","audio":"` + base64.StdEncoding.EncodeToString(good) + `"}]}}`)
	for {
		ev := readRaw(t, conn)
		if ev["type"] == "error" {
			e := ev["error"].(map[string]any)
			assert.Equal(t, "invalid_audio", e["code"], "%v", ev)
			assert.Equal(t, "item.content[0].audio", e["param"])
			assert.Equal(t, "item", e["event_id"])
			break
		}
		require.Contains(t, []any{"conversation.item.added", "conversation.item.done"}, ev["type"], "the committed item's events, then the refusal: %v", ev)
	}
}
