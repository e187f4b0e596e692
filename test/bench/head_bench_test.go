package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"golang.org/x/sync/errgroup"

	"github.com/troupe-serving/troupe/internal/front/httpapi"
	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker/sim"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// maxTokens is the completion length of every benchmark request (with
// ignore_eos, so every request does the same work).
const maxTokens = 16

const prompt = "benchmark the head of troupe"

type scenario struct {
	name     string
	pipeline orchestrator.Pipeline
	sim      sim.Config
	stages   int // 1: text only; 3: text and audio
}

var scenarios = []scenario{
	{
		name:     "1stage",
		pipeline: orchestrator.Pipeline{Model: "troupe-omni-sim", Stages: []orchestrator.Stage{{Name: "thinker"}}},
		stages:   1,
	},
	{name: "3stage", pipeline: orchestrator.DefaultPipeline(), stages: 3},
	{
		// A realistic pace: 5ms per decode step, prefill at 5000 tokens/s.
		name:     "3stage-delay",
		pipeline: orchestrator.DefaultPipeline(),
		sim:      sim.Config{DecodeTokenLatency: 5 * time.Millisecond, PrefillTokensPerSec: 5000},
		stages:   3,
	},
}

var concurrencies = []int{1, 8, 32}

// BenchmarkHead drives one cluster per scenario (one sim replica per
// stage) at each concurrency, through Head.Execute and through the HTTP
// API (POST /v1/chat/completions, non-streaming). Each request is one op;
// it reports req/s and the p50 and p99 latency in milliseconds.
//
//	go test -run '^$' -bench . -benchtime 400x ./test/bench
func BenchmarkHead(b *testing.B) {
	for _, sc := range scenarios {
		b.Run(sc.name, func(b *testing.B) {
			c := orchestratortest.Start(b, orchestratortest.Options{Pipeline: sc.pipeline, Sim: sc.sim})
			c.WaitReady(b)
			base := serveHTTP(b, c.Head)
			tr := &http.Transport{MaxIdleConnsPerHost: 64}
			b.Cleanup(tr.CloseIdleConnections)
			client := &http.Client{Transport: tr}

			for _, conc := range concurrencies {
				b.Run(fmt.Sprintf("execute/c%d", conc), func(b *testing.B) {
					load(b, conc, func(ctx context.Context, i int) error {
						seed := int64(i)
						res, err := c.Head.Execute(ctx, orchestrator.Request{
							ID:       fmt.Sprint("bench-", i),
							Prompt:   prompt,
							Sampling: &stagepb.SamplingParams{MaxTokens: maxTokens, Seed: &seed, IgnoreEos: true},
							Stages:   sc.stages,
						}, nil)
						if err != nil {
							return err
						}
						return check(res.CompletionTokens, sc.stages == 3 && len(res.PCM) == 0)
					})
				})
			}
			for _, conc := range concurrencies {
				b.Run(fmt.Sprintf("http/c%d", conc), func(b *testing.B) {
					load(b, conc, func(ctx context.Context, i int) error {
						return chat(ctx, client, base, i, sc.stages == 3)
					})
				})
			}
		})
	}
}

func check(tokens int, missingAudio bool) error {
	if tokens != maxTokens {
		return fmt.Errorf("bench: %d completion tokens, want %d", tokens, maxTokens)
	}
	if missingAudio {
		return errors.New("bench: no audio")
	}
	return nil
}

// load runs b.N requests from conc goroutines and reports req/s, p50-ms and
// p99-ms.
func load(b *testing.B, conc int, do func(ctx context.Context, i int) error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	lat := make([]time.Duration, b.N)
	var next atomic.Int64
	b.ResetTimer()
	start := time.Now()
	var g errgroup.Group
	for range conc {
		g.Go(func() error {
			for {
				i := int(next.Add(1)) - 1
				if i >= len(lat) {
					return nil
				}
				t0 := time.Now()
				if err := do(ctx, i); err != nil {
					cancel()
					return err
				}
				lat[i] = time.Since(t0)
			}
		})
	}
	err := g.Wait()
	elapsed := time.Since(start)
	b.StopTimer()
	require.NoError(b, err)
	slices.Sort(lat)
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "req/s")
	b.ReportMetric(ms(percentile(lat, 0.50)), "p50-ms")
	b.ReportMetric(ms(percentile(lat, 0.99)), "p99-ms")
}

// percentile of sorted samples, nearest rank.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(float64(len(sorted))*p+0.5) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// serveHTTP serves the head's HTTP API on loopback as `troupe head` does
// (httpapi.NewHTTPServer) until the benchmark ends.
func serveHTTP(b *testing.B, h *orchestrator.Head) string {
	return serveHTTPWith(b, h, httpapi.Config{Logger: slog.New(slog.DiscardHandler)})
}

// serveHTTPWith is serveHTTP with the API's configuration cfg.
func serveHTTPWith(b *testing.B, h *orchestrator.Head, cfg httpapi.Config) string {
	b.Helper()
	api := httpapi.New(h, cfg)
	srv := httpapi.NewHTTPServer("127.0.0.1:0", api.Handler())
	lis, err := net.Listen("tcp", srv.Addr)
	require.NoError(b, err)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	b.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := srv.Shutdown(ctx); err != nil {
			_ = srv.Close()
		}
		require.ErrorIs(b, <-served, http.ErrServerClosed)
	})
	return "http://" + lis.Addr().String()
}

type chatBody struct {
	Model      string           `json:"model"`
	Messages   []map[string]any `json:"messages"`
	MaxTokens  int              `json:"max_tokens"`
	Seed       int              `json:"seed"`
	IgnoreEOS  bool             `json:"ignore_eos"`
	Modalities []string         `json:"modalities,omitempty"`
}

// chat sends one non-streaming chat completion and checks its usage (and
// audio, when asked for).
func chat(ctx context.Context, client *http.Client, base string, i int, audio bool) error {
	req := chatBody{
		Model:     "troupe-omni-sim",
		Messages:  []map[string]any{{"role": "user", "content": prompt}},
		MaxTokens: maxTokens,
		Seed:      i,
		IgnoreEOS: true,
	}
	if audio {
		req.Modalities = []string{"text", "audio"}
	}
	body, err := json.Marshal(req)
	if err != nil {
		return err
	}
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return err
	}
	hreq.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(hreq)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("bench: %s: %s", resp.Status, b)
	}
	var out struct {
		Choices []struct {
			Message struct {
				Audio *struct {
					Data string `json:"data"`
				} `json:"audio"`
			} `json:"message"`
		} `json:"choices"`
		Usage struct {
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(b, &out); err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	if len(out.Choices) != 1 {
		return fmt.Errorf("bench: %d choices", len(out.Choices))
	}
	a := out.Choices[0].Message.Audio
	return check(out.Usage.CompletionTokens, audio && (a == nil || a.Data == ""))
}
