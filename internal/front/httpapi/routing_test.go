package httpapi

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
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
