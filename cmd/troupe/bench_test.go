package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/internal/front/loadgen"
)

// bench runs `troupe bench args...` as the CLI does and returns its result
// file and its stdout.
func bench(t *testing.T, args ...string) (loadgen.Result, string) {
	t.Helper()
	out := filepath.Join(t.TempDir(), "result.json")
	var stdout, stderr bytes.Buffer
	code := run(append([]string{"bench", "--progress", "off", "--out", out}, args...), &stdout, &stderr)
	require.Equal(t, 0, code, "troupe bench %v: %s", args, stderr.String())
	f, err := os.Open(out)
	require.NoError(t, err)
	defer f.Close()
	res, err := loadgen.ReadResult(f)
	require.NoError(t, err)
	return res, stdout.String()
}

// TestBenchAgainstUp loads a real head with sim workers (troupe up) over
// HTTP with every built-in workload, a sweep and a trace.
func TestBenchAgainstUp(t *testing.T) {
	up := background(t, "up", runUp, "--http", "127.0.0.1:0", "--log-level", "error")
	base := up.wait(t, apiRE)
	up.wait(t, regexp.MustCompile(`(Press Ctrl-C)`))

	t.Run("audio", func(t *testing.T) {
		res, table := bench(t, "--url", base, "--workload", "audio", "--rate", "40", "--requests", "6", "--max-tokens", "8",
			"--ignore-eos", "--slo", "ttft=1h,ttfa=1h,rtf=0.001", "--records")
		require.Len(t, res.Runs, 1)
		r := res.Runs[0]
		assert.Equal(t, 6, r.Sent)
		assert.Equal(t, 6, r.OK, "errors: %v", r.Errors)
		assert.Equal(t, 6, r.TTFT.N)
		assert.Greater(t, r.TTFT.P50, 0.0)
		assert.Equal(t, 6, r.TTFA.N, "every answer has audio")
		assert.Greater(t, r.TTFA.P50, 0.0)
		assert.Greater(t, r.RTF.Min, 0.0)
		assert.LessOrEqual(t, r.Goodput, r.Throughput)
		assert.Equal(t, 6, r.MetSLO, "objectives of an hour are met")
		assert.Contains(t, table, "rate 40/s")
		// The rate comes from the server (a whole answer's WAV), not a flag.
		assert.Equal(t, 0, res.Config.SampleRate, "none given")
		assert.Equal(t, 24000, r.SampleRate, "the sim vocoder's rate, learned")
		assert.Contains(t, table, "audio measured at 24000 Hz")
		for _, rec := range r.Records {
			assert.Equal(t, 24000, rec.SampleRate)
			assert.Positive(t, rec.AudioBytes)
			assert.InDelta(t, float64(rec.AudioBytes/2)/24000, rec.AudioSeconds, 1e-9)
			assert.Equal(t, 8, rec.OutputTokens, "the usage's completion_tokens: --ignore-eos makes 8")
		}
		assert.Equal(t, 48, r.TotalOutputTokens)
		assert.InDelta(t, 48/r.WallSeconds, r.OutputThroughput, 1e-9)
		assert.Equal(t, 6, r.TPOT.N, "one TPOT per streamed answer")
	})
	t.Run("sweep", func(t *testing.T) {
		res, _ := bench(t, "--url", base+"/v1", "--workload", "stream", "--rate", "50,100", "--arrival", "constant", "--requests", "5", "--max-tokens", "8")
		require.Len(t, res.Runs, 2)
		for i, rate := range []float64{50, 100} {
			r := res.Runs[i]
			assert.Equal(t, rate, r.Rate)
			assert.Equal(t, 5, r.Sent)
			assert.Equal(t, 5, r.OK, "errors: %v", r.Errors)
			assert.Greater(t, r.TTFT.P50, 0.0)
			assert.Positive(t, r.ITL.N, "8 tokens streamed make gaps")
			assert.Equal(t, r.Throughput, r.Goodput, "without objectives every OK request is good")
			assert.Positive(t, r.TotalOutputTokens)
			assert.Positive(t, r.OutputThroughput)
			assert.Equal(t, r.OutputThroughput, r.VLLM["output_throughput"], "vllm bench serve's name")
			assert.Equal(t, r.TTFT.P50, r.VLLM["median_ttft_ms"])
			assert.Zero(t, r.SampleRate, "no audio asked")
		}
	})
	t.Run("chat and multiturn closed loop", func(t *testing.T) {
		for _, w := range []string{"chat", "multiturn"} {
			res, _ := bench(t, "--url", base, "--workload", w, "--concurrency", "3", "--requests", "7", "--max-tokens", "4",
				"--system-words", "20", "--records")
			r := res.Runs[0]
			assert.Equal(t, 7, r.Sent, w)
			assert.Equal(t, 7, r.OK, "%s errors: %v", w, r.Errors)
			assert.Len(t, r.Records, 7, w)
			assert.Greater(t, r.TTFT.P50, 0.0, w)
		}
	})
	t.Run("trace", func(t *testing.T) {
		trace := filepath.Join(t.TempDir(), "trace.jsonl")
		require.NoError(t, os.WriteFile(trace, []byte(`{"at_ms":0,"prompt":"hello there","max_tokens":4}
{"at_ms":20,"messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}],"max_tokens":6}

{"at_ms":40,"prompt":"say hi","max_tokens":4,"modalities":["text","audio"]}
{"at_ms":60,"prompt":"whole","max_tokens":4,"stream":false}
`), 0o600))
		res, table := bench(t, "--url", base, "--trace", trace, "--records")
		r := res.Runs[0]
		assert.Equal(t, "trace", r.Load)
		assert.Equal(t, 4, r.Sent)
		assert.Equal(t, 4, r.OK, "errors: %v", r.Errors)
		assert.Equal(t, 1, r.TTFA.N, "one request asked for audio")
		var deltas []int
		for _, rec := range r.Records {
			deltas = append(deltas, rec.Deltas)
		}
		assert.ElementsMatch(t, []int{4, 6, 4, 0}, deltas, "each trace request with its own max_tokens; the whole answer has no deltas")
		assert.Contains(t, table, "trace")
		assert.Equal(t, 24000, r.SampleRate, "a trace with audio learns the rate too")
	})
}

// TestBenchTPOT: against a head whose sim takes 3 ms a decode step, TPOT
// ((E2E - TTFT) / (tokens - 1), as vllm bench serve computes it) and ITL
// measure that step, the table prints means beside the percentiles under
// vllm bench serve's names, and no note says the ITL is void.
func TestBenchTPOT(t *testing.T) {
	up := background(t, "up", runUp, "--http", "127.0.0.1:0", "--log-level", "error", "--decode-latency", "3ms")
	base := up.wait(t, apiRE)
	up.wait(t, regexp.MustCompile(`(Press Ctrl-C)`))
	res, table := bench(t, "--url", base, "--workload", "stream", "--concurrency", "2", "--requests", "6", "--max-tokens", "10",
		"--ignore-eos", "--records")
	r := res.Runs[0]
	require.Equal(t, 6, r.OK, "errors: %v", r.Errors)
	assert.Equal(t, 60, r.TotalOutputTokens)
	assert.Equal(t, 6, r.TPOT.N)
	assert.GreaterOrEqual(t, r.TPOT.Min, 2.5, "a token every 3 ms at least")
	assert.GreaterOrEqual(t, r.ITL.P50, 2.5)
	for _, rec := range r.Records {
		assert.InDelta(t, (rec.E2EMS-rec.TTFTMS)/9, rec.TPOTMS, 1e-9, "vLLM's TPOT")
	}
	assert.Equal(t, 0, r.BurstAnswers)
	for _, col := range []string{"output tok/s", "TTFT mean/med/p99 ms", "TPOT mean/med/p99 ms", "ITL mean/med/p99 ms", "E2EL mean/med/p99 ms"} {
		assert.Contains(t, table, col)
	}
	assert.NotContains(t, table, "note: concurrency 2: ITL")
}

// TestBenchShedCountsAgainstGoodput: a server that answers every other
// request 429 has them counted as shed, and not in goodput.
func TestBenchShedCountsAgainstGoodput(t *testing.T) {
	var n atomic.Int64
	var answerAll atomic.Bool
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/chat/completions" {
			http.NotFound(w, r)
			return
		}
		if n.Add(1)%2 == 0 && !answerAll.Load() {
			w.Header().Set("Retry-After", "1")
			http.Error(w, `{"error":{"message":"busy"}}`, http.StatusTooManyRequests)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		for _, tok := range []string{"a", " b", " c"} {
			fmt.Fprintf(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":%q}}]}\n\n", tok)
			w.(http.Flusher).Flush()
		}
		fmt.Fprint(w, "data: [DONE]\n\n")
	}))
	defer srv.Close()

	res, table := bench(t, "--url", srv.URL, "--workload", "stream", "--concurrency", "1", "--requests", "10", "--slo", "ttft=1h")
	r := res.Runs[0]
	assert.Equal(t, 10, r.Sent)
	assert.Equal(t, 5, r.OK)
	assert.Equal(t, 5, r.Shed)
	assert.Equal(t, 0, r.Failed)
	assert.Equal(t, 0.5, r.ShedShare)
	assert.Equal(t, 5, r.MetSLO, "only the answered requests are good")
	assert.InDelta(t, 5/r.WallSeconds, r.Goodput, 1e-9)
	assert.Less(t, r.Goodput, float64(r.Sent)/r.WallSeconds, "shed requests count against goodput")
	assert.Contains(t, table, "status 429")

	// compare: the same server, now with every request answered
	answerAll.Store(true)
	other, _ := bench(t, "--url", srv.URL, "--workload", "stream", "--concurrency", "1", "--requests", "10")
	assert.Equal(t, 10, other.Runs[0].OK)
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a.json"), filepath.Join(dir, "b.json")
	for name, r := range map[string]loadgen.Result{a: res, b: other} {
		data, err := json.Marshal(r)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(name, data, 0o600))
	}
	var stdout, stderr bytes.Buffer
	require.Equal(t, 0, run([]string{"bench", "compare", a, b}, &stdout, &stderr), stderr.String())
	cmp := stdout.String()
	assert.Contains(t, cmp, "b/a")
	assert.Regexp(t, `concurrency 1\s+shed share\s+0\.50\s+0\.00\s+0\.00`, cmp)
	assert.Regexp(t, `concurrency 1\s+req/s\s+\S+\s+\S+\s+\d+\.\d\d`, cmp)

	assert.Equal(t, 2, run([]string{"bench", "compare", a}, &stdout, &stderr), "compare takes two files")
	assert.Equal(t, 2, run([]string{"bench", "stray"}, &stdout, &stderr))
	assert.Equal(t, 1, run([]string{"bench", "--url", srv.URL}, &stdout, &stderr), "neither a rate nor a concurrency")
	assert.True(t, strings.Contains(stderr.String(), "troupe bench: loadgen: neither a rate nor a concurrency"), stderr.String())
}

// TestBenchDeadlineHeader: --deadline is sent as every request's
// X-Troupe-Deadline header, as given; without it no header is sent; a
// value the head would refuse is a usage error before any request.
func TestBenchDeadlineHeader(t *testing.T) {
	var got, without atomic.Int64
	var seen atomic.Value
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if h := r.Header.Get("X-Troupe-Deadline"); h != "" {
			seen.Store(h)
			got.Add(1)
		} else {
			without.Add(1)
		}
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\ndata: [DONE]\n\n")
	}))
	defer srv.Close()

	res, _ := bench(t, "--url", srv.URL, "--concurrency", "2", "--requests", "6", "--deadline", "ttft=50ms,ttfa=800ms")
	assert.Equal(t, 6, res.Runs[0].OK)
	assert.Equal(t, int64(6), got.Load())
	assert.Equal(t, int64(0), without.Load())
	assert.Equal(t, "ttft=50ms,ttfa=800ms", seen.Load())
	assert.Equal(t, "ttft=50ms,ttfa=800ms", res.Config.Deadline, "the result file says what was asked")

	bench(t, "--url", srv.URL, "--concurrency", "1", "--requests", "2")
	assert.Equal(t, int64(6), got.Load(), "no --deadline, no header")
	assert.Equal(t, int64(2), without.Load())

	var stdout, stderr bytes.Buffer
	code := run([]string{"bench", "--progress", "off", "--url", srv.URL, "--requests", "1", "--concurrency", "1", "--deadline", "ttft=soon"}, &stdout, &stderr)
	assert.NotEqual(t, 0, code)
	assert.Contains(t, stderr.String(), "--deadline")
	assert.Equal(t, int64(8), got.Load()+without.Load(), "nothing sent")
}
