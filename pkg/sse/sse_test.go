package sse_test

import (
	"bufio"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/openai/openai-go/v3/packages/ssestream"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/pkg/sse"
)

// events reads all of in's events with sse.Reader.
func events(t testing.TB, in string) ([]string, error) {
	t.Helper()
	r := sse.NewReader(strings.NewReader(in))
	var out []string
	for {
		data, err := r.Next()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return out, err
		}
		out = append(out, string(data))
	}
}

// TestReader holds the package's rules, each on the stream that shows it.
func TestReader(t *testing.T) {
	for name, tc := range map[string]struct {
		in   string
		want []string
	}{
		"openai stream":             {"data: {\"a\":1}\n\ndata: [DONE]\n\n", []string{`{"a":1}`, sse.Done}},
		"crlf":                      {"data: a\r\n\r\ndata: b\r\n\r\n", []string{"a", "b"}},
		"no space after the colon":  {"data:a\n\n", []string{"a"}},
		"only one space is dropped": {"data:  a \n\n", []string{" a "}},
		"data lines joined":         {"data: {\"a\":\ndata: 1}\n\n", []string{"{\"a\":\n1}"}},
		"comments and other fields": {": ping\nevent: x\nid: 7\nretry: 10\ndata: a\n\n:\n\n", []string{"a"}},
		"event without data":        {"event: x\n\n\n\ndata: a\n\n", []string{"a"}},
		"empty data":                {"data:\n\ndata\n\n", []string{"", ""}},
		"field name before colon":   {"data : a\ndatum: b\nData: c\n\n", nil},
		"unterminated at the end":   {"data: a\n\ndata: b\ndata: c", []string{"a", "b\nc"}},
		"unterminated after a line": {"data: [DONE]\n", []string{sse.Done}},
		"empty":                     {"", nil},
		"long line":                 {"data: " + strings.Repeat("x", 1<<20) + "\n\n", []string{strings.Repeat("x", 1<<20)}},
	} {
		got, err := events(t, tc.in)
		require.NoError(t, err, name)
		assert.Equal(t, tc.want, got, name)
	}
}

// TestReaderErrors: the stream's own error comes back as it is (the
// openai worker's message names it), and a line over MaxLine is
// bufio.ErrTooLong, after the events before it.
func TestReaderErrors(t *testing.T) {
	r := sse.NewReader(io.MultiReader(strings.NewReader("data: a\n\ndata: b"), iotest.ErrReader(io.ErrUnexpectedEOF)))
	data, err := r.Next()
	require.NoError(t, err)
	assert.Equal(t, "a", string(data))
	_, err = r.Next()
	assert.Same(t, io.ErrUnexpectedEOF, err)

	got, err := events(t, "data: a\n\ndata: "+strings.Repeat("x", sse.MaxLine)+"\n\n")
	assert.ErrorIs(t, err, bufio.ErrTooLong)
	assert.Equal(t, []string{"a"}, got)
}

// ssestreamEvents reads in's events with openai-go's decoder, each event's
// data without the "\n" it ends every data line with.
func ssestreamEvents(in string) ([]string, error) {
	d := ssestream.NewDecoder(&http.Response{
		Header: http.Header{"Content-Type": {"text/event-stream"}},
		Body:   io.NopCloser(strings.NewReader(in)),
	})
	var out []string
	for d.Next() {
		out = append(out, strings.TrimSuffix(string(d.Event().Data), "\n"))
	}
	return out, d.Err()
}

// FuzzMatchesSSEStream compares the reader with openai-go's ssestream
// decoder on the streams both accept. ssestream drops an event no blank
// line ended, so it reads the stream with one more blank line at its end.
func FuzzMatchesSSEStream(f *testing.F) {
	for _, s := range []string{
		"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n",
		"data: a\r\n\r\n: comment\r\nevent: e\r\ndata:b\r\ndata:  c\r\n\r\n",
		"data\n\ndata:\n\n\n\nid: 1\n\n",
		"data: a\ndata: b",
		"data: a\n\ndata: b\n",
		"data: a\r",
		"event: x\n\n:\n\ndata : no\n\ndata:x:y\n\n",
		"",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		ours, err := events(t, in)
		if err != nil {
			t.Skip("a line over MaxLine")
		}
		theirs, err := ssestreamEvents(in + "\n\n")
		if err != nil {
			t.Skip("ssestream refused it")
		}
		if !assert.Equal(t, theirs, ours, "%q", in) {
			return
		}
		// What the end of the stream does, a blank line does.
		terminated, err := events(t, in+"\n\n")
		require.NoError(t, err)
		assert.Equal(t, ours, terminated, "%q", in)
	})
}

// TestSSEStreamDropsUnterminated is why the reader is not ssestream's
// decoder: it drops the last event when no blank line ends it.
func TestSSEStreamDropsUnterminated(t *testing.T) {
	in := "data: {\"a\":1}\n\ndata: [DONE]\n"
	theirs, err := ssestreamEvents(in)
	require.NoError(t, err)
	assert.Equal(t, []string{`{"a":1}`}, theirs)
	ours, err := events(t, in)
	require.NoError(t, err)
	assert.Equal(t, []string{`{"a":1}`, sse.Done}, ours)
}
