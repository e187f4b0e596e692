package httpapi

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator"
)

// referenceWAV is a WAV file written field by field, independently of
// appendWAV.
func referenceWAV(pcm []byte, rate int) []byte {
	pcm = pcm[:len(pcm)&^1]
	var b bytes.Buffer
	b.WriteString("RIFF")
	_ = binary.Write(&b, binary.LittleEndian, uint32(36+len(pcm)))
	b.WriteString("WAVEfmt ")
	_ = binary.Write(&b, binary.LittleEndian, struct {
		Size                      uint32
		Format, Channels          uint16
		Rate, ByteRate            uint32
		BlockAlign, BitsPerSample uint16
	}{16, 1, 1, uint32(rate), uint32(2 * rate), 2, 16})
	b.WriteString("data")
	_ = binary.Write(&b, binary.LittleEndian, uint32(len(pcm)))
	b.Write(pcm)
	return b.Bytes()
}

func testPCM(n int, seed byte) []byte {
	pcm := make([]byte, n)
	for i := range pcm {
		pcm[i] = byte(i*7) + seed
	}
	return pcm
}

// TestAppendWAVReusedBuffer: the WAV is the same bytes whether written into
// nothing, into a used buffer with stale bytes beyond its length, or after
// a prefix, which it keeps.
func TestAppendWAVReusedBuffer(t *testing.T) {
	pcm := testPCM(4801, 3)
	want := referenceWAV(pcm, 24000)
	fresh, err := appendWAV(nil, pcm, 24000)
	require.NoError(t, err)
	assert.Equal(t, want, fresh)

	used := bytes.Repeat([]byte{0xee}, 1<<16)
	got, err := appendWAV(used[:0], pcm, 24000)
	require.NoError(t, err)
	assert.Equal(t, want, got)
	assert.Equal(t, &used[0], &got[0], "written in place")

	got, err = appendWAV([]byte("prefix"), pcm, 24000)
	require.NoError(t, err)
	assert.Equal(t, append([]byte("prefix"), want...), got)

	got, err = appendWAV([]byte("kept"), pcm, 0)
	require.Error(t, err)
	assert.Equal(t, []byte("kept"), got)
}

// TestAudioAnswerBytes: the WAV of whole answers, one after the other (the
// second in the first's pooled buffer, shorter, the third longer), is
// exactly the reference file of each answer's samples.
func TestAudioAnswerBytes(t *testing.T) {
	for i, n := range []int{96000, 4000, 200001} {
		res := &orchestrator.Result{Text: "hi", PCM: testPCM(n, byte(i)), SampleRate: 24000}
		a, err := audioOf(res, true, "wav", "audio_x")
		require.NoError(t, err)
		rec := httptest.NewRecorder()
		resp := &chatResponder{id: "chatcmpl-x", model: "m"}
		writeJSON(rec, http.StatusOK, resp.full(res, a))
		a.release()
		assert.Nil(t, a.Data)
		var body struct {
			Choices []struct {
				Message struct {
					Audio struct {
						Data string `json:"data"`
					} `json:"audio"`
				} `json:"message"`
			} `json:"choices"`
		}
		require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &body))
		wav, err := base64.StdEncoding.DecodeString(body.Choices[0].Message.Audio.Data)
		require.NoError(t, err)
		assert.Equal(t, referenceWAV(res.PCM, 24000), wav, "answer %d", i)
	}

	// pcm16: the samples themselves, nothing pooled.
	res := &orchestrator.Result{PCM: testPCM(100, 1), SampleRate: 24000}
	a, err := audioOf(res, true, audioFormatPCM16, "audio_x")
	require.NoError(t, err)
	assert.Equal(t, &res.PCM[0], &a.Data[0])
	a.release()
	assert.Equal(t, &res.PCM[0], &a.Data[0], "nothing to release")
}

// BenchmarkAudioAnswer is a whole answer with four seconds of 24 kHz audio
// as a WAV: the file and its JSON.
func BenchmarkAudioAnswer(b *testing.B) {
	res := &orchestrator.Result{Text: "hello there", PCM: testPCM(4*2*24000, 0), SampleRate: 24000, PromptTokens: 8, CompletionTokens: 16}
	w := &discardResponse{header: http.Header{}}
	resp := &chatResponder{id: "chatcmpl-x", model: "m"}
	b.SetBytes(int64(len(res.PCM)))
	b.ReportAllocs()
	for b.Loop() {
		a, err := audioOf(res, true, "wav", "audio_x")
		if err != nil {
			b.Fatal(err)
		}
		writeJSON(w, http.StatusOK, resp.full(res, a))
		a.release()
	}
}
