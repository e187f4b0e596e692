package httpapi

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
)

// wavHeaderSize is the size of a canonical RIFF/WAVE header with one fmt
// chunk and one data chunk.
const wavHeaderSize = 44

// maxSampleRate bounds the rate a replica may report: far above any audio
// rate, and small enough that the byte rate fits the header's 32 bits.
const maxSampleRate = 1 << 24

// encodeWAV wraps little-endian PCM16 mono samples in a RIFF/WAVE file at
// sampleRate. A trailing odd byte (half a sample) is dropped.
func encodeWAV(pcm []byte, sampleRate int) ([]byte, error) {
	if sampleRate <= 0 || sampleRate > maxSampleRate {
		return nil, fmt.Errorf("httpapi: wav: invalid sample rate %d", sampleRate)
	}
	pcm = pcm[:len(pcm)&^1]
	if uint64(len(pcm)) > math.MaxUint32-(wavHeaderSize-8) {
		return nil, errors.New("httpapi: wav: audio too long for a RIFF file")
	}
	const (
		channels      = 1
		bitsPerSample = 16
		blockAlign    = channels * bitsPerSample / 8
		formatPCM     = 1
	)
	out := make([]byte, wavHeaderSize, wavHeaderSize+len(pcm))
	le := binary.LittleEndian
	copy(out[0:4], "RIFF")
	le.PutUint32(out[4:8], uint32(wavHeaderSize-8+len(pcm)))
	copy(out[8:12], "WAVE")
	copy(out[12:16], "fmt ")
	le.PutUint32(out[16:20], 16) // fmt chunk size for PCM
	le.PutUint16(out[20:22], formatPCM)
	le.PutUint16(out[22:24], channels)
	le.PutUint32(out[24:28], uint32(sampleRate))
	le.PutUint32(out[28:32], uint32(sampleRate*blockAlign)) // byte rate
	le.PutUint16(out[32:34], blockAlign)
	le.PutUint16(out[34:36], bitsPerSample)
	copy(out[36:40], "data")
	le.PutUint32(out[40:44], uint32(len(pcm)))
	return append(out, pcm...), nil
}
