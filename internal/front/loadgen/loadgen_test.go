package loadgen

import (
	"context"
	"encoding/base64"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestParseSLO(t *testing.T) {
	slo, err := ParseSLO("ttft=500ms, itl=50ms,ttfa=0.8s,e2e=10s,rtf=1.5")
	require.NoError(t, err)
	assert.Equal(t, SLO{TTFTMS: 500, ITLMS: 50, TTFAMS: 800, E2EMS: 10000, RTF: 1.5}, slo)
	for _, bad := range []string{"ttft", "ttft=fast", "rtf=0", "tbt=5ms", "e2e=-1s"} {
		_, err := ParseSLO(bad)
		assert.Error(t, err, bad)
	}
	ok := Record{Outcome: OutcomeOK, TTFTMS: 400, ITLMS: []float64{40, 60}, TTFAMS: 700, E2EMS: 9000, RTF: 2}
	assert.True(t, slo.met(ok))
	late := ok
	late.RTF = 1
	assert.False(t, slo.met(late), "an RTF below the objective misses it")
	noAudio := ok
	noAudio.TTFAMS = 0
	assert.False(t, slo.met(noAudio), "no audio misses a TTFA objective")
	shed := ok
	shed.Outcome = OutcomeShed
	assert.False(t, slo.met(shed))
}

func TestReadTraceRefuses(t *testing.T) {
	for name, text := range map[string]string{
		"empty":      "\n\n",
		"no prompt":  `{"at_ms":1}`,
		"negative":   `{"at_ms":-1,"prompt":"x"}`,
		"unordered":  "{\"at_ms\":5,\"prompt\":\"x\"}\n{\"at_ms\":1,\"prompt\":\"y\"}",
		"not json":   "at 5 say x",
		"wrong type": `{"at_ms":"5","prompt":"x"}`,
	} {
		_, err := ReadTrace(strings.NewReader(text))
		assert.Error(t, err, name)
	}
}

// TestAudioPlayback: a server that sends 100 ms of audio, then another
// 100 ms 300 ms later: the player starting at the first piece runs dry
// once; the RTF is 0.2 s of audio over about 0.3 s (the client may
// date the first piece a little after the server's timer started).
func TestAudioPlayback(t *testing.T) {
	piece := base64.StdEncoding.EncodeToString(make([]byte, 2*2400)) // 100 ms at 24 kHz
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		send := func(s string) {
			fmt.Fprintf(w, "data: %s\n\n", s)
			w.(http.Flusher).Flush()
		}
		send(`{"choices":[{"delta":{"content":"hi","audio":{"transcript":"hi"}}}]}`)
		send(`{"choices":[{"delta":{"audio":{"data":"` + piece + `"}}}]}`)
		select {
		case <-time.After(300 * time.Millisecond):
		case <-r.Context().Done():
			return
		}
		send(`{"choices":[{"delta":{"audio":{"data":"` + piece + `"}}}]}`)
		send(`[DONE]`)
	}))
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := Run(ctx, Config{BaseURL: srv.URL, Model: "m", Workload: WorkloadAudio, Concurrency: 1, Requests: 1,
		MaxTokens: 4, PromptWords: 2, SampleRate: 24000, Voice: "alloy"}, nil)
	require.NoError(t, err)
	require.Len(t, res.Records, 1)
	rec := res.Records[0]
	require.Equal(t, OutcomeOK, rec.Outcome, rec.Error)
	assert.InDelta(t, 0.2, rec.AudioSeconds, 1e-9)
	assert.Equal(t, 1, rec.Underruns)
	assert.Greater(t, rec.TTFAMS, 0.0)
	assert.LessOrEqual(t, rec.RTF, 0.2/0.25)
	assert.Greater(t, rec.RTF, 0.0)
}

// TestStreamErrorEventFails: an error event, or a stream cut before
// [DONE], is a failed request, not a good one.
func TestStreamErrorEventFails(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n")
		if r.Header.Get("Authorization") == "Bearer k" {
			fmt.Fprint(w, "data: {\"error\":{\"message\":\"replica lost\"}}\n\n")
		}
	}))
	defer srv.Close()
	for _, key := range []string{"k", ""} {
		res, err := Run(context.Background(), Config{BaseURL: srv.URL, APIKey: key, Model: "m", Workload: WorkloadStream,
			Concurrency: 2, Requests: 3, MaxTokens: 4, PromptWords: 2, SampleRate: 24000}, nil)
		require.NoError(t, err)
		assert.Equal(t, 3, res.Sent)
		assert.Equal(t, 3, res.Failed, key)
		assert.Equal(t, 0.0, res.Goodput)
		assert.Equal(t, 1.0, res.FailedShare)
	}
}

// TestStreamEventEdges: the stream is read by pkg/sse's rules, not line by
// line: "data:" without a space, comments, CRLF, data lines joined into
// one event, a delta over bufio.Scanner's default 64 KiB, and a [DONE]
// that no blank line ends all read as the server meant them.
func TestStreamEventEdges(t *testing.T) {
	long := strings.Repeat("x", 100<<10)
	stream := ": ping\r\n" +
		"data:{\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\r\n\r\n" +
		"data: {\"choices\":[{\"delta\":\ndata: {\"content\":\"b\"}}]}\n\n" +
		"data: {\"choices\":[{\"delta\":{\"content\":\"" + long + "\"}}]}\n\n" +
		"data: [DONE]"
	var rec Record
	now := 0.0
	err := (&client{sampleRate: 24000}).readStream(strings.NewReader(stream), &rec, func() float64 { now++; return now })
	require.NoError(t, err)
	assert.Equal(t, 3, rec.Deltas)

	err = (&client{sampleRate: 24000}).readStream(strings.NewReader("data: {\"choices\":[]}\n\ndata:\n\n"), &Record{}, func() float64 { return 0 })
	assert.ErrorContains(t, err, "loadgen: decoding an event")
}

// A stream that a troupe head stopped at its target after the text began
// (a deadline_missed error event: the first audio was late), or that a
// later stage's admission refused (deadline_unmeetable), is shed, not
// failed, as the same codes' 503 and 429 before the stream would be.
func TestStreamDeadlineMissedIsShed(t *testing.T) {
	for _, code := range []string{"deadline_missed", "deadline_unmeetable"} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n")
			fmt.Fprintf(w, "data: {\"error\":{\"type\":\"server_error\",\"code\":%q,\"message\":\"late\"}}\n\n", code)
		}))
		res, err := Run(context.Background(), Config{BaseURL: srv.URL, Model: "m", Workload: WorkloadStream,
			Concurrency: 1, Requests: 2, MaxTokens: 4, PromptWords: 2, SampleRate: 24000}, nil)
		srv.Close()
		require.NoError(t, err)
		assert.Equal(t, 2, res.Shed, code)
		assert.Equal(t, 0, res.Failed, code)
		assert.Equal(t, 1.0, res.ShedShare, code)
	}
}

// TestClosedLoopHonoursRetryAfter: a closed-loop client refused with
// Retry-After waits that long before its next request, as OpenAI's
// clients do, instead of sending again at once; the record keeps it.
func TestClosedLoopHonoursRetryAfter(t *testing.T) {
	var mu sync.Mutex
	var arrivals []time.Time
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		arrivals = append(arrivals, time.Now())
		first := len(arrivals) == 1
		mu.Unlock()
		if first {
			w.Header().Set("Retry-After", "1")
			http.Error(w, `{"error":{"code":"deadline_unmeetable"}}`, http.StatusTooManyRequests)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"choices":[{"message":{"content":"ok"}}]}`)
	}))
	defer srv.Close()
	res, err := Run(context.Background(), Config{BaseURL: srv.URL, Model: "m", Workload: WorkloadChat,
		Concurrency: 1, Requests: 2, MaxTokens: 4, PromptWords: 2, SampleRate: 24000}, nil)
	require.NoError(t, err)
	assert.Equal(t, 1, res.Shed)
	assert.Equal(t, 1, res.OK)
	require.Len(t, arrivals, 2)
	assert.GreaterOrEqual(t, arrivals[1].Sub(arrivals[0]), time.Second, "the second request waited for Retry-After")
	require.Len(t, res.Records, 2)
	assert.Equal(t, 1000.0, res.Records[0].RetryAfterMS)
	assert.Equal(t, 8.0*1000, retryAfter("8"))
	assert.Equal(t, float64(maxRetryAfter/time.Millisecond), retryAfter("3600"), "bounded")
	assert.Zero(t, retryAfter("Wed, 21 Oct 2015 07:28:00 GMT"))
}
