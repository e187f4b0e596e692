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

// The WAV files troupe takes as input (docs/api.md, "Audio in"): 16-bit
// PCM at a rate and channel count an audio device could play. Anything
// else is refused before a stage sees it.
const (
	minInputSampleRate = 8000
	maxInputSampleRate = 384000
	maxInputChannels   = 8
)

// WAV format tags (the fmt chunk's first field).
const (
	wavFormatPCM        = 1
	wavFormatExtensible = 0xFFFE
)

// wavSubFormatPCM is KSDATAFORMAT_SUBTYPE_PCM, the sub-format GUID of a
// WAVE_FORMAT_EXTENSIBLE file of PCM samples, as the file stores it.
var wavSubFormatPCM = [16]byte{0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x10, 0x00, 0x80, 0x00, 0x00, 0xaa, 0x00, 0x38, 0x9b, 0x71}

// wavAudio is what readWAV found in a WAV file.
type wavAudio struct {
	sampleRate, channels int
	data                 []byte // the interleaved PCM16 frames: a subslice of the file
}

// readWAV reads a whole WAV file held in b: a RIFF/WAVE header, a fmt
// chunk of 16-bit PCM (plain or WAVE_FORMAT_EXTENSIBLE) at a sane rate
// and channel count, and a data chunk of whole frames that lies within b.
// Other chunks (LIST, fact, ...) are skipped. The error, an *audioError,
// says what is wrong. It reads only the headers: its cost is linear in
// the number of chunks, each at least 8 bytes.
func readWAV(b []byte) (wavAudio, error) {
	switch {
	case len(b) == 0:
		return wavAudio{}, audioErrorf("the file is empty")
	case len(b) < 12:
		return wavAudio{}, audioErrorf("%d bytes are too few for a RIFF/WAVE header (12 bytes)", len(b))
	}
	switch id := string(b[0:4]); id {
	case "RIFF":
	case "RIFX":
		return wavAudio{}, audioErrorf("a big-endian RIFX file: troupe takes little-endian RIFF/WAVE")
	case "RF64":
		return wavAudio{}, audioErrorf("an RF64 file: troupe takes RIFF/WAVE")
	default:
		return wavAudio{}, audioErrorf("not a RIFF/WAVE file: it starts with %q", id)
	}
	if typ := string(b[8:12]); typ != "WAVE" {
		return wavAudio{}, audioErrorf("a RIFF file of type %q, not WAVE", typ)
	}
	le := binary.LittleEndian
	var w wavAudio
	blockAlign := 0
	for p := b[12:]; ; {
		if len(p) < 8 {
			if blockAlign == 0 {
				return wavAudio{}, audioErrorf("no fmt chunk")
			}
			return wavAudio{}, audioErrorf("no data chunk")
		}
		id, size := string(p[0:4]), uint64(le.Uint32(p[4:8]))
		p = p[8:]
		if size > uint64(len(p)) {
			if id == "data" {
				return wavAudio{}, audioErrorf("the data chunk declares %d bytes of samples, but only %d bytes follow its header", size, len(p))
			}
			return wavAudio{}, audioErrorf("the %q chunk declares %d bytes, but only %d bytes follow its header", id, size, len(p))
		}
		body := p[:size]
		switch id {
		case "fmt ":
			if blockAlign != 0 {
				return wavAudio{}, audioErrorf("two fmt chunks")
			}
			var err error
			if w, blockAlign, err = readWAVFormat(body); err != nil {
				return wavAudio{}, err
			}
		case "data":
			switch {
			case blockAlign == 0:
				return wavAudio{}, audioErrorf("the data chunk comes before the fmt chunk")
			case size == 0:
				return wavAudio{}, audioErrorf("the data chunk holds no samples")
			case size%uint64(blockAlign) != 0:
				return wavAudio{}, audioErrorf("the data chunk's %d bytes are not a whole number of %d-byte frames", size, blockAlign)
			}
			w.data = body
			return w, nil
		}
		p = p[min(size+(size&1), uint64(len(p))):] // a chunk of odd size has a pad byte
	}
}

// readWAVFormat checks a fmt chunk and returns the format and its block
// align (bytes a frame).
func readWAVFormat(body []byte) (wavAudio, int, error) {
	if len(body) < 16 {
		return wavAudio{}, 0, audioErrorf("a fmt chunk of %d bytes, fewer than PCM's 16", len(body))
	}
	le := binary.LittleEndian
	tag := le.Uint16(body[0:2])
	channels := int(le.Uint16(body[2:4]))
	rate := int64(le.Uint32(body[4:8]))
	blockAlign := int(le.Uint16(body[12:14]))
	bits := int(le.Uint16(body[14:16]))
	if tag == wavFormatExtensible {
		if len(body) < 40 {
			return wavAudio{}, 0, audioErrorf("an extensible fmt chunk of %d bytes, fewer than its 40", len(body))
		}
		if [16]byte(body[24:40]) != wavSubFormatPCM {
			return wavAudio{}, 0, audioErrorf("extensible samples of %s: troupe takes 16-bit PCM", wavFormatName(le.Uint16(body[24:26])))
		}
		if valid := int(le.Uint16(body[18:20])); valid != 0 && valid != bits {
			return wavAudio{}, 0, audioErrorf("%d valid bits in %d-bit samples: troupe takes 16-bit PCM", valid, bits)
		}
		tag = wavFormatPCM
	}
	switch {
	case tag != wavFormatPCM:
		return wavAudio{}, 0, audioErrorf("samples of %s: troupe takes 16-bit PCM", wavFormatName(tag))
	case bits != 16:
		return wavAudio{}, 0, audioErrorf("%d-bit samples: troupe takes 16-bit PCM", bits)
	case channels < 1 || channels > maxInputChannels:
		return wavAudio{}, 0, audioErrorf("%d channels: troupe takes 1 to %d", channels, maxInputChannels)
	case rate < minInputSampleRate || rate > maxInputSampleRate:
		return wavAudio{}, 0, audioErrorf("a sample rate of %d Hz: troupe takes %d to %d Hz", rate, minInputSampleRate, maxInputSampleRate)
	case blockAlign != 2*channels:
		return wavAudio{}, 0, audioErrorf("a block align of %d bytes, but %d channels of 16-bit samples take %d", blockAlign, channels, 2*channels)
	}
	return wavAudio{sampleRate: int(rate), channels: channels}, blockAlign, nil
}

// wavFormatName names a WAV format tag in an error.
func wavFormatName(tag uint16) string {
	var name string
	switch tag {
	case 2:
		name = "MS ADPCM"
	case 3:
		name = "IEEE float"
	case 6:
		name = "A-law"
	case 7:
		name = "µ-law"
	case 0x11:
		name = "IMA ADPCM"
	case 0x50:
		name = "MPEG"
	case 0x55:
		name = "MP3"
	default:
		return fmt.Sprintf("format tag %#04x", tag)
	}
	return fmt.Sprintf("%s (format tag %#04x)", name, tag)
}
