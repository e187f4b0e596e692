// Package sse reads server-sent events (text/event-stream), the way the
// OpenAI API and the servers that copy it stream an answer: the data of
// each event, one event at a time. It is the one SSE reader of troupe's
// clients (the openai worker, troupe bench, the benchmarks).
//
// The rules, those of the WHATWG event-stream format but the last:
//
//   - a line ends in "\n" or "\r\n" and holds at most MaxLine bytes;
//   - a line's field name is what comes before its first colon (the whole
//     line when it has none), its value what comes after, less one
//     leading space;
//   - a blank line ends an event; an event with at least one data line is
//     returned, its data being its data lines' values joined by "\n";
//   - comments (lines that start with a colon) and the other fields
//     (event, id, retry) are skipped;
//   - at the end of the stream, an event that no blank line ended is still
//     returned (the format discards it): an upstream that closes after its
//     last data line, as some do, then loses nothing.
//
// openai-go's ssestream decoder reads the same, except that last rule and
// its taking an *http.Response; sse_test.go compares the two.
package sse

import (
	"bufio"
	"bytes"
	"io"
)

// MaxLine bounds one line: an event's data may be large (base64 audio), and
// an upstream must not make a client buffer without bound.
const MaxLine = 16 << 20

// Done is the data of the event that ends an OpenAI stream.
const Done = "[DONE]"

// Reader reads the data of the events of a stream.
type Reader struct {
	sc   *bufio.Scanner
	data []byte
}

// NewReader reads the events of r.
func NewReader(r io.Reader) *Reader {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), MaxLine)
	return &Reader{sc: sc}
}

// Next returns the data of the next event, valid until the next call, or
// io.EOF after the last. A read error of the stream, and bufio.ErrTooLong
// for a line over MaxLine, come back as they are, for the caller to wrap:
// a cut connection reads as io.ErrUnexpectedEOF, for example.
func (r *Reader) Next() ([]byte, error) {
	r.data = r.data[:0]
	has := false
	for r.sc.Scan() {
		line := r.sc.Bytes()
		if len(line) == 0 {
			if has {
				return r.data, nil
			}
			continue
		}
		name, value, _ := bytes.Cut(line, []byte(":"))
		if string(name) != "data" {
			continue
		}
		if has {
			r.data = append(r.data, '\n')
		}
		r.data = append(r.data, bytes.TrimPrefix(value, []byte(" "))...)
		has = true
	}
	if err := r.sc.Err(); err != nil {
		return nil, err
	}
	if has {
		return r.data, nil
	}
	return nil, io.EOF
}
