package main

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/internal/front/jaeger"
)

// The trace recorded from Jaeger v2 by pkg/telemetry's smoke test.
const recordedTraceID = "42062905e4d1f4777ffc2d79537e9403"

func recordedJaeger(t *testing.T) (url string, body []byte) {
	t.Helper()
	body, err := os.ReadFile(filepath.Join("..", "..", "internal", "front", "jaeger", "testdata", "jaeger_trace.json"))
	require.NoError(t, err)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/api/v3/traces/"+recordedTraceID {
			_, _ = w.Write(body)
			return
		}
		http.Error(w, `{"error":{"httpCode":404,"message":"trace not found"}}`, http.StatusNotFound)
	}))
	t.Cleanup(srv.Close)
	return srv.URL, body
}

func traceCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestTracePrintsWaterfall(t *testing.T) {
	url, body := recordedJaeger(t)
	tr, err := jaeger.ParseOTLPJSON(body)
	require.NoError(t, err)
	var want bytes.Buffer
	require.NoError(t, jaeger.RenderWaterfall(&want, tr, jaeger.WaterfallOptions{BarWidth: 30}))

	// Flags after the id, as the usage line shows them.
	var out bytes.Buffer
	require.NoError(t, runTrace(traceCtx(t), []string{recordedTraceID, "--jaeger", url, "--width", "30"}, &out))
	assert.Equal(t, want.String(), out.String())
	assert.Contains(t, out.String(), "! troupe.stage thinker")

	// Flags before it, a traceparent as the id, the URL from TROUPE_JAEGER.
	t.Setenv("TROUPE_JAEGER", url+"/")
	out.Reset()
	require.NoError(t, runTrace(traceCtx(t), []string{"--width=30", "00-" + recordedTraceID + "-00f067aa0ba902b7-01"}, &out))
	assert.Equal(t, want.String(), out.String())
}

func TestTraceNotFound(t *testing.T) {
	url, _ := recordedJaeger(t)
	var out bytes.Buffer
	err := runTrace(traceCtx(t), []string{"abc123", "--jaeger", url}, &out)
	require.Error(t, err)
	assert.Equal(t, "trace 00000000000000000000000000abc123 not found in "+url, err.Error())
	assert.Zero(t, out.Len())
}

func TestTraceUsageErrors(t *testing.T) {
	url, _ := recordedJaeger(t)
	for name, args := range map[string][]string{
		"no id":       {"--jaeger", url},
		"two ids":     {recordedTraceID, recordedTraceID, "--jaeger", url},
		"not hex":     {"trace-me", "--jaeger", url},
		"too long":    {strings.Repeat("a", 33), "--jaeger", url},
		"zero id":     {"0", "--jaeger", url},
		"bad width":   {recordedTraceID, "--jaeger", url, "--width", "2"},
		"bad flag":    {recordedTraceID, "--jager", url},
		"flag no val": {recordedTraceID, "--jaeger"},
	} {
		err := runTrace(traceCtx(t), args, &bytes.Buffer{})
		assert.ErrorIs(t, err, errUsage, name)
	}
}

func TestTraceJaegerUnreachable(t *testing.T) {
	srv := httptest.NewServer(http.NotFoundHandler())
	url := srv.URL
	srv.Close()
	err := runTrace(traceCtx(t), []string{recordedTraceID, "--jaeger", url, "--timeout", "5s"}, &bytes.Buffer{})
	require.Error(t, err)
	assert.NotErrorIs(t, err, errUsage)
	assert.True(t, strings.HasPrefix(err.Error(), "jaeger: query: "), err.Error())
	assert.NotContains(t, err.Error(), "not found")
}
