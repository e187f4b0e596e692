// Package wav reads PCM16 mono audio from a WAV (RIFF) stream as it
// arrives, for speech engines that forward audio while it is being made.
//
// Streaming writers (espeak-ng --stdout, servers that stream a WAV
// response) cannot know the data size when they write the header and put a
// placeholder there (0, 0xFFFFFFFF, or a value near 2^31). Such a data
// chunk runs to the end of the stream. A real size is enforced: a stream
// that ends before it is truncated (io.ErrUnexpectedEOF).
package wav

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

const (
	formatPCM        = 1
	formatExtensible = 0xFFFE
	// placeholderSize: a data size at or above this is a streaming
	// writer's placeholder (espeak-ng writes 0x7FFFF000).
	placeholderSize = 0x7FFF0000
)

// Reader yields the PCM16 mono little-endian samples of one WAV stream.
type Reader struct {
	src        *bufio.Reader
	sampleRate int
	remaining  int64 // bytes left in the data chunk; -1: until EOF
}

// NewReader reads the header up to the data chunk. It refuses anything but
// 16-bit PCM mono.
func NewReader(r io.Reader) (*Reader, error) {
	br := bufio.NewReaderSize(r, 32<<10)
	var riff [12]byte
	if _, err := io.ReadFull(br, riff[:]); err != nil {
		return nil, fmt.Errorf("wav: header: %w", noEOF(err))
	}
	if string(riff[0:4]) != "RIFF" || string(riff[8:12]) != "WAVE" {
		return nil, fmt.Errorf("wav: not a RIFF/WAVE stream (starts with %q)", riff[:])
	}
	w := &Reader{src: br}
	sawFmt := false
	for {
		var hdr [8]byte
		if _, err := io.ReadFull(br, hdr[:]); err != nil {
			return nil, fmt.Errorf("wav: chunk header: %w", noEOF(err))
		}
		id, size := string(hdr[0:4]), binary.LittleEndian.Uint32(hdr[4:8])
		switch id {
		case "fmt ":
			if size < 16 || size > 1024 {
				return nil, fmt.Errorf("wav: fmt chunk of %d bytes", size)
			}
			body := make([]byte, size+size%2)
			if _, err := io.ReadFull(br, body); err != nil {
				return nil, fmt.Errorf("wav: fmt chunk: %w", noEOF(err))
			}
			format := binary.LittleEndian.Uint16(body[0:2])
			channels := binary.LittleEndian.Uint16(body[2:4])
			rate := binary.LittleEndian.Uint32(body[4:8])
			bits := binary.LittleEndian.Uint16(body[14:16])
			if format == formatExtensible && size >= 26 {
				format = binary.LittleEndian.Uint16(body[24:26]) // the sub-format GUID's first two bytes
			}
			switch {
			case format != formatPCM:
				return nil, fmt.Errorf("wav: format %#x is not PCM", format)
			case bits != 16:
				return nil, fmt.Errorf("wav: %d bits per sample, want 16", bits)
			case channels != 1:
				return nil, fmt.Errorf("wav: %d channels, want mono", channels)
			case rate == 0 || rate > 384000:
				return nil, fmt.Errorf("wav: sample rate %d Hz", rate)
			}
			w.sampleRate, sawFmt = int(rate), true
		case "data":
			if !sawFmt {
				return nil, errors.New("wav: data chunk before fmt chunk")
			}
			w.remaining = int64(size)
			if size == 0 || size >= placeholderSize {
				w.remaining = -1
			}
			return w, nil
		default: // LIST, fact, ...: skip
			if _, err := br.Discard(int(size + size%2)); err != nil {
				return nil, fmt.Errorf("wav: skipping chunk %q: %w", id, noEOF(err))
			}
		}
	}
}

// NewRawReader reads a headerless PCM16 mono little-endian stream (the
// OpenAI speech API's "pcm" format) at the given sample rate.
func NewRawReader(r io.Reader, sampleRate int) *Reader {
	return &Reader{src: bufio.NewReaderSize(r, 32<<10), sampleRate: sampleRate, remaining: -1}
}

// SampleRate is the stream's sample rate in Hz.
func (w *Reader) SampleRate() int { return w.sampleRate }

// Next returns the samples that are available now: at least one, at most
// limit bytes (limit >= 2), always whole samples, in a new slice. It blocks
// only until one sample arrives. At the end of the data it returns io.EOF;
// a stream that ends early, or inside a sample, returns
// io.ErrUnexpectedEOF.
func (w *Reader) Next(limit int) ([]byte, error) {
	limit &^= 1
	if limit < 2 {
		return nil, errors.New("wav: Next needs room for one sample")
	}
	if w.remaining == 0 {
		return nil, io.EOF
	}
	if w.remaining > 0 && int64(limit) > w.remaining {
		limit = int(w.remaining) &^ 1
		if limit == 0 { // an odd data size: its last byte is padding
			w.remaining = 0
			return nil, io.EOF
		}
	}
	if _, err := w.src.Peek(2); err != nil {
		if errors.Is(err, io.EOF) && w.src.Buffered() == 0 && w.remaining < 0 {
			w.remaining = 0
			return nil, io.EOF
		}
		return nil, fmt.Errorf("wav: data: %w", noEOF(err))
	}
	buf := make([]byte, min(limit, w.src.Buffered())&^1)
	if _, err := io.ReadFull(w.src, buf); err != nil { // from the buffer: cannot fail
		return nil, fmt.Errorf("wav: data: %w", err)
	}
	if w.remaining > 0 {
		w.remaining -= int64(len(buf))
	}
	return buf, nil
}

// noEOF turns a plain EOF inside a structure into ErrUnexpectedEOF.
func noEOF(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}
