package httpapi

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
)

// wavHeaderSize is the size of a canonical RIFF/WAVE header with one fmt
// chunk and one data chunk.
const wavHeaderSize = 44

// maxSampleRate bounds the rate a replica may report: far above any audio
// rate, and small enough that the byte rate fits the header's 32 bits.
const maxSampleRate = 1 << 24

// appendWAV appends to dst a RIFF/WAVE file of the little-endian PCM16 mono
// samples pcm at sampleRate. A trailing odd byte (half a sample) is
// dropped. On error dst is returned as it was.
func appendWAV(dst, pcm []byte, sampleRate int) ([]byte, error) {
	if sampleRate <= 0 || sampleRate > maxSampleRate {
		return dst, fmt.Errorf("httpapi: wav: invalid sample rate %d", sampleRate)
	}
	pcm = pcm[:len(pcm)&^1]
	if uint64(len(pcm)) > math.MaxUint32-(wavHeaderSize-8) {
		return dst, errors.New("httpapi: wav: audio too long for a RIFF file")
	}
	const (
		channels      = 1
		bitsPerSample = 16
		blockAlign    = channels * bitsPerSample / 8
		formatPCM     = 1
	)
	out := slices.Grow(dst, wavHeaderSize+len(pcm))
	le := binary.LittleEndian
	out = append(out, "RIFF"...)
	out = le.AppendUint32(out, uint32(wavHeaderSize-8+len(pcm)))
	out = append(out, "WAVE"...)
	out = append(out, "fmt "...)
	out = le.AppendUint32(out, 16) // fmt chunk size for PCM
	out = le.AppendUint16(out, formatPCM)
	out = le.AppendUint16(out, channels)
	out = le.AppendUint32(out, uint32(sampleRate))
	out = le.AppendUint32(out, uint32(sampleRate*blockAlign)) // byte rate
	out = le.AppendUint16(out, blockAlign)
	out = le.AppendUint16(out, bitsPerSample)
	out = append(out, "data"...)
	out = le.AppendUint32(out, uint32(len(pcm)))
	return append(out, pcm...), nil
}

// wavBuffers pools the WAV files of whole answers (audioOf): each is
// hundreds of kilobytes and lives only until its response is encoded.
var wavBuffers = sync.Pool{New: func() any { return new([]byte) }}

// putWAVBuffer returns b to wavBuffers, unless it is larger than a JSON
// buffer may be (a minutes-long answer is left to the garbage collector).
func putWAVBuffer(b *[]byte) {
	if cap(*b) > maxPooledJSONBuffer {
		return
	}
	*b = (*b)[:0]
	wavBuffers.Put(b)
}
