package wav

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"testing"
	"testing/iotest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// encode writes a canonical WAV: RIFF, fmt (with extra), a LIST chunk to
// skip, then data with the given declared size.
func encode(pcm []byte, rate, channels, bits int, format uint16, dataSize uint32) []byte {
	var b bytes.Buffer
	b.WriteString("RIFF")
	_ = binary.Write(&b, binary.LittleEndian, uint32(0))
	b.WriteString("WAVEfmt ")
	_ = binary.Write(&b, binary.LittleEndian, uint32(16))
	_ = binary.Write(&b, binary.LittleEndian, format)
	_ = binary.Write(&b, binary.LittleEndian, uint16(channels))
	_ = binary.Write(&b, binary.LittleEndian, uint32(rate))
	_ = binary.Write(&b, binary.LittleEndian, uint32(rate*channels*bits/8))
	_ = binary.Write(&b, binary.LittleEndian, uint16(channels*bits/8))
	_ = binary.Write(&b, binary.LittleEndian, uint16(bits))
	b.WriteString("LIST")
	_ = binary.Write(&b, binary.LittleEndian, uint32(3))
	b.WriteString("abc\x00") // odd size: one pad byte
	b.WriteString("data")
	_ = binary.Write(&b, binary.LittleEndian, dataSize)
	b.Write(pcm)
	return b.Bytes()
}

func samples(n int) []byte {
	out := make([]byte, 0, 2*n)
	for i := range n {
		out = binary.LittleEndian.AppendUint16(out, uint16(i*37))
	}
	return out
}

func readAll(t *testing.T, r *Reader, limit int) ([]byte, error) {
	t.Helper()
	var out []byte
	for {
		b, err := r.Next(limit)
		if err != nil {
			return out, err
		}
		require.NotEmpty(t, b)
		require.Zero(t, len(b)%2, "whole samples only")
		require.LessOrEqual(t, len(b), limit)
		out = append(out, b...)
	}
}

func TestReadsSamples(t *testing.T) {
	pcm := samples(1000)
	for name, size := range map[string]uint32{"exact size": uint32(len(pcm)), "espeak placeholder": 0x7FFFF000, "zero": 0, "max": 0xFFFFFFFF} {
		t.Run(name, func(t *testing.T) {
			// One byte at a time: every read boundary splits samples.
			r, err := NewReader(iotest.OneByteReader(bytes.NewReader(encode(pcm, 22050, 1, 16, formatPCM, size))))
			require.NoError(t, err)
			assert.Equal(t, 22050, r.SampleRate())
			got, err := readAll(t, r, 64)
			require.ErrorIs(t, err, io.EOF)
			assert.Equal(t, pcm, got)
		})
	}
}

func TestExactSizeIgnoresTrailingBytes(t *testing.T) {
	pcm := samples(10)
	data := append(encode(pcm, 24000, 1, 16, formatPCM, uint32(len(pcm))), "trailing junk"...)
	r, err := NewReader(bytes.NewReader(data))
	require.NoError(t, err)
	got, err := readAll(t, r, 7)
	require.ErrorIs(t, err, io.EOF)
	assert.Equal(t, pcm, got)
}

func TestTruncated(t *testing.T) {
	pcm := samples(100)
	// Declared 200 bytes, 100 sent.
	r, err := NewReader(bytes.NewReader(encode(pcm[:100], 24000, 1, 16, formatPCM, 200)))
	require.NoError(t, err)
	got, err := readAll(t, r, 4096)
	require.ErrorIs(t, err, io.ErrUnexpectedEOF)
	assert.Equal(t, pcm[:100], got)

	// Unknown size, but the stream stops inside a sample.
	r, err = NewReader(bytes.NewReader(encode(pcm[:101], 24000, 1, 16, formatPCM, 0)))
	require.NoError(t, err)
	_, err = readAll(t, r, 4096)
	require.ErrorIs(t, err, io.ErrUnexpectedEOF)

	// Cut inside the header.
	_, err = NewReader(bytes.NewReader(encode(pcm, 24000, 1, 16, formatPCM, 0)[:30]))
	require.ErrorIs(t, err, io.ErrUnexpectedEOF)
}

func TestRefusesOtherFormats(t *testing.T) {
	for name, tc := range map[string]struct {
		data []byte
		want string
	}{
		"stereo":   {encode(samples(4), 24000, 2, 16, formatPCM, 8), "2 channels"},
		"8 bit":    {encode(samples(4), 24000, 1, 8, formatPCM, 8), "8 bits"},
		"float":    {encode(samples(4), 24000, 1, 16, 3, 8), "not PCM"},
		"not riff": {[]byte("ID3\x04 this is an mp3 file"), "not a RIFF/WAVE"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := NewReader(bytes.NewReader(tc.data))
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.want)
		})
	}
}

func TestRaw(t *testing.T) {
	pcm := samples(500)
	r := NewRawReader(iotest.HalfReader(bytes.NewReader(pcm)), 24000)
	assert.Equal(t, 24000, r.SampleRate())
	got, err := readAll(t, r, 100)
	require.True(t, errors.Is(err, io.EOF))
	assert.Equal(t, pcm, got)
}
