package httpapi

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
)

// Chat completions that share a long prefix converge, through the HTTP
// API, on one replica with reason prefix_match: the head routes a chat by
// the conversation as the engine reads it, in both modes.
func TestChatRoutesByPrefix(t *testing.T) {
	for _, source := range []string{"auto", "head"} {
		t.Run(source, func(t *testing.T) {
			c := startCluster(t, orchestratortest.Options{
				Pipeline: orchestrator.Pipeline{Model: model, Stages: []orchestrator.Stage{
					{Name: "thinker", Policy: "prefix_aware", PrefixSource: source},
				}},
				ReplicasPerStage: 3,
			})
			a := startAPI(t, c, Config{}, nil, nil)
			client := a.openai()
			system := strings.Repeat("You are a careful assistant who answers in one short sentence. ", 30)
			const n = 6
			for i := range n {
				_, err := client.Chat.Completions.New(testCtx(t), openai.ChatCompletionNewParams{
					Model: model,
					Messages: []openai.ChatCompletionMessageParamUnion{
						openai.SystemMessage(system),
						openai.UserMessage(fmt.Sprintf("question number %d", i)),
					},
					MaxCompletionTokens: openai.Int(4),
				})
				require.NoError(t, err)
			}
			assert.Equal(t, float64(n-1), counter(t, c, "troupe_router_decisions_total", "0", "reason", "prefix_match"),
				"every request after the first follows the cached prefix")
			assert.Equal(t, 1.0, counter(t, c, "troupe_router_decisions_total", "0", "reason", "load"))
			served := 0
			for _, w := range c.Workers() {
				if counter(t, c, "troupe_request_success_total", "0", "replica", fmt.Sprint(w.ReplicaID())) > 0 {
					served++
				}
			}
			assert.Equal(t, 1, served, "one replica served them all")
			assert.Greater(t, counter(t, c, "troupe_prefix_cache_hits_total", "0", "", ""), 0.0,
				"the engine found the prefix in its cache")

			// /v1/replicas shows each replica's load report and its age,
			// and in the engine-reported mode the age of its cache report:
			// every replica's, from its cache subscription's snapshot.
			cacheReports := func() int {
				resp, body := a.do(t, "GET", "/v1/replicas", nil, nil)
				require.Equal(t, 200, resp.StatusCode, "body: %s", body)
				var list struct {
					Data []struct {
						Load     *int64   `json:"load"`
						LoadAge  *float64 `json:"load_age_s"`
						CacheAge *float64 `json:"cache_report_age_s"`
						InFlight int64    `json:"in_flight"`
					} `json:"data"`
				}
				require.NoError(t, json.Unmarshal(body, &list))
				require.Len(t, list.Data, 3)
				n := 0
				for _, r := range list.Data {
					require.NotNil(t, r.LoadAge, "every replica reported its load on joining")
					assert.GreaterOrEqual(t, *r.LoadAge, 0.0)
					assert.Less(t, *r.LoadAge, 120.0)
					require.NotNil(t, r.Load)
					if r.CacheAge != nil {
						n++
					}
				}
				return n
			}
			if source == "auto" {
				require.Eventually(t, func() bool { return cacheReports() == 3 }, wait, 5*time.Millisecond,
					"every replica's cache subscription delivered its snapshot")
			} else {
				assert.Zero(t, cacheReports(), "the head-side mode reads no cache reports")
			}
		})
	}
}

// Several heads in the head-side mode agree on where a conversation is:
// each turn goes through another head than the turn before (a round-robin
// balancer in front of them), and every later turn reaches the replica
// the first head chose, by its cached prefix (prefix_match on the head
// that routes it), because every worker tells every head the blocks heads
// routed to it (routed-block reports). Without them, a head that never
// routed the conversation knows nothing of it.
func TestHeadsShareRoutedBlocks(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{
		Pipeline: orchestrator.Pipeline{Model: model, Stages: []orchestrator.Stage{
			{Name: "thinker", Policy: "prefix_aware", PrefixSource: "head"},
		}},
		ReplicasPerStage: 3,
	})
	c.WaitReady(t)
	heads := []*orchestrator.Head{c.Head}
	regs := []*prometheus.Registry{c.Metrics}
	for range 2 {
		h, reg := c.AddHead(t)
		heads, regs = append(heads, h), append(regs, reg)
	}
	clients := make([]openai.Client, len(heads))
	for i, h := range heads {
		require.Eventually(t, func() bool {
			n := 0
			for _, r := range h.Replicas() {
				if r.State == "attached" {
					n++
				}
			}
			// Each head holds a routed subscription to every replica.
			return n == 3 && gathered(t, regs[i], "troupe_router_cache_snapshots_total", "", "") >= 3
		}, wait, 5*time.Millisecond, "head %d attached every replica and subscribed to its routed blocks", i)
		clients[i] = startAPIOn(t, c, h, Config{}, nil, nil).openai()
	}
	// served is, per replica, the requests head i's replicas served.
	served := func(i int) map[string]float64 {
		out := map[string]float64{}
		for _, w := range c.Workers() {
			id := fmt.Sprint(w.ReplicaID())
			out[id] = gathered(t, regs[i], "troupe_request_success_total", "replica", id)
		}
		return out
	}
	const conversations, turns = 6, 3
	for conv := range conversations {
		// Each conversation its own system prompt: its first turn goes
		// wherever its prefix's rendezvous order puts it.
		system := fmt.Sprintf("Conversation %d. ", conv) + strings.Repeat("You are a careful assistant who answers in one short sentence. ", 20)
		msgs := []openai.ChatCompletionMessageParamUnion{openai.SystemMessage(system), openai.UserMessage("first question")}
		var first string
		for turn := range turns {
			i := (conv + turn) % len(heads)
			// Every head reads every replica idle (the turn before
			// ended), so load decides nothing and the cache does.
			require.Eventually(t, func() bool {
				for _, h := range heads {
					for _, r := range h.Replicas() {
						if r.InFlight != 0 || r.Load == nil || *r.Load != 0 {
							return false
						}
					}
				}
				return true
			}, wait, time.Millisecond, "the heads read every replica idle")
			before := served(i)
			matched := gathered(t, regs[i], "troupe_router_decisions_total", "reason", "prefix_match")
			resp, err := clients[i].Chat.Completions.New(testCtx(t), openai.ChatCompletionNewParams{
				Model: model, Messages: msgs, MaxCompletionTokens: openai.Int(4),
			})
			require.NoError(t, err)
			var to string
			for id, n := range served(i) {
				if n > before[id] {
					to = id
				}
			}
			require.NotEmpty(t, to, "head %d counted the request on a replica", i)
			if turn == 0 {
				first = to
			} else {
				assert.Equal(t, first, to, "conversation %d turn %d, through head %d, reaches the replica head %d chose for its first turn", conv, turn, i, conv%len(heads))
				assert.Equal(t, matched+1, gathered(t, regs[i], "troupe_router_decisions_total", "reason", "prefix_match"),
					"conversation %d turn %d: head %d matched the blocks another head routed", conv, turn, i)
			}
			msgs = append(msgs, openai.AssistantMessage(resp.Choices[0].Message.Content), openai.UserMessage(fmt.Sprintf("follow-up %d", turn)))
		}
	}
}

// gathered sums the stage-0 series of counter name in reg whose label is
// value (label "": every series).
func gathered(t *testing.T, reg *prometheus.Registry, name, label, value string) float64 {
	t.Helper()
	fams, err := reg.Gather()
	require.NoError(t, err)
	var sum float64
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			if (label != "" && labelOf(m, label) != value) || (labelOf(m, "stage") != "" && labelOf(m, "stage") != "0") {
				continue
			}
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}
