package main

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"io"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// summaryRE is talk's line after each response.
var summaryRE = regexp.MustCompile(`(?m)^\[time to first audio (\S+), audio ([0-9.]+)s, status (\w+)\]$`)

// talkRun runs `troupe talk args...` as the CLI does and returns its exit
// status, stdout and stderr.
func talkRun(args ...string) (code int, stdout, stderr string) {
	var out, errOut bytes.Buffer
	code = run(append([]string{"talk"}, args...), &out, &errOut)
	return code, out.String(), errOut.String()
}

// toneWAV is a WAV file of seconds of a sine at hz.
func toneWAV(rate int, hz, seconds float64) []byte {
	pcm := make([]byte, 2*int(float64(rate)*seconds))
	for i := range len(pcm) / 2 {
		v := int16(8000 * math.Sin(2*math.Pi*hz*float64(i)/float64(rate)))
		binary.LittleEndian.PutUint16(pcm[2*i:], uint16(v))
	}
	return pcm16WAV(pcm, rate)
}

// TestTalkAgainstUp runs talk against a real head with sim workers (troupe
// up): a text turn answered in audio saved as a WAV, a WAV turn, and a
// multi-turn session from stdin.
func TestTalkAgainstUp(t *testing.T) {
	up := background(t, "up", runUp, "--http", "127.0.0.1:0", "--log-level", "error")
	base := up.wait(t, apiRE)
	up.wait(t, regexp.MustCompile(`(Press Ctrl-C)`))
	dir := t.TempDir()

	t.Run("text to a WAV", func(t *testing.T) {
		want := chat(t, base, `{"model":"troupe-omni-sim","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Say hello."}]}`).Choices[0].Message.Content
		require.NotEmpty(t, want)
		var printed []string
		for i := range 2 {
			out := filepath.Join(dir, "answer.wav")
			code, stdout, stderr := talkRun("--url", base, "--text", "Say hello.", "--instructions", "Be brief.", "--voice", "alloy", "--out", out)
			require.Equal(t, 0, code, "run %d: %s", i, stderr)
			m := summaryRE.FindStringSubmatch(stdout)
			require.NotNil(t, m, "no summary line in %q", stdout)
			assert.Equal(t, "completed", m[3])
			assert.NotEqual(t, "-", m[1], "an audio answer has a time to first audio")
			text, _, _ := strings.Cut(stdout, "\n[time to first audio")
			printed = append(printed, text)

			b, err := os.ReadFile(out)
			require.NoError(t, err)
			pcm, err := readPCM16WAV(b)
			require.NoError(t, err, "the written file is a PCM16 mono 24000 Hz WAV")
			assert.NotEmpty(t, pcm)
			secs, err := strconv.ParseFloat(m[2], 64)
			require.NoError(t, err)
			assert.InDelta(t, float64(len(pcm)/2)/talkSampleRate, secs, 0.005, "the summary counts the file's audio")
		}
		assert.Equal(t, want, printed[0], "the transcript is what a chat request with the same messages answers")
		assert.Equal(t, printed[0], printed[1], "deterministic")
	})

	t.Run("WAV in", func(t *testing.T) {
		in := filepath.Join(dir, "tone.wav")
		require.NoError(t, os.WriteFile(in, toneWAV(talkSampleRate, 440, 0.5), 0o644))
		code, stdout, stderr := talkRun("--url", base+"/v1", "--wav", in, "--text-only")
		require.Equal(t, 0, code, stderr)
		m := summaryRE.FindStringSubmatch(stdout)
		require.NotNil(t, m, "no summary line in %q", stdout)
		assert.Equal(t, []string{"-", "0.00", "completed"}, m[1:], "a text answer has no audio")
		assert.NotEqual(t, "\n", stdout[:strings.Index(stdout, "[time")], "the answer's text is printed")
	})

	t.Run("turns from stdin", func(t *testing.T) {
		var out bytes.Buffer
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		err := talk(ctx, []string{"--url", base, "--text-only", "--turns", "0"}, strings.NewReader("Hi.\nAnd again.\n"), &out)
		require.NoError(t, err)
		ms := summaryRE.FindAllStringSubmatch(out.String(), -1)
		require.Len(t, ms, 2, "one response per line, until EOF: %q", out.String())
		for _, m := range ms {
			assert.Equal(t, "completed", m[3])
		}
		out.Reset()
		require.NoError(t, talk(ctx, []string{"--url", base, "--text-only", "--turns", "1", "--text", "Hi."}, strings.NewReader("unread\n"), &out))
		assert.Len(t, summaryRE.FindAllString(out.String(), -1), 1, "--turns bounds the session")
	})

	t.Run("refusals", func(t *testing.T) {
		in := filepath.Join(dir, "16k.wav")
		require.NoError(t, os.WriteFile(in, toneWAV(16000, 440, 0.1), 0o644))
		code, _, stderr := talkRun("--url", base, "--wav", in)
		assert.Equal(t, 1, code)
		assert.Contains(t, stderr, "16000 Hz: want 24000 Hz")
		code, _, stderr = talkRun("--url", base, "--wav", in, "--text", "hi")
		assert.Equal(t, 1, code)
		assert.Contains(t, stderr, "--text and --wav both given")
		code, _, stderr = talkRun("--url", base, "--api-key-file", filepath.Join(dir, "missing"), "--text", "hi")
		assert.Equal(t, 1, code)
		assert.Contains(t, stderr, "--api-key-file")
		code, _, _ = talkRun("--url", base, "--api-key", "k")
		assert.Equal(t, 2, code, "no flag takes the key itself")
	})
}

// TestUpRealtimeLimits: troupe up's --realtime-* flags reach the head's
// realtime endpoint: the second session of --realtime-max-sessions 1 is
// closed with 1013, a message over --realtime-max-message-bytes with 1009,
// a session idle for --realtime-idle-timeout with 4000, an append past
// --realtime-max-input-audio-bytes with an error event; non-positive
// limits, and an items limit that cannot hold a full buffer's commit, are
// refused before anything starts.
func TestUpRealtimeLimits(t *testing.T) {
	for _, bad := range [][]string{{"--realtime-max-sessions", "0"}, {"--realtime-idle-timeout", "0s"},
		{"--realtime-max-items", "0"}, {"--realtime-max-input-audio-bytes", "1"},
		{"--realtime-max-items-bytes", "1MiB"}} {
		err := runUp(context.Background(), bad, io.Discard)
		assert.ErrorContains(t, err, bad[0], "%v", bad)
	}
	for _, size := range []string{"--realtime-max-message-bytes", "--realtime-memory-budget"} {
		assert.Error(t, runUp(context.Background(), []string{size, "0"}, io.Discard), "a size is positive")
	}
	up := background(t, "up", runUp, "--http", "127.0.0.1:0", "--log-level", "error",
		"--realtime-max-sessions", "1", "--realtime-max-message-bytes", "1KiB", "--realtime-idle-timeout", "500ms",
		"--realtime-max-input-audio-bytes", "256")
	base := up.wait(t, apiRE)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	url := "ws" + strings.TrimPrefix(base, "http") + "/v1/realtime"
	dial := func() *websocket.Conn {
		conn, _, err := websocket.Dial(ctx, url, nil)
		require.NoError(t, err)
		t.Cleanup(func() { _ = conn.CloseNow() })
		return conn
	}
	first := dial()
	_, data, err := first.Read(ctx)
	require.NoError(t, err)
	require.Contains(t, string(data), `"session.created"`)
	_, _, err = dial().Read(ctx)
	assert.Equal(t, websocket.StatusCode(1013), websocket.CloseStatus(err), "%v", err)

	pcm := base64.StdEncoding.EncodeToString(make([]byte, 300))
	require.NoError(t, first.Write(ctx, websocket.MessageText, []byte(`{"type":"input_audio_buffer.append","audio":"`+pcm+`"}`)))
	_, data, err = first.Read(ctx)
	require.NoError(t, err)
	assert.Contains(t, string(data), `"code":"input_audio_buffer_full"`)
	assert.Contains(t, string(data), "at most 256 bytes")

	require.NoError(t, first.Write(ctx, websocket.MessageText, []byte(`{"type":"x","pad":"`+strings.Repeat("a", 1100)+`"}`)))
	_, _, err = first.Read(ctx)
	assert.Equal(t, websocket.StatusMessageTooBig, websocket.CloseStatus(err), "%v", err)

	// The slot frees once the head has ended the first session.
	var idle *websocket.Conn
	require.Eventually(t, func() bool {
		c := dial()
		if _, data, err := c.Read(ctx); err == nil {
			require.Contains(t, string(data), `"session.created"`)
			idle = c
			return true
		}
		return false
	}, 30*time.Second, 10*time.Millisecond)
	_, _, err = idle.Read(ctx)
	assert.Equal(t, websocket.StatusCode(4000), websocket.CloseStatus(err), "%v", err)
}
