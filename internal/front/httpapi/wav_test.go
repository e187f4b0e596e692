package httpapi

import (
	"bytes"
	"encoding/binary"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"
)

// wavInfo is what a WAV reader finds in a file written by encodeWAV.
type wavInfo struct {
	channels, bitsPerSample, format int
	sampleRate, byteRate            int
	blockAlign                      int
	data                            []byte
}

// parseWAV reads a canonical 44-byte-header PCM WAV, checking the RIFF
// framing that players rely on.
func parseWAV(t require.TestingT, b []byte) wavInfo {
	require.GreaterOrEqual(t, len(b), wavHeaderSize)
	le := binary.LittleEndian
	require.Equal(t, "RIFF", string(b[0:4]))
	require.Equal(t, uint32(len(b)-8), le.Uint32(b[4:8]), "RIFF size is the file size minus 8")
	require.Equal(t, "WAVE", string(b[8:12]))
	require.Equal(t, "fmt ", string(b[12:16]))
	require.Equal(t, uint32(16), le.Uint32(b[16:20]))
	require.Equal(t, "data", string(b[36:40]))
	n := int(le.Uint32(b[40:44]))
	require.Equal(t, len(b)-wavHeaderSize, n, "data size")
	return wavInfo{
		format:        int(le.Uint16(b[20:22])),
		channels:      int(le.Uint16(b[22:24])),
		sampleRate:    int(le.Uint32(b[24:28])),
		byteRate:      int(le.Uint32(b[28:32])),
		blockAlign:    int(le.Uint16(b[32:34])),
		bitsPerSample: int(le.Uint16(b[34:36])),
		data:          b[wavHeaderSize:],
	}
}

func (w wavInfo) duration() time.Duration {
	samples := len(w.data) / w.blockAlign
	return time.Duration(samples) * time.Second / time.Duration(w.sampleRate)
}

func TestAppendWAV(t *testing.T) {
	pcm := make([]byte, 2*24000) // one second at 24 kHz
	for i := range pcm {
		pcm[i] = byte(i)
	}
	out, err := appendWAV(nil, pcm, 24000)
	require.NoError(t, err)
	w := parseWAV(t, out)
	assert.Equal(t, 1, w.format, "PCM")
	assert.Equal(t, 1, w.channels)
	assert.Equal(t, 16, w.bitsPerSample)
	assert.Equal(t, 24000, w.sampleRate)
	assert.Equal(t, 48000, w.byteRate)
	assert.Equal(t, 2, w.blockAlign)
	assert.Equal(t, time.Second, w.duration())
	assert.True(t, bytes.Equal(pcm, w.data), "samples are copied unchanged")
}

func TestAppendWAVOddAndInvalid(t *testing.T) {
	out, err := appendWAV(nil, []byte{1, 2, 3}, 16000)
	require.NoError(t, err)
	assert.Equal(t, []byte{1, 2}, parseWAV(t, out).data, "half a sample is dropped")

	for _, rate := range []int{0, -1, maxSampleRate + 1} {
		_, err := appendWAV(nil, []byte{0, 0}, rate)
		assert.Error(t, err, "rate %d", rate)
	}
}

func TestAppendWAVProperty(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		pcm := rapid.SliceOfN(rapid.Byte(), 0, 4096).Draw(t, "pcm")
		rate := rapid.IntRange(1, maxSampleRate).Draw(t, "rate")
		out, err := appendWAV(nil, pcm, rate)
		if err != nil {
			t.Fatal(err)
		}
		w := parseWAV(t, out)
		if w.sampleRate != rate || w.byteRate != 2*rate || len(w.data) != len(pcm)&^1 {
			t.Fatalf("header %+v for %d bytes at %d Hz", w, len(pcm), rate)
		}
	})
}
