package httpapi

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"testing/iotest"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
)

// uploadHeader is a chat request's headers announcing a 100,000-byte body.
const uploadHeader = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"

// slowUpload sends uploadHeader, then calls send until it fails or the
// answer comes, and returns the answer: nil when the server closed the
// connection without one. The whole exchange is bounded by a deadline
// far inside the server's 60 s whole-request ReadTimeout, so only the
// body's own deadlines can end it in time.
func slowUpload(t *testing.T, a *api, send func(conn net.Conn) error) *http.Response {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(a.base, "http://"))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	require.NoError(t, conn.SetDeadline(time.Now().Add(30*time.Second)))
	_, err = io.WriteString(conn, uploadHeader)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(testCtx(t))
	defer cancel()
	sent := make(chan struct{})
	go func() {
		defer close(sent)
		for ctx.Err() == nil && send(conn) == nil {
		}
	}()
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	cancel()
	conn.Close() // ends a send blocked on a full socket
	<-sent
	if err != nil {
		var ne net.Error
		require.False(t, errors.As(err, &ne) && ne.Timeout(), "the upload was not cut within 30 s: %v", err)
		return nil
	}
	t.Cleanup(func() { resp.Body.Close() })
	return resp
}

// TestSlowUploadIsCut: a body trickled at a byte every 50 ms (20 B/s, a
// fraction of the 8 KiB/s minimum rate) is cut once the first idle period
// has passed, although no single pause reaches it and the announced size
// is large: 408 body_too_slow, counted in the HTTP metrics. A body that
// stops after a fast start is cut at the idle deadline, whatever credit
// its start earned. Neither reaches the head. (Issue 34: the only bound
// was the 60 s ReadTimeout.)
func TestSlowUploadIsCut(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{Pipeline: orchestrator.Pipeline{Model: model, Stages: []orchestrator.Stage{{Name: "thinker"}}}})

	// Traced: the deadlines reach the connection through otelhttp's
	// response writer too.
	traced := sdktrace.NewTracerProvider()
	t.Cleanup(func() { _ = traced.Shutdown(context.Background()) })
	for name, tp := range map[string]trace.TracerProvider{"trickle": nil, "trickle, traced": traced} {
		t.Run(name, func(t *testing.T) {
			reg := prometheus.NewRegistry()
			m, err := NewMetrics(reg)
			require.NoError(t, err)
			a := startAPI(t, c, Config{BodyIdleTimeout: 500 * time.Millisecond, Metrics: m, TracerProvider: tp}, nil, nil)
			tick := time.NewTicker(50 * time.Millisecond)
			defer tick.Stop()
			sent := 0
			resp := slowUpload(t, a, func(conn net.Conn) error {
				<-tick.C
				sent++
				_, err := conn.Write([]byte{' '})
				return err
			})
			require.NotNil(t, resp, "answered, not dropped")
			body, _ := io.ReadAll(resp.Body)
			wantError(t, resp, body, http.StatusRequestTimeout, "invalid_request_error", "body_too_slow")
			t.Logf("cut after %d of 100000 bytes: %s", sent, body)
			assert.Less(t, sent, 100000)
			assert.True(t, resp.Close, "the connection is closed after the answer")
			assert.Equal(t, 1.0, testutil.ToFloat64(m.requests.WithLabelValues("/v1/chat/completions", "post", "408")))
		})
	}

	t.Run("stall after a fast start", func(t *testing.T) {
		// A rate of 1 B/s: the 50,000 bytes sent at once earn hours of
		// credit, so only the idle deadline can cut it.
		a := startAPI(t, c, Config{BodyIdleTimeout: 500 * time.Millisecond, BodyMinRate: 1}, nil, nil)
		first := true
		resp := slowUpload(t, a, func(conn net.Conn) error {
			if !first {
				return io.EOF // then nothing: the connection stays open, silent
			}
			first = false
			_, err := conn.Write([]byte(`{"model":"troupe-omni-sim","messages":[{"role":"user","content":"` + strings.Repeat("a", 50000)))
			return err
		})
		require.NotNil(t, resp, "answered, not dropped")
		body, _ := io.ReadAll(resp.Body)
		wantError(t, resp, body, http.StatusRequestTimeout, "invalid_request_error", "body_too_slow")
	})
	assert.Zero(t, counter(t, c, "troupe_pipeline_requests_total", "", "outcome", "success")+
		counter(t, c, "troupe_pipeline_requests_total", "", "outcome", "bad_request"), "no upload reached the head")
}

// TestLargeUploadPasses: with the default body deadlines, a chat request
// carrying 6 MB of WAV audio (8 MB of JSON) sent at loopback speed through
// the official client is served.
func TestLargeUploadPasses(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{Pipeline: orchestrator.Pipeline{Model: model, Stages: []orchestrator.Stage{{Name: "thinker"}}}})
	a := startAPI(t, c, Config{}, nil, nil)
	pcm := make([]byte, 6<<20)
	for i := range pcm {
		pcm[i] = byte(i * 7)
	}
	client := a.openai()
	ctx, cancel := context.WithTimeout(testCtx(t), wait)
	defer cancel()
	got, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
		Model:     model,
		Messages:  []openai.ChatCompletionMessageParamUnion{audioMessage(wavOf(t, pcm))},
		MaxTokens: openai.Int(4),
	})
	require.NoError(t, err)
	require.NotEmpty(t, got.Choices)
	assert.NotEmpty(t, got.Choices[0].Message.Content, fmt.Sprintf("%+v", got.Choices[0]))
}

// TestReadAllSized: a body that announces its length is read into a
// buffer of exactly that length, whatever the size of its reads; one
// shorter than announced is an error, not a short body.
func TestReadAllSized(t *testing.T) {
	for _, n := range []int{1, 1000, 64 << 10, 64<<10 + 1, 300_000} {
		body := bytes.Repeat([]byte("abcdefg"), n/7+1)[:n]
		r := httptest.NewRequest(http.MethodPost, "/", iotest.OneByteReader(bytes.NewReader(body)))
		if n > 1000 {
			r = httptest.NewRequest(http.MethodPost, "/", bytes.NewReader(body))
		}
		r.ContentLength = int64(n)
		got, err := readAll(r)
		require.NoError(t, err, n)
		assert.Equal(t, body, got, n)
		assert.Equal(t, n, cap(got), "no spare capacity: %d", n)
	}
	r := httptest.NewRequest(http.MethodPost, "/", strings.NewReader("short"))
	r.ContentLength = 100
	_, err := readAll(r)
	assert.ErrorIs(t, err, io.ErrUnexpectedEOF)
}
