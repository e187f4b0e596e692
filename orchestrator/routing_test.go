package orchestrator_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/telemetry"
	"github.com/troupe-serving/troupe/pkg/tokenizers"
	"github.com/troupe-serving/troupe/worker/sim"
)

// servedBy is how many requests each thinker replica finished (every
// request here runs to its length limit).
func servedBy(t *testing.T, c *orchestratortest.Cluster) map[uint32]float64 {
	t.Helper()
	out := map[uint32]float64{}
	for _, w := range c.Workers() {
		v, _ := value(t, c.Metrics, "troupe_request_success_total",
			map[string]string{"stage": "0", "replica": fmt.Sprint(w.ReplicaID()), "finished_reason": "length"})
		out[w.ReplicaID()] = v
	}
	return out
}

// grew returns the replicas whose count grew, with how much.
func grew(before, after map[uint32]float64) map[uint32]float64 {
	out := map[uint32]float64{}
	for r, n := range after {
		if d := n - before[r]; d > 0 {
			out[r] = d
		}
	}
	return out
}

func decisions(t *testing.T, c *orchestratortest.Cluster, reason string) float64 {
	t.Helper()
	v, ok := value(t, c.Metrics, "troupe_router_decisions_total", map[string]string{"stage": "0", "policy": "prefix_aware", "reason": reason})
	require.True(t, ok, "the decision series of prefix_aware exist before any request")
	return v
}

func totalInFlight(c *orchestratortest.Cluster) int64 {
	var n int64
	for _, r := range c.Head.Replicas() {
		n += r.InFlight
	}
	return n
}

// TestPrefixAwareConvergesAndSpreadsUnderOverload: requests that share a
// long prefix all go to the replica that cached it, in both modes (the
// sim's own reports, and the head's guess); when that replica is loaded far
// beyond the others, they spread.
func TestPrefixAwareConvergesAndSpreadsUnderOverload(t *testing.T) {
	system := "system: " + strings.Repeat("you answer questions about the troupe serving orchestrator briefly and politely ", 16)
	for _, source := range []struct{ name, want string }{{"auto", "engine"}, {"head", "head"}} {
		t.Run(source.name, func(t *testing.T) {
			c, rec := tracedCluster(t, orchestratortest.Options{
				Pipeline: orchestrator.Pipeline{Model: "troupe-omni-sim", Stages: []orchestrator.Stage{
					{Name: "thinker", Policy: "prefix_aware", PrefixSource: source.name},
				}},
				ReplicasPerStage: 3,
				Sim:              sim.Config{DecodeTokenLatency: 5 * time.Millisecond},
			})
			ctx := ctxT(t)
			sp := func(n uint32) *stagepb.SamplingParams {
				s := sampling(n, 1)
				s.IgnoreEos = true
				return s
			}

			// Converge: one after another, every request finds the prefix
			// where the first one left it.
			before, matched := servedBy(t, c), decisions(t, c, "prefix_match")
			var last orchestrator.Request
			for i := range 8 {
				last = orchestrator.Request{ID: fmt.Sprint("q", i), Prompt: system + fmt.Sprintf("\nuser: question number %d", i), Sampling: sp(2)}
				_, err := c.Head.Execute(ctx, last, nil)
				require.NoError(t, err)
			}
			got := grew(before, servedBy(t, c))
			require.Len(t, got, 1, "requests sharing a prefix converge on one replica: %v", got)
			var home uint32
			for r, n := range got {
				home = r
				assert.Equal(t, 8.0, n)
			}
			assert.Equal(t, 7.0, decisions(t, c, "prefix_match")-matched, "all but the first found the prefix")

			// The stage span says why.
			last.ID = "traced"
			id, _, err := runTraced(ctx, c, last)
			require.NoError(t, err)
			waitSpans(t, rec, id, telemetry.StageSpanName("thinker"), 1)
			s := treeOf(rec, id).named(telemetry.StageSpanName("thinker"))[0]
			assert.Equal(t, int64(home), attr(s, telemetry.KeyReplicaID).AsInt64())
			assert.Equal(t, "prefix_aware", attr(s, telemetry.KeyRoutePolicy).AsString())
			assert.Equal(t, "prefix_match", attr(s, telemetry.KeyRouteReason).AsString())
			assert.Equal(t, source.want, attr(s, telemetry.KeyRoutePrefixSource).AsString())
			input := attr(s, telemetry.KeyRoutePrefixInputBlocks).AsInt64()
			match := attr(s, telemetry.KeyRoutePrefixMatchBlocks).AsInt64()
			assert.Positive(t, match)
			assert.LessOrEqual(t, match, input)
			if source.want == "engine" {
				// The same prompt again: the engine holds every full block
				// of it (the sim caches whole 16-token blocks).
				assert.Equal(t, int64(len(tokenizers.Sim(last.Prompt))/sim.DefaultBlockSize), input)
				assert.Equal(t, input, match)
			}

			// Overload: requests that stay in flight, sent one after another
			// as soon as the previous one is running, all sharing the prefix.
			before, fallback := servedBy(t, c), decisions(t, c, "load_fallback")+decisions(t, c, "prefix_replicated")
			var g errgroup.Group
			const burst = 9
			for i := range burst {
				g.Go(func() error {
					_, err := c.Head.Execute(ctx, orchestrator.Request{ID: fmt.Sprint("b", i), Prompt: system + fmt.Sprintf("\nuser: burst %d", i), Sampling: sp(60)}, nil)
					return err
				})
				require.Eventually(t, func() bool { return totalInFlight(c) > int64(i) }, 30*time.Second, time.Millisecond)
			}
			require.NoError(t, g.Wait())
			got = grew(before, servedBy(t, c))
			assert.GreaterOrEqual(t, len(got), 2, "an overloaded home spills: %v", got)
			assert.Less(t, got[home], float64(burst))
			// The home spills as a hot prefix (prefix_replicated: above its
			// share of the load) before it is overloaded (load_fallback).
			assert.Positive(t, decisions(t, c, "load_fallback")+decisions(t, c, "prefix_replicated")-fallback)
		})
	}
}

// TestPrefixAwareInAStreamedPipeline: in a streamed audio request stage 0
// is routed on its prompt, and the later stages, whose input does not
// exist yet when they are routed, by load.
func TestPrefixAwareInAStreamedPipeline(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{Policy: "prefix_aware", ReplicasPerStage: 2})
	require.True(t, c.Head.Pipeline().StreamsBetweenStages())
	prompt := "system: " + strings.Repeat("speak every answer clearly and slowly for the listener ", 8) + "\nuser: hello"
	reason := func(stage, r string) float64 {
		v, _ := value(t, c.Metrics, "troupe_router_decisions_total", map[string]string{"stage": stage, "policy": "prefix_aware", "reason": r})
		return v
	}
	for i := range 2 {
		res, err := c.Head.Execute(ctxT(t), orchestrator.Request{ID: fmt.Sprint("a", i), Prompt: prompt, Sampling: sampling(8, 1), Stages: 3}, nil)
		require.NoError(t, err)
		require.NotEmpty(t, res.PCM)
	}
	assert.Equal(t, 1.0, reason("0", "prefix_match"), "the second request finds its prompt")
	for _, stage := range []string{"1", "2"} {
		assert.Equal(t, 2.0, reason(stage, "load"), "stage %s", stage)
		assert.Zero(t, reason(stage, "prefix_match"), "stage %s", stage)
	}
}
