package loadgen

import (
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
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
	err := (&client{sampleRate: 24000}).readStream(strings.NewReader(stream), &rec, 24000, func() float64 { now++; return now })
	require.NoError(t, err)
	assert.Equal(t, 3, rec.Deltas)

	err = (&client{sampleRate: 24000}).readStream(strings.NewReader("data: {\"choices\":[]}\n\ndata:\n\n"), &Record{}, 24000, func() float64 { return 0 })
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

// wavHeader is a 44-byte PCM16 mono WAV header at rate Hz for n bytes.
func wavHeader(rate, n int) []byte {
	h := make([]byte, 44)
	copy(h[0:], "RIFF")
	binary.LittleEndian.PutUint32(h[4:], uint32(36+n))
	copy(h[8:], "WAVEfmt ")
	binary.LittleEndian.PutUint32(h[16:], 16)
	binary.LittleEndian.PutUint16(h[20:], 1)
	binary.LittleEndian.PutUint16(h[22:], 1)
	binary.LittleEndian.PutUint32(h[24:], uint32(rate))
	binary.LittleEndian.PutUint32(h[28:], uint32(2*rate))
	binary.LittleEndian.PutUint16(h[32:], 2)
	binary.LittleEndian.PutUint16(h[34:], 16)
	copy(h[36:], "data")
	binary.LittleEndian.PutUint32(h[40:], uint32(n))
	return h
}

// TestAudioSampleRateFromServer: with no rate given, a run learns it from
// a whole answer's WAV header before it starts (a server at 16000 Hz:
// 32000 bytes are one second, not the 0.67 s OpenAI's 24000 Hz would
// make), and an answer's X-Audio-Sample-Rate header wins for its own
// audio; a server that cannot say fails the run before any request.
func TestAudioSampleRateFromServer(t *testing.T) {
	var whole, streamed sync.Map
	var header atomic.Value
	header.Store("")
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body chatBody
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		if !body.Stream {
			whole.Store(body.Audio["format"], true)
			pcm := make([]byte, 3200)
			wav := append(wavHeader(16000, len(pcm)), pcm...)
			fmt.Fprintf(w, `{"choices":[{"message":{"content":"hi","audio":{"data":%q}}}],"usage":{"completion_tokens":1}}`, base64.StdEncoding.EncodeToString(wav))
			return
		}
		streamed.Store(body.StreamOptions["include_usage"], true)
		if h := header.Load().(string); h != "" {
			w.Header().Set(SampleRateHeader, h)
		}
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n")
		fmt.Fprintf(w, "data: {\"choices\":[{\"delta\":{\"audio\":{\"data\":%q}}}]}\n\n", base64.StdEncoding.EncodeToString(make([]byte, 32000)))
		fmt.Fprint(w, "data: {\"choices\":[],\"usage\":{\"completion_tokens\":1}}\n\ndata: [DONE]\n\n")
	}))
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg := Config{BaseURL: srv.URL, Model: "m", Workload: WorkloadAudio, Concurrency: 1, Requests: 2, MaxTokens: 4, PromptWords: 2, Voice: "alloy"}
	res, err := Run(ctx, cfg, nil)
	require.NoError(t, err)
	_, askedWAV := whole.Load("wav")
	assert.True(t, askedWAV, "the probe asks for a whole WAV")
	_, askedUsage := streamed.Load(true)
	assert.True(t, askedUsage, "streamed requests ask for the usage")
	assert.Equal(t, 16000, res.SampleRate)
	require.Len(t, res.Records, 2, "the probe is not a record")
	for _, rec := range res.Records {
		assert.Equal(t, 16000, rec.SampleRate)
		assert.InDelta(t, 1.0, rec.AudioSeconds, 1e-9, "32000 bytes at 16000 Hz")
	}

	header.Store("8000")
	res, err = Run(ctx, cfg, nil)
	require.NoError(t, err)
	for _, rec := range res.Records {
		assert.Equal(t, 8000, rec.SampleRate, "the answer's header wins")
		assert.InDelta(t, 2.0, rec.AudioSeconds, 1e-9)
	}

	text := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, `{"choices":[{"message":{"content":"no audio here"}}]}`)
	}))
	defer text.Close()
	cfg.BaseURL = text.URL
	res, err = Run(ctx, cfg, nil)
	require.ErrorContains(t, err, "the answer has no audio")
	assert.Zero(t, res.Sent)

	for name, b := range map[string][]byte{"short": []byte("RIFF"), "not wave": []byte("RIFF0000AVI "), "no fmt": append([]byte("RIFF\x00\x00\x00\x00WAVEdata"), 0, 0, 0, 0)} {
		_, err := wavSampleRate(b)
		assert.Error(t, err, name)
	}
	rate, err := wavSampleRate(append(wavHeader(22050, 0)[:12], append([]byte("LIST\x03\x00\x00\x00abc\x00"), wavHeader(22050, 0)[12:]...)...))
	require.NoError(t, err)
	assert.Equal(t, 22050, rate, "a chunk before fmt (odd sized, padded) is skipped")
}

// TestITLNotes: answers whose deltas come as one burst, or in one delta,
// make an ITL that says nothing of the decoding: the table says so; paced
// deltas make no note. TPOT follows vllm bench serve's definition.
func TestITLNotes(t *testing.T) {
	var mode atomic.Value
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		switch mode.Load().(string) {
		case "burst": // one write: every delta at once
			fmt.Fprint(w, strings.Repeat("data: {\"choices\":[{\"delta\":{\"content\":\"a \"}}]}\n\n", 4)+
				"data: {\"choices\":[],\"usage\":{\"completion_tokens\":4}}\n\ndata: [DONE]\n\n")
		case "one delta":
			fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"a b c d\"}}]}\n\n"+
				"data: {\"choices\":[],\"usage\":{\"completion_tokens\":4}}\n\ndata: [DONE]\n\n")
		case "paced":
			for range 4 {
				fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"a \"}}]}\n\n")
				w.(http.Flusher).Flush()
				select {
				case <-time.After(5 * time.Millisecond): // the server's pace, not a wait for a condition
				case <-r.Context().Done():
					return
				}
			}
			fmt.Fprint(w, "data: [DONE]\n\n") // no usage: the deltas count
		}
	}))
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	run := func(m string) (RunResult, string) {
		mode.Store(m)
		res, err := Run(ctx, Config{BaseURL: srv.URL, Model: "m", Workload: WorkloadStream, Concurrency: 1, Requests: 3, MaxTokens: 4, PromptWords: 2}, nil)
		require.NoError(t, err)
		var b strings.Builder
		require.NoError(t, WriteTable(&b, []RunResult{res}))
		return res, b.String()
	}
	res, table := run("burst")
	// A loaded machine (CI, -race) may stretch one answer's parsing past
	// the burst's millisecond: the note then needs nine in ten, which
	// three answers cannot give with one stretched.
	assert.GreaterOrEqual(t, res.BurstAnswers, 2, table)
	if res.BurstAnswers == 3 {
		assert.Contains(t, table, "note: concurrency 1: ITL and TPOT are about 0: the text deltas of 3 of the 3 answers came within 1ms of their first, as one burst")
	} else {
		assert.NotContains(t, table, "note:", "two in three is not nine in ten")
	}
	assert.Empty(t, itlNote(RunResult{StreamedAnswers: 10, BurstAnswers: 8}), "two answers in ten paced: no note")
	assert.NotEmpty(t, itlNote(RunResult{StreamedAnswers: 10, BurstAnswers: 9}))
	assert.Equal(t, 12, res.TotalOutputTokens)

	res, table = run("one delta")
	assert.Equal(t, 3, res.OneDeltaAnswers)
	assert.Zero(t, res.ITL.N)
	assert.Contains(t, table, "note: concurrency 1: no ITL: each of the 3 answers came in one text delta of several tokens")
	assert.Equal(t, 3, res.TPOT.N, "TPOT needs no gaps: (E2E - TTFT) / 3")

	res, table = run("paced")
	assert.Equal(t, 3, res.StreamedAnswers)
	assert.Zero(t, res.BurstAnswers)
	assert.NotContains(t, table, "note:")
	assert.Equal(t, 12, res.TotalOutputTokens, "no usage: a token a delta")
	require.Len(t, res.Records, 3)
	for _, rec := range res.Records {
		assert.GreaterOrEqual(t, rec.TPOTMS, 4.0, "a delta every 5 ms")
		assert.InDelta(t, (rec.E2EMS-rec.TTFTMS)/3, rec.TPOTMS, 1e-9)
	}
	assert.InDelta(t, res.TPOT.Mean, res.VLLM["mean_tpot_ms"], 1e-9)
}
