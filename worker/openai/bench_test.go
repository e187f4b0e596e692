package openai_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/openai"

	oai "github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
)

// benchTokens is the length of every benchmark answer.
const benchTokens = 64

// streamingUpstream answers every chat request with benchTokens deltas,
// each its own flushed SSE event, one every pace (0: as fast as it can).
func streamingUpstream(b *testing.B, pace time.Duration) *httptest.Server {
	b.Helper()
	events := make([][]byte, 0, benchTokens+3)
	for i := range benchTokens {
		events = append(events, []byte("data: "+delta(fmt.Sprintf(" w%d", i))+"\n\n"))
	}
	events = append(events, []byte("data: "+finish("length")+"\n\n"), []byte("data: "+usageEvent(12, benchTokens, 0)+"\n\n"), []byte("data: [DONE]\n\n"))
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, `{"data":[{"id":"m"}]}`) })
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		f := w.(http.Flusher)
		var tick <-chan time.Time
		if pace > 0 {
			t := time.NewTicker(pace)
			defer t.Stop()
			tick = t.C
		}
		for i, e := range events {
			if tick != nil && i > 0 && i < benchTokens {
				select { // the upstream decoding its next token
				case <-tick:
				case <-r.Context().Done():
					return
				}
			}
			if _, err := w.Write(e); err != nil {
				return
			}
			f.Flush()
		}
	})
	srv := httptest.NewServer(mux)
	b.Cleanup(srv.Close)
	return srv
}

// timing accumulates what one request took: time to the first delta, the
// mean gap between deltas, and the whole request.
type timing struct {
	ttft, itl, total time.Duration
	n                int
}

func (t *timing) add(start, first, last, end time.Time, deltas int) {
	t.ttft += first.Sub(start)
	if deltas > 1 {
		t.itl += last.Sub(first) / time.Duration(deltas-1)
	}
	t.total += end.Sub(start)
	t.n++
}

func (t *timing) report(b *testing.B) {
	n := float64(t.n)
	b.ReportMetric(float64(t.ttft.Microseconds())/n, "ttft-µs")
	b.ReportMetric(float64(t.itl.Nanoseconds())/n/1000, "itl-µs")
	b.ReportMetric(float64(t.total.Microseconds())/n, "req-µs")
}

// BenchmarkAdapterOverhead measures what the openai engine adds: the same
// 64-token stream from a loopback upstream, read (direct) by an HTTP
// client that parses the SSE JSON as an OpenAI client does, (engine) by
// the engine alone, called in process, and (worker) by a gRPC client of a
// worker whose engine streams it from the upstream.
// One op is one request; ttft-µs is the time to the first delta, itl-µs
// the mean gap between deltas, req-µs the whole request. "burst" streams
// every token at once (the cost of the hops under full load); "paced-1ms"
// streams one token per millisecond, as a fast real engine does.
func BenchmarkAdapterOverhead(b *testing.B) {
	for _, pace := range []time.Duration{0, time.Millisecond} {
		name := "burst"
		if pace > 0 {
			name = "paced-" + pace.String()
		}
		b.Run(name, func(b *testing.B) { benchAdapter(b, pace) })
	}
}

func benchAdapter(b *testing.B, pace time.Duration) {
	up := streamingUpstream(b, pace)
	body := []byte(`{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hello"}]}`)

	b.Run("direct", func(b *testing.B) {
		client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}}
		defer client.CloseIdleConnections()
		var tm timing
		b.ReportAllocs()
		for b.Loop() {
			start := time.Now()
			req, err := http.NewRequest(http.MethodPost, up.URL+"/v1/chat/completions", bytes.NewReader(body))
			require.NoError(b, err)
			req.Header.Set("Content-Type", "application/json")
			resp, err := client.Do(req)
			require.NoError(b, err)
			sc := bufio.NewScanner(resp.Body)
			var first, last time.Time
			deltas := 0
			for sc.Scan() {
				line := sc.Bytes()
				if !bytes.HasPrefix(line, []byte("data: ")) || bytes.Equal(line[6:], []byte("[DONE]")) {
					continue
				}
				var ev struct {
					Choices []struct {
						Delta struct {
							Content string `json:"content"`
						} `json:"delta"`
					} `json:"choices"`
				}
				require.NoError(b, json.Unmarshal(line[6:], &ev))
				if len(ev.Choices) > 0 && ev.Choices[0].Delta.Content != "" {
					last = time.Now()
					if first.IsZero() {
						first = last
					}
					deltas++
				}
			}
			require.NoError(b, sc.Err())
			resp.Body.Close()
			require.Equal(b, benchTokens, deltas)
			tm.add(start, first, last, time.Now(), deltas)
		}
		tm.report(b)
	})

	b.Run("engine", func(b *testing.B) {
		e, err := openai.New(openai.Config{URL: up.URL + "/v1", HealthInterval: time.Hour, Logger: quiet()})
		require.NoError(b, err)
		run(b, e)
		waitAvailable(b, e, true)
		req := chatReq(nil, msg("user", "hello"))
		var tm timing
		b.ReportAllocs()
		for b.Loop() {
			start := time.Now()
			var first, last time.Time
			deltas := 0
			err := e.Generate(context.Background(), req, func(c *stagepb.GenerateChunk) error {
				if c.GetText() != "" {
					last = time.Now()
					if first.IsZero() {
						first = last
					}
					deltas++
				}
				return nil
			})
			require.NoError(b, err)
			require.Equal(b, benchTokens, deltas)
			tm.add(start, first, last, time.Now(), deltas)
		}
		tm.report(b)
	})

	b.Run("worker", func(b *testing.B) {
		e, err := openai.New(openai.Config{URL: up.URL + "/v1", HealthInterval: time.Hour, Logger: quiet()})
		require.NoError(b, err)
		run(b, e)
		waitAvailable(b, e, true)
		srv, err := worker.New(worker.Config{Stage: "thinker", Engine: e, Logger: quiet()})
		require.NoError(b, err)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- srv.Run(ctx) }()
		defer func() { cancel(); require.NoError(b, <-done) }()
		<-srv.Registered()
		conn, err := grpc.NewClient(srv.Advertise(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		require.NoError(b, err)
		defer conn.Close()
		cli := stagepb.NewStageServiceClient(conn)
		req := chatReq(nil, msg("user", "hello"))
		var tm timing
		b.ReportAllocs()
		for b.Loop() {
			start := time.Now()
			stream, err := cli.Generate(context.Background(), req)
			require.NoError(b, err)
			var first, last time.Time
			deltas := 0
			var text strings.Builder
			for {
				c, err := stream.Recv()
				if err == io.EOF {
					break
				}
				require.NoError(b, err)
				if c.GetText() != "" {
					last = time.Now()
					if first.IsZero() {
						first = last
					}
					deltas++
					text.WriteString(c.GetText())
				}
			}
			require.Equal(b, benchTokens, deltas)
			tm.add(start, first, last, time.Now(), deltas)
		}
		tm.report(b)
	})
}

// BenchmarkAddedLatency measures what a troupe head and an openai worker
// add in front of an OpenAI-compatible upstream. The upstream is a troupe
// head with an instant sim (head A, on loopback); "direct" streams a chat
// completion from it, "troupe" streams the same request from head B,
// whose one stage is an openai worker in front of A. One op is one request
// each way, in alternating order, so both paths see the same machine
// load. Reported: the median and p90 of each path's time to the first
// content delta and of the whole request, and of the pairwise difference
// (added-*), in µs.
func BenchmarkAddedLatency(b *testing.B) {
	a := startUpstreamHead(b, orchestratortest.Options{Pipeline: thinkerOnly})
	head := orchestratortest.Start(b, orchestratortest.Options{Pipeline: thinkerOnly, ReplicasPerStage: -1})
	e, err := openai.New(openai.Config{URL: a.base, HealthInterval: time.Hour, Logger: quiet()})
	require.NoError(b, err)
	srv := startWorker(b, head, "thinker", e)
	head.WaitState(b, "thinker", srv.Member().ReplicaID, "attached")
	troupe := serveAPI(b, head) + "/v1"
	// The official client, as a user calls either server; one HTTP client
	// under both, so the two paths differ only in what answers.
	httpClient := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}}
	defer httpClient.CloseIdleConnections()
	params := oai.ChatCompletionNewParams{
		Model:     "troupe-omni-sim",
		MaxTokens: oai.Int(16),
		Seed:      oai.Int(1),
		Messages:  []oai.ChatCompletionMessageParamUnion{oai.UserMessage("how far is the sea")},
	}
	clients := map[string]*oai.Client{}
	for _, base := range []string{a.base, troupe} {
		c := oai.NewClient(option.WithBaseURL(base+"/"), option.WithAPIKey("unused"), option.WithHTTPClient(httpClient), option.WithMaxRetries(0))
		clients[base] = &c
	}
	stream := func(base string) (ttft, total time.Duration) {
		start := time.Now()
		s := clients[base].Chat.Completions.NewStreaming(context.Background(), params, option.WithJSONSet("ignore_eos", true))
		for s.Next() {
			if c := s.Current(); ttft == 0 && len(c.Choices) > 0 && c.Choices[0].Delta.Content != "" {
				ttft = time.Since(start)
			}
		}
		require.NoError(b, s.Err())
		require.NoError(b, s.Close())
		require.NotZero(b, ttft, "no content")
		return ttft, time.Since(start)
	}
	stream(a.base) // warm both paths' connections
	stream(troupe)
	var dTTFT, tTTFT, dTotal, tTotal, addTTFT, addTotal []time.Duration
	i := 0
	for b.Loop() {
		var d1, d2, t1, t2 time.Duration
		if i%2 == 0 {
			d1, d2 = stream(a.base)
			t1, t2 = stream(troupe)
		} else {
			t1, t2 = stream(troupe)
			d1, d2 = stream(a.base)
		}
		i++
		dTTFT, tTTFT, dTotal, tTotal = append(dTTFT, d1), append(tTTFT, t1), append(dTotal, d2), append(tTotal, t2)
		addTTFT, addTotal = append(addTTFT, t1-d1), append(addTotal, t2-d2)
	}
	for _, s := range []struct {
		name string
		v    []time.Duration
	}{{"direct-ttft", dTTFT}, {"troupe-ttft", tTTFT}, {"added-ttft", addTTFT}, {"direct-req", dTotal}, {"troupe-req", tTotal}, {"added-req", addTotal}} {
		slices.Sort(s.v)
		b.ReportMetric(float64(s.v[len(s.v)/2].Microseconds()), s.name+"-p50-µs")
		b.ReportMetric(float64(s.v[len(s.v)*9/10].Microseconds()), s.name+"-p90-µs")
	}
}
