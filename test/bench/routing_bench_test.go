package bench

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/internal/front/httpapi"
	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/worker/sim"
)

// routingCase is one column of the routing comparison.
type routingCase struct {
	name     string
	stage    orchestrator.Stage
	sessions bool // send each conversation's id as its session key
	heads    int  // heads behind a round-robin balancer (0: one)
	chat     *ChatConfig
}

var routingCases = []routingCase{
	{name: "round_robin", stage: orchestrator.Stage{Policy: "round_robin"}},
	{name: "least_loaded", stage: orchestrator.Stage{Policy: "least_loaded"}},
	{name: "power_of_two", stage: orchestrator.Stage{Policy: "power_of_two"}},
	{name: "prefix_aware-engine", stage: orchestrator.Stage{Policy: "prefix_aware", PrefixSource: "auto"}},
	{name: "prefix_aware-head", stage: orchestrator.Stage{Policy: "prefix_aware", PrefixSource: "head"}},
	{name: "session_affinity", stage: orchestrator.Stage{Policy: "power_of_two"}, sessions: true},
	// One system prompt carries half the conversations (a hot prefix).
	{name: "hot-round_robin", stage: orchestrator.Stage{Policy: "round_robin"}, chat: &routingHotChat},
	{name: "hot-least_loaded", stage: orchestrator.Stage{Policy: "least_loaded"}, chat: &routingHotChat},
	{name: "hot-prefix_aware-engine", stage: orchestrator.Stage{Policy: "prefix_aware", PrefixSource: "auto"}, chat: &routingHotChat},
	{name: "hot-prefix_aware-head", stage: orchestrator.Stage{Policy: "prefix_aware", PrefixSource: "head"}, chat: &routingHotChat},
	// Three heads behind a round-robin balancer.
	{name: "3heads-prefix_aware-engine", stage: orchestrator.Stage{Policy: "prefix_aware", PrefixSource: "auto"}, heads: 3},
	{name: "3heads-prefix_aware-head", stage: orchestrator.Stage{Policy: "prefix_aware", PrefixSource: "head"}, heads: 3},
	{name: "3heads-round_robin", stage: orchestrator.Stage{Policy: "round_robin"}, heads: 3},
	{name: "3heads-least_loaded", stage: orchestrator.Stage{Policy: "least_loaded"}, heads: 3},
	{name: "3heads-power_of_two", stage: orchestrator.Stage{Policy: "power_of_two"}, heads: 3},
	{name: "3heads-session_affinity", stage: orchestrator.Stage{Policy: "power_of_two"}, sessions: true, heads: 3},
	{name: "3heads-hot-prefix_aware-engine", stage: orchestrator.Stage{Policy: "prefix_aware", PrefixSource: "auto"}, chat: &routingHotChat, heads: 3},
	{name: "3heads-hot-prefix_aware-head", stage: orchestrator.Stage{Policy: "prefix_aware", PrefixSource: "head"}, chat: &routingHotChat, heads: 3},
	// A root past the shared system prompts (32 head blocks, 2 KB): each
	// conversation gets its own rendezvous home, which every head agrees on.
	{name: "root32-prefix_aware-engine", stage: orchestrator.Stage{Policy: "prefix_aware", PrefixSource: "auto", Balance: &orchestrator.Balance{RootBlocks: 32}}},
	{name: "root32-prefix_aware-head", stage: orchestrator.Stage{Policy: "prefix_aware", PrefixSource: "head", Balance: &orchestrator.Balance{RootBlocks: 32}}},
	{name: "3heads-root32-prefix_aware-engine", stage: orchestrator.Stage{Policy: "prefix_aware", PrefixSource: "auto", Balance: &orchestrator.Balance{RootBlocks: 32}}, heads: 3},
	{name: "3heads-root32-prefix_aware-head", stage: orchestrator.Stage{Policy: "prefix_aware", PrefixSource: "head", Balance: &orchestrator.Balance{RootBlocks: 32}}, heads: 3},
}

// The routing workload: 4 thinker replicas whose KV pools each hold about
// a fifth of the conversations' working set, prefill expensive enough that
// recomputing a prompt costs real time, and chat traffic at a fixed
// arrival rate.
const (
	routingReplicas = 4
	routingRate     = 40.0 // requests per second, all users together
	routingDuration = 12 * time.Second
	routingMaxTok   = 48
)

var (
	routingSim = sim.Config{
		NumKVBlocks:         1024, // 16384 tokens per replica
		PrefillTokensPerSec: 16000,
		DecodeTokenLatency:  4 * time.Millisecond,
		Logger:              slog.New(slog.DiscardHandler),
	}
	routingChat = ChatConfig{
		Seed:          1,
		SystemPrompts: 3,
		SystemWords:   256,
		Conversations: 40,
		MinTurns:      8,
		MaxTurns:      16,
		UserWords:     160,
	}
	routingHotChat = func() ChatConfig {
		c := routingChat
		c.HotShare = 0.5
		return c
	}()
)

type routingResult struct {
	name                  string
	requests              int
	reqPerSec, tokPerSec  float64
	hitRate               float64
	ttftP50, ttftP99, e2e time.Duration
	busiest, idlest       float64
	skipped               int
	reasons               map[string]float64 // troupe_router_decisions_total by reason
}

// BenchmarkRouting compares the routing policies on one chat workload (see
// docs/benchmarks.md): prefix-cache hit rate (the sim's own counters,
// through the head's metrics), TTFT p50/p99 seen by the client, throughput,
// and load balance (busiest replica's requests over the idlest's). One op
// is one whole run of the workload; run it once:
//
//	go test -run '^$' -bench BenchmarkRouting -benchtime 1x ./test/bench
func BenchmarkRouting(b *testing.B) {
	var results []routingResult
	for _, rc := range routingCases {
		b.Run(rc.name, func(b *testing.B) {
			var r routingResult
			for range b.N {
				r = runRouting(b, rc)
			}
			b.ReportMetric(r.hitRate, "hit-rate")
			b.ReportMetric(ms(r.ttftP50), "ttft-p50-ms")
			b.ReportMetric(ms(r.ttftP99), "ttft-p99-ms")
			b.ReportMetric(r.reqPerSec, "req/s")
			b.ReportMetric(r.busiest/r.idlest, "busiest/idlest")
			b.Logf("decisions by reason: %v; arrivals that found every conversation busy: %d", r.reasons, r.skipped)
			results = append(results, r)
		})
	}
	if len(results) > 0 {
		// Printed, not logged: a parent benchmark's log is not shown.
		fmt.Println(routingTable(results))
	}
}

func runRouting(b *testing.B, rc routingCase) routingResult {
	stage := rc.stage
	stage.Name = "thinker"
	c := orchestratortest.Start(b, orchestratortest.Options{
		Pipeline:         orchestrator.Pipeline{Model: "troupe-omni-sim", Stages: []orchestrator.Stage{stage}},
		ReplicasPerStage: routingReplicas,
		Sim:              routingSim,
	})
	c.WaitReady(b)
	// Every head serves its own HTTP API; the client rotates across them,
	// as a round-robin load balancer in front of several heads would.
	registries := []*prometheus.Registry{c.Metrics}
	bases := []string{serveRoutingHTTP(b, c.Head)}
	for range max(rc.heads, 1) - 1 {
		h, reg := c.AddHead(b)
		require.Eventually(b, func() bool {
			n := 0
			for _, r := range h.Replicas() {
				if r.State == "attached" {
					n++
				}
			}
			return n == routingReplicas
		}, time.Minute, 10*time.Millisecond, "the extra head sees every replica")
		registries = append(registries, reg)
		bases = append(bases, serveRoutingHTTP(b, h))
	}
	httpClient := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256}}
	defer httpClient.CloseIdleConnections()
	clients := make([]openai.Client, len(bases))
	for i, base := range bases {
		clients[i] = openai.NewClient(
			option.WithBaseURL(base+"/v1/"),
			option.WithAPIKey("unused"),
			option.WithHTTPClient(httpClient),
			option.WithMaxRetries(0),
		)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	chatCfg := routingChat
	if rc.chat != nil {
		chatCfg = *rc.chat
	}
	w := NewChatWorkload(chatCfg)
	var (
		mu         sync.Mutex
		ttfts, e2e []time.Duration
		tokens     int
		firstErr   error
		wg         sync.WaitGroup
	)
	res := routingResult{name: rc.name}
	tick := time.NewTicker(time.Duration(float64(time.Second) / routingRate))
	defer tick.Stop()
	start := time.Now()
	for i := 0; time.Since(start) < routingDuration; i++ {
		<-tick.C
		turn, ok := w.Next()
		if !ok {
			res.skipped++
			continue
		}
		params := openai.ChatCompletionNewParams{
			Model:               "troupe-omni-sim",
			MaxCompletionTokens: openai.Int(routingMaxTok),
			StreamOptions:       openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
		}
		for _, m := range turn.Messages {
			switch m.Role {
			case "system":
				params.Messages = append(params.Messages, openai.SystemMessage(m.Content))
			case "user":
				params.Messages = append(params.Messages, openai.UserMessage(m.Content))
			default:
				params.Messages = append(params.Messages, openai.AssistantMessage(m.Content))
			}
		}
		opts := []option.RequestOption{option.WithJSONSet("ignore_eos", true)}
		if rc.sessions {
			opts = append(opts, option.WithHeader("X-Session-ID", turn.Session))
		}
		client := clients[i%len(clients)]
		wg.Add(1)
		go func() {
			defer wg.Done()
			first, total, reply, used, err := streamChatCompletion(ctx, client, params, opts...)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				if firstErr == nil {
					firstErr = fmt.Errorf("bench: request %d: %w", i, err)
				}
				return
			}
			ttfts, e2e = append(ttfts, first), append(e2e, total)
			tokens += int(used)
			w.Reply(turn, reply)
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	require.NoError(b, firstErr)

	slices.Sort(ttfts)
	slices.Sort(e2e)
	res.requests = len(ttfts)
	res.reqPerSec = float64(len(ttfts)) / elapsed.Seconds()
	res.tokPerSec = float64(tokens) / elapsed.Seconds()
	res.ttftP50, res.ttftP99 = percentile(ttfts, 0.50), percentile(ttfts, 0.99)
	res.e2e = percentile(e2e, 0.50)

	var hits, queries float64
	perReplica := map[string]float64{}
	res.reasons = map[string]float64{}
	for _, reg := range registries {
		mfs, err := reg.Gather()
		require.NoError(b, err)
		for _, mf := range mfs {
			for _, m := range mf.GetMetric() {
				var replica string
				for _, l := range m.GetLabel() {
					if l.GetName() == "replica" {
						replica = l.GetValue()
					}
				}
				switch mf.GetName() {
				case "troupe_prefix_cache_hits_total":
					hits += m.GetCounter().GetValue()
				case "troupe_prefix_cache_queries_total":
					queries += m.GetCounter().GetValue()
				case "troupe_request_success_total":
					perReplica[replica] += m.GetCounter().GetValue()
				case "troupe_router_decisions_total":
					for _, l := range m.GetLabel() {
						if l.GetName() == "reason" && m.GetCounter().GetValue() > 0 {
							res.reasons[l.GetValue()] += m.GetCounter().GetValue()
						}
					}
				}
			}
		}
	}
	require.Len(b, perReplica, routingReplicas)
	if queries > 0 {
		res.hitRate = hits / queries
	}
	res.idlest = -1
	for _, n := range perReplica {
		res.busiest = max(res.busiest, n)
		if res.idlest < 0 || n < res.idlest {
			res.idlest = n
		}
	}
	return res
}

// workloadOf is a case's workload: "hot" for the cases named …hot-…, ""
// for the default workload (which several heads run too).
func workloadOf(name string) string {
	if strings.Contains(name, "hot-") {
		return "hot"
	}
	return ""
}

// serveRoutingHTTP serves a head's HTTP API as `troupe head` does, with
// its default session header, until the benchmark ends.
func serveRoutingHTTP(b *testing.B, h *orchestrator.Head) string {
	return serveHTTPWith(b, h, httpapi.Config{Logger: slog.New(slog.DiscardHandler), SessionHeader: "X-Session-ID"})
}

// routingTable renders the results as a Markdown table with the ratios to
// round robin (NaN when round robin did not run), a case compared with the
// round robin of its workload; docs/benchmarks.md, "Routing policies",
// condenses it.
func routingTable(rs []routingResult) string {
	bases := map[string]routingResult{}
	for _, r := range rs {
		// Every column is compared with one head's round robin of its
		// workload, the 3-head columns too.
		if strings.HasSuffix(r.name, "round_robin") && !strings.HasPrefix(r.name, "3heads-") {
			bases[workloadOf(r.name)] = r
		}
	}
	var sb strings.Builder
	sb.WriteString("| policy | requests | req/s | tokens/s | hit rate | hit rate ÷ RR | TTFT p50 (ms) | RR ÷ TTFT p50 | TTFT p99 (ms) | e2e p50 (ms) | busiest ÷ idlest |\n")
	sb.WriteString("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range rs {
		base, ok := bases[workloadOf(r.name)]
		if !ok {
			base = bases[""]
		}
		if base.name == "" {
			base = routingResult{hitRate: math.NaN(), ttftP50: -1}
		}
		fmt.Fprintf(&sb, "| %s | %d | %.1f | %.0f | %.1f%% | %.2f× | %.1f | %.2f× | %.1f | %.1f | %.2f |\n",
			r.name, r.requests, r.reqPerSec, r.tokPerSec, 100*r.hitRate, r.hitRate/base.hitRate,
			ms(r.ttftP50), ms(base.ttftP50)/ms(r.ttftP50), ms(r.ttftP99), ms(r.e2e), r.busiest/r.idlest)
	}
	return sb.String()
}

// streamChatCompletion sends one streamed chat completion through the official
// client, as a user would: first is the time to the first text delta,
// total to the stream's end, used the completion tokens of the final usage.
// A stream that gives no text is an error.
func streamChatCompletion(ctx context.Context, client openai.Client, params openai.ChatCompletionNewParams, opts ...option.RequestOption) (first, total time.Duration, text string, used int64, err error) {
	t0 := time.Now()
	var b strings.Builder
	stream := client.Chat.Completions.NewStreaming(ctx, params, opts...)
	for stream.Next() {
		chunk := stream.Current()
		if chunk.Usage.CompletionTokens > 0 {
			used = chunk.Usage.CompletionTokens
		}
		if len(chunk.Choices) == 0 || chunk.Choices[0].Delta.Content == "" {
			continue
		}
		if first == 0 {
			first = time.Since(t0)
		}
		b.WriteString(chunk.Choices[0].Delta.Content)
	}
	err = stream.Err()
	_ = stream.Close()
	total = time.Since(t0)
	if err == nil && first == 0 {
		err = errors.New("bench: the stream gave no text")
	}
	return first, total, b.String(), used, err
}
