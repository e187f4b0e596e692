package httpapi

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/worker/sim"
)

// sseReader reads the data lines of a server-sent event stream.
type sseReader struct{ sc *bufio.Scanner }

func newSSEReader(resp *http.Response) *sseReader {
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 1<<16), 1<<24)
	return &sseReader{sc: sc}
}

// next returns the next event's data, or false at the end of the stream.
func (r *sseReader) next() (string, bool) {
	for r.sc.Scan() {
		if data, ok := strings.CutPrefix(r.sc.Text(), "data: "); ok {
			return data, true
		}
	}
	return "", false
}

// startStream posts body and returns the open streaming response.
func (a *api) startStream(t *testing.T, ctx context.Context, path, body string) *http.Response {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, a.base+path, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	resp, err := a.client.Do(req)
	require.NoError(t, err)
	t.Cleanup(func() { resp.Body.Close() })
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, "text/event-stream", resp.Header.Get("Content-Type"))
	wantIDs(t, resp)
	return resp
}

// TestStreamFlushAndDisconnect: each chunk is flushed as it comes, and a
// client that goes away aborts the request on the worker.
func TestStreamFlushAndDisconnect(t *testing.T) {
	// Six decode steps of 500ms: the whole answer is far smaller than the
	// server's write buffer, so without a flush per chunk nothing would
	// reach the client before the request ends.
	c := startCluster(t, orchestratortest.Options{Sim: sim.Config{DecodeTokenLatency: 500 * time.Millisecond}})
	a := startAPI(t, c, Config{}, nil, nil)
	abort0 := counter(t, c, "troupe_request_success_total", "0", "finished_reason", "abort")
	ctx, cancel := context.WithCancel(testCtx(t))
	resp := a.startStream(t, ctx, "/v1/chat/completions",
		`{"model":"troupe-omni-sim","messages":[{"role":"user","content":"go on"}],"max_tokens":6,"ignore_eos":true,"stream":true}`)
	events := newSSEReader(resp)
	role, ok := events.next()
	require.True(t, ok)
	assert.Contains(t, role, `"role":"assistant"`)
	text, ok := events.next()
	require.True(t, ok)
	var ch chatChunk
	require.NoError(t, json.Unmarshal([]byte(text), &ch))
	require.Len(t, ch.Choices, 1)
	require.NotNil(t, ch.Choices[0].Delta.Content)
	assert.NotEmpty(t, *ch.Choices[0].Delta.Content)
	// The first token reached us while the request still runs.
	assert.Equal(t, int64(1), inFlight(c, 0))

	cancel()
	require.Eventually(t, func() bool {
		return inFlight(c, 0) == 0 &&
			counter(t, c, "troupe_request_success_total", "0", "finished_reason", "abort")-abort0 == 1
	}, wait, 10*time.Millisecond, "the request must be aborted on the worker")
}

// TestSlowStreams runs requests that take a while on a sim whose every
// decode step takes 20ms.
func TestSlowStreams(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{Sim: sim.Config{DecodeTokenLatency: 20 * time.Millisecond}})
	// A long request: 2000 steps of 20ms, far beyond every bound below.
	const long = `{"model":"troupe-omni-sim","messages":[{"role":"user","content":"go on"}],"max_tokens":2000,"ignore_eos":true,"stream":true}`

	t.Run("a stream outlives the server's read timeout", func(t *testing.T) {
		a := startAPI(t, c, Config{}, nil, func(s *http.Server) { s.ReadTimeout = 200 * time.Millisecond })
		// 60 steps of 20ms: well past the read timeout.
		resp := a.startStream(t, testCtx(t), "/v1/completions",
			`{"model":"troupe-omni-sim","prompt":"go on","max_tokens":60,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`)
		events := newSSEReader(resp)
		var last, data string
		var text strings.Builder
		for {
			d, ok := events.next()
			if !ok {
				break
			}
			last, data = data, d
			var ch textCompletion
			if d != "[DONE]" {
				require.NoError(t, json.Unmarshal([]byte(d), &ch), d)
				for _, choice := range ch.Choices {
					text.WriteString(choice.Text)
				}
			}
		}
		assert.Equal(t, "[DONE]", data)
		var final struct{ Usage usage }
		require.NoError(t, json.Unmarshal([]byte(last), &final))
		assert.Equal(t, 60, final.Usage.CompletionTokens)
		assert.NotEmpty(t, text.String())
	})

	t.Run("request timeout", func(t *testing.T) {
		a := startAPI(t, c, Config{RequestTimeout: 300 * time.Millisecond}, nil, nil)
		resp, body := a.post(t, "/v1/chat/completions", strings.Replace(long, `"stream":true`, `"stream":false`, 1))
		wantError(t, resp, body, http.StatusGatewayTimeout, typeServer, "timeout")

		// A stream that has begun ends with an error event and no [DONE].
		events := newSSEReader(a.startStream(t, testCtx(t), "/v1/chat/completions", long))
		var data string
		n := 0
		for {
			d, ok := events.next()
			if !ok {
				break
			}
			data = d
			n++
		}
		assert.Greater(t, n, 1)
		var eb errorBody
		require.NoError(t, json.Unmarshal([]byte(data), &eb), data)
		require.NotNil(t, eb.Error.Code)
		assert.Equal(t, "timeout", *eb.Error.Code)
	})
}

// TestTracing checks the server span, its name and its place in the trace,
// and the headers that carry it.
func TestTracing(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()), sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	c := startCluster(t, orchestratortest.Options{HeadTracer: tp})
	a := startAPI(t, c, Config{TracerProvider: tp}, nil, nil)

	spanByID := func(id trace.SpanID) sdktrace.ReadOnlySpan {
		for _, s := range rec.Ended() {
			if s.SpanContext().SpanID() == id {
				return s
			}
		}
		return nil
	}
	parse := func(tp string) (trace.TraceID, trace.SpanID) {
		require.Regexp(t, traceparentRE, tp)
		parts := strings.Split(tp, "-")
		tid, err := trace.TraceIDFromHex(parts[1])
		require.NoError(t, err)
		sid, err := trace.SpanIDFromHex(parts[2])
		require.NoError(t, err)
		return tid, sid
	}

	resp, body := a.post(t, "/v1/completions", `{"model":"troupe-omni-sim","prompt":"hi","max_tokens":3}`)
	require.Equal(t, http.StatusOK, resp.StatusCode, "body: %s", body)
	assert.True(t, strings.HasSuffix(resp.Header.Get("Traceparent"), "-01"), "sampled")
	tid, sid := parse(resp.Header.Get("Traceparent"))
	var server sdktrace.ReadOnlySpan
	require.Eventually(t, func() bool { server = spanByID(sid); return server != nil }, wait, 5*time.Millisecond)
	assert.Equal(t, "POST /v1/completions", server.Name())
	assert.Equal(t, trace.SpanKindServer, server.SpanKind())
	assert.Equal(t, tid, server.SpanContext().TraceID())
	assert.Contains(t, server.Attributes(), attribute.String("troupe.request.id", resp.Header.Get("X-Request-Id")))
	var request sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == "troupe.request" && s.SpanContext().TraceID() == tid {
			request = s
		}
	}
	require.NotNil(t, request, "the head's request span is in the same trace")
	assert.Equal(t, sid, request.Parent().SpanID(), "troupe.request is the server span's child")
	assert.Contains(t, request.Attributes(), attribute.String("gen_ai.operation.name", "text_completion"))

	// Routes name their span by pattern; unmatched requests by method.
	for _, tc := range []struct{ method, path, name string }{
		{"POST", "/v1/replicas/thinker/0/wake_up", "POST /v1/replicas/{stage}/{replica}/wake_up"},
		{"GET", "/v1/models", "GET /v1/models"},
		{"GET", "/nowhere", "GET"},
	} {
		resp, _ := a.do(t, tc.method, tc.path, nil, nil)
		_, sid := parse(resp.Header.Get("Traceparent"))
		var s sdktrace.ReadOnlySpan
		require.Eventually(t, func() bool { s = spanByID(sid); return s != nil }, wait, 5*time.Millisecond)
		assert.Equal(t, tc.name, s.Name())
	}

	// The caller's trace context is the parent...
	const parentTrace, parentSpan = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	incoming := http.Header{"Traceparent": {"00-" + parentTrace + "-" + parentSpan + "-01"}, "X-Request-Id": {"has space"}}
	resp, _ = a.do(t, "GET", "/v1/models", nil, incoming)
	tid, sid = parse(resp.Header.Get("Traceparent"))
	assert.Equal(t, parentTrace, tid.String())
	assert.NotEqual(t, parentSpan, sid.String())
	assert.Regexp(t, `^[0-9a-f]{32}$`, resp.Header.Get("X-Request-Id"), "an unusable client id is replaced")

	// ...unless it is untrusted: then a new root that links to it.
	untrusted := startAPI(t, c, Config{TracerProvider: tp, UntrustedParent: true}, nil, nil)
	resp, _ = untrusted.do(t, "GET", "/v1/models", nil, incoming)
	tid, sid = parse(resp.Header.Get("Traceparent"))
	assert.NotEqual(t, parentTrace, tid.String())
	var s sdktrace.ReadOnlySpan
	require.Eventually(t, func() bool { s = spanByID(sid); return s != nil }, wait, 5*time.Millisecond)
	require.Len(t, s.Links(), 1)
	assert.Equal(t, parentTrace, s.Links()[0].SpanContext.TraceID().String())
	assert.False(t, s.Parent().IsValid())

	// Without a provider (nothing is traced), ids exist but are never
	// sampled, and the bare server span still continues the caller's trace
	// (or, untrusted, starts its own).
	plain := startAPI(t, c, Config{}, nil, nil)
	resp, _ = plain.do(t, "GET", "/healthz", http.NoBody, http.Header{"X-Request-Id": {"probe-1"}})
	assert.True(t, strings.HasSuffix(resp.Header.Get("Traceparent"), "-00"), resp.Header.Get("Traceparent"))
	assert.Equal(t, "probe-1", resp.Header.Get("X-Request-Id"))
	resp, _ = plain.do(t, "GET", "/v1/models", nil, incoming)
	tid, sid = parse(resp.Header.Get("Traceparent"))
	assert.Equal(t, parentTrace, tid.String(), "the caller's trace goes on")
	assert.NotEqual(t, parentSpan, sid.String())
	plainUntrusted := startAPI(t, c, Config{UntrustedParent: true}, nil, nil)
	resp, _ = plainUntrusted.do(t, "GET", "/v1/models", nil, incoming)
	tid, _ = parse(resp.Header.Get("Traceparent"))
	assert.NotEqual(t, parentTrace, tid.String(), "an untrusted caller's trace is not continued")
}
