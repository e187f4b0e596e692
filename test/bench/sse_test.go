package bench

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestReadDeltas: the stream is read by pkg/sse's rules: "data:" without
// a space, comments, CRLF, data lines joined into one event, a delta over
// bufio.Scanner's default 64 KiB, and a [DONE] that no blank line ends.
func TestReadDeltas(t *testing.T) {
	long := strings.Repeat("x", 100<<10)
	stream := ": ping\r\n" +
		"data:{\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\r\n\r\n" +
		"data: {\"choices\":[]}\n\n" +
		"data: {\"choices\":[{\"delta\":\ndata: {\"content\":\"b\"}}]}\n\n" +
		"data: {\"choices\":[{\"delta\":{\"content\":\"" + long + "\"}}]}\n\n" +
		"data: [DONE]"
	var got []string
	done, err := ReadDeltas(strings.NewReader(stream), func(s string) { got = append(got, s) })
	require.NoError(t, err)
	assert.True(t, done)
	assert.Equal(t, []string{"a", "b", long}, got)

	done, err = ReadDeltas(strings.NewReader("data: {\"choices\":[]}\n\n"), func(string) {})
	require.NoError(t, err)
	assert.False(t, done, "no [DONE]")
}

// TestReadChunks: each chunk's first delta, audio and its transcript
// included, as it arrives.
func TestReadChunks(t *testing.T) {
	stream := "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n" +
		"data: {\"choices\":[{\"delta\":{\"audio\":{\"data\":\"AAAA\",\"transcript\":\"hi\"}}}]}\n\n" +
		"data: [DONE]\n\n"
	var got []Delta
	done, err := ReadChunks(strings.NewReader(stream), func(d Delta) { got = append(got, d) })
	require.NoError(t, err)
	assert.True(t, done)
	require.Len(t, got, 2)
	assert.Equal(t, "hi", got[0].Content)
	assert.Nil(t, got[0].Audio)
	require.NotNil(t, got[1].Audio)
	assert.Equal(t, "AAAA", got[1].Audio.Data)
	assert.Equal(t, "hi", got[1].Audio.Transcript)
}
