package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/worker/sim"
)

// BenchmarkTokenLatency is what a streaming client sees of the head: a sim
// thinker that takes a fixed step per token, so every token leaves the
// engine alone, and streaming clients that date each delta as it arrives.
// It reports the client's time to first token, and how much longer than
// the engine's step the gap between deltas is (p50, p99): the head's
// latency per token. Each op is one request of 32 tokens.
//
//	go test -run '^$' -bench TokenLatency -benchtime 200x ./test/bench
func BenchmarkTokenLatency(b *testing.B) {
	const tokens, step = 32, 2 * time.Millisecond
	c := orchestratortest.Start(b, orchestratortest.Options{
		Pipeline: orchestrator.Pipeline{Model: "troupe-omni-sim", Stages: []orchestrator.Stage{{Name: "thinker"}}},
		Sim:      sim.Config{DecodeTokenLatency: step},
	})
	c.WaitReady(b)
	base := serveHTTP(b, c.Head)
	tr := &http.Transport{MaxIdleConnsPerHost: 64}
	b.Cleanup(tr.CloseIdleConnections)
	client := &http.Client{Transport: tr}
	for _, conc := range []int{1, 8} {
		b.Run(fmt.Sprintf("c%d", conc), func(b *testing.B) {
			var mu sync.Mutex
			var ttft, excess []time.Duration
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			jobs := make(chan int)
			var g errgroup.Group
			for range conc {
				g.Go(func() error {
					for i := range jobs {
						first, gaps, err := streamChat(ctx, client, base, i, tokens)
						if err != nil {
							return err
						}
						mu.Lock()
						ttft = append(ttft, first)
						for _, gap := range gaps {
							excess = append(excess, gap-step)
						}
						mu.Unlock()
					}
					return nil
				})
			}
			b.ResetTimer()
			for i := range b.N {
				jobs <- i
			}
			close(jobs)
			require.NoError(b, g.Wait())
			b.StopTimer()
			slices.Sort(ttft)
			slices.Sort(excess)
			b.ReportMetric(ms(percentile(ttft, 0.50)), "ttft-p50-ms")
			b.ReportMetric(ms(percentile(ttft, 0.99)), "ttft-p99-ms")
			b.ReportMetric(ms(percentile(excess, 0.50)), "gap-over-step-p50-ms")
			b.ReportMetric(ms(percentile(excess, 0.99)), "gap-over-step-p99-ms")
		})
	}
}

// streamChat sends one streaming chat completion and dates its deltas:
// first is the time to the first one, gaps the times between the others.
func streamChat(ctx context.Context, client *http.Client, base string, i, tokens int) (first time.Duration, gaps []time.Duration, err error) {
	body, err := json.Marshal(map[string]any{
		"model": "troupe-omni-sim", "max_tokens": tokens, "seed": i, "ignore_eos": true, "stream": true,
		"messages": []map[string]any{{"role": "user", "content": prompt}},
	})
	if err != nil {
		return 0, nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	start := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, nil, fmt.Errorf("bench: %s", resp.Status)
	}
	var last time.Time
	deltas := 0
	if _, err := ReadDeltas(resp.Body, func(string) {
		now := time.Now()
		if deltas == 0 {
			first = now.Sub(start)
		} else {
			gaps = append(gaps, now.Sub(last))
		}
		last = now
		deltas++
	}); err != nil {
		return 0, nil, err
	}
	if deltas != tokens {
		return 0, nil, fmt.Errorf("bench: %d deltas, want %d", deltas, tokens)
	}
	return first, gaps, nil
}
