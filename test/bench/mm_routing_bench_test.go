package bench

import (
	"context"
	"encoding/base64"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/worker/sim"
)

// The multimodal routing workload: a few images asked about again and
// again, on replicas whose encoder caches hold half of them each, with an
// encoder slow enough that a miss shows in TTFT.
const (
	mmImages     = 8
	mmImageBytes = 256 << 10
	mmRate       = 20.0 // requests per second
	mmDuration   = 6 * time.Second
	mmMaxTok     = 8
)

var mmSim = sim.Config{
	EncoderCacheEntries: mmImages / 2,
	EncodeTimePerKiB:    200 * time.Microsecond, // 51 ms an image
	PrefillTokensPerSec: 16000,
	DecodeTokenLatency:  2 * time.Millisecond,
	Logger:              slog.New(slog.DiscardHandler),
}

type mmResult struct {
	name             string
	requests         int
	queries, hits    float64
	ttftP50, ttftP99 time.Duration
}

// BenchmarkMultimodalRouting compares round robin and prefix_aware on chat
// requests about a few repeated images, over HTTP (docs/benchmarks.md):
// the encoder cache hit rate (troupe_mm_cache_hits_total over
// _queries_total, summed over the replicas) and TTFT. One op is one run;
// run it once:
//
//	go test -run '^$' -bench BenchmarkMultimodalRouting -benchtime 1x ./test/bench
func BenchmarkMultimodalRouting(b *testing.B) {
	var results []mmResult
	for _, policy := range []string{"round_robin", "prefix_aware"} {
		b.Run(policy, func(b *testing.B) {
			var r mmResult
			for range b.N {
				r = runMultimodalRouting(b, policy)
			}
			b.ReportMetric(r.hits/r.queries, "mm-hit-rate")
			b.ReportMetric(ms(r.ttftP50), "ttft-p50-ms")
			b.ReportMetric(ms(r.ttftP99), "ttft-p99-ms")
			results = append(results, r)
		})
	}
	if len(results) > 0 {
		var sb strings.Builder
		sb.WriteString("| policy | requests | mm cache hit rate | TTFT p50 (ms) | TTFT p99 (ms) |\n|---|---:|---:|---:|---:|\n")
		for _, r := range results {
			fmt.Fprintf(&sb, "| %s | %d | %.1f%% | %.1f | %.1f |\n", r.name, r.requests, 100*r.hits/r.queries, ms(r.ttftP50), ms(r.ttftP99))
		}
		fmt.Println(sb.String())
	}
}

func runMultimodalRouting(b *testing.B, policy string) mmResult {
	c := orchestratortest.Start(b, orchestratortest.Options{
		Pipeline:         orchestrator.Pipeline{Model: "troupe-omni-sim", Stages: []orchestrator.Stage{{Name: "thinker", Policy: policy}}},
		ReplicasPerStage: routingReplicas,
		Sim:              mmSim,
	})
	c.WaitReady(b)
	httpClient := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	defer httpClient.CloseIdleConnections()
	client := openai.NewClient(option.WithBaseURL(serveRoutingHTTP(b, c.Head)+"/v1/"), option.WithAPIKey("unused"),
		option.WithHTTPClient(httpClient), option.WithMaxRetries(0))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	rng := rand.New(rand.NewPCG(1, 2))
	images := make([]string, mmImages)
	for i := range images {
		img := make([]byte, mmImageBytes)
		for j := range img {
			img[j] = byte(rng.Uint32())
		}
		images[i] = "data:image/png;base64," + base64.StdEncoding.EncodeToString(img)
	}
	var (
		mu       sync.Mutex
		ttfts    []time.Duration
		firstErr error
		wg       sync.WaitGroup
	)
	tick := time.NewTicker(time.Duration(float64(time.Second) / mmRate))
	defer tick.Stop()
	for i := 0; i < int(mmRate*mmDuration.Seconds()); i++ {
		<-tick.C
		params := openai.ChatCompletionNewParams{
			Model: "troupe-omni-sim",
			Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage([]openai.ChatCompletionContentPartUnionParam{
				openai.ImageContentPart(openai.ChatCompletionContentPartImageImageURLParam{URL: images[rng.IntN(mmImages)]}),
				openai.TextContentPart(fmt.Sprintf("question %d: what is in this picture", i)),
			})},
			MaxCompletionTokens: openai.Int(mmMaxTok),
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			first, _, _, _, err := streamChatCompletion(ctx, client, params, option.WithJSONSet("ignore_eos", true))
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				if firstErr == nil {
					firstErr = fmt.Errorf("bench: request %d: %w", i, err)
				}
				return
			}
			ttfts = append(ttfts, first)
		}()
	}
	wg.Wait()
	require.NoError(b, firstErr)
	slices.Sort(ttfts)
	res := mmResult{name: policy, requests: len(ttfts), ttftP50: percentile(ttfts, 0.5), ttftP99: percentile(ttfts, 0.99)}
	mfs, err := c.Metrics.Gather()
	require.NoError(b, err)
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			switch mf.GetName() {
			case "troupe_mm_cache_queries_total":
				res.queries += m.GetCounter().GetValue()
			case "troupe_mm_cache_hits_total":
				res.hits += m.GetCounter().GetValue()
			}
		}
	}
	require.Equal(b, float64(res.requests), res.queries, "one encoder cache query per request (one image each)")
	return res
}
