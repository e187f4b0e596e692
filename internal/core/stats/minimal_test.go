package stats

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// TestMinimalExpositionEqualsGather: in minimal mode both expositions
// still write the same families and series (the stage aggregates with
// replica=""), and no replica has a counter or histogram of its own.
func TestMinimalExpositionEqualsGather(t *testing.T) {
	reg, l := richLoggerIn(t, ReplicaSeriesMinimal)
	requireFastEqualsGather(t, reg, l)
	text := fastEncoded(t, l, textFormat)
	require.Contains(t, text, `troupe_prompt_tokens_total{model_name="we\"ird\\model\nname",replica="",stage="0"} `)
	require.Contains(t, text, `troupe_e2e_request_latency_seconds_count{model_name="we\"ird\\model\nname",replica="",stage="1"} `)
	require.Contains(t, text, `troupe_spec_decode_num_accepted_tokens_per_pos_total{model_name="we\"ird\\model\nname",position="3",replica="",stage="1"} `)
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(line, "#") || !strings.Contains(line, `replica="1`) {
			continue
		}
		name := line[:strings.IndexByte(line, '{')]
		require.Truef(t, strings.Contains(name, "num_requests") || strings.Contains(name, "kv_cache_usage") ||
			strings.Contains(name, "replica_attached") || strings.Contains(name, "engine_sleep_state") ||
			strings.Contains(name, "cache_config_info"), "per-replica series in minimal mode: %s", line)
	}
}

// TestMinimalSeriesBoundBeforeRoutingKeptAfterLeaving holds the seed's
// rule in minimal mode: Register binds the replica's series (its 10
// gauges) and its stage's aggregates at 0 before any record; after Detach
// and Sweep the aggregates keep every count, swept replica's included.
func TestMinimalSeriesBoundBeforeRoutingKeptAfterLeaving(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1_700_000_000, 0)}
	reg, l := newTestLogger(t, Options{Series: ReplicaSeriesMinimal, DetachedSeriesTTL: time.Minute, Now: clock.now})
	require.NoError(t, l.Register(0, replica(0, 7)))

	s := gatherSeries(t, reg)
	require.Equal(t, 10, replicaSeriesCount(t, reg, 0, 7), "gauges (running, waiting, 2 by reason, kv, attached, 3 sleep states) and cache_config_info")
	require.Equal(t, 1.0, s[seriesKey("troupe_replica_attached", 0, 7)])
	agg := func(name string, extra ...string) string {
		return strings.Replace(seriesKey(name, 0, 0, extra...), `replica="0"`, `replica=""`, 1)
	}
	require.Contains(t, s, agg("troupe_prompt_tokens_total"), "stage aggregate bound at the first join")
	require.Contains(t, s, agg("troupe_e2e_request_latency_seconds_count"))
	require.NotContains(t, s, seriesKey("troupe_prompt_tokens_total", 0, 7))

	require.NoError(t, l.Register(1, replica(0, 8)))
	require.NoError(t, l.Record(0, &stagepb.EngineStats{PromptTokens: 5, NumRequestsRunning: 3}))
	require.NoError(t, l.Record(1, statsOf(7, 1)))
	require.NoError(t, l.RecordFinished(0, Finished{Reason: stagepb.FinishReason_FINISH_REASON_STOP, E2E: time.Second}))
	require.NoError(t, l.RecordFinished(1, Finished{Reason: stagepb.FinishReason_FINISH_REASON_LENGTH, E2E: time.Second}))
	s = gatherSeries(t, reg)
	require.Equal(t, 12.0, s[agg("troupe_prompt_tokens_total")])
	require.Equal(t, 2.0, s[agg("troupe_e2e_request_latency_seconds_count")])
	require.Equal(t, 3.0, s[seriesKey("troupe_num_requests_running", 0, 7)])

	require.NoError(t, l.Detach(0))
	s = gatherSeries(t, reg)
	require.Equal(t, 0.0, s[seriesKey("troupe_replica_attached", 0, 7)], "kept after leaving, at 0")
	require.Equal(t, 0.0, s[seriesKey("troupe_num_requests_running", 0, 7)])
	require.NoError(t, l.Record(0, statsOf(1, 0)), "a late record still counts")
	clock.t = clock.t.Add(2 * time.Minute)
	require.Equal(t, 1, l.Sweep(clock.t))
	s = gatherSeries(t, reg)
	require.Zero(t, replicaSeriesCount(t, reg, 0, 7), "swept")
	require.Equal(t, 13.0, s[agg("troupe_prompt_tokens_total")], "the stage keeps a swept replica's counts")
	requireFastEqualsGather(t, reg, l)
}

func TestParseReplicaSeries(t *testing.T) {
	for _, ok := range []string{"full", "minimal"} {
		m, err := ParseReplicaSeries(ok)
		require.NoError(t, err)
		require.Equal(t, ReplicaSeries(ok), m)
	}
	_, err := ParseReplicaSeries("none")
	require.ErrorContains(t, err, "stats: replica series")
	_, err = New(prometheus.NewRegistry(), testModel, Options{Series: "half"})
	require.Error(t, err)
}
