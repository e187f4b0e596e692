package stats

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// statFamilies are every per-replica family of the metrics contract.
var statFamilies = []string{
	"troupe_num_requests_running", "troupe_num_requests_waiting", "troupe_kv_cache_usage_perc",
	"troupe_num_requests_waiting_by_reason", "troupe_engine_sleep_state", "troupe_replica_attached",
	"troupe_prompt_tokens_total", "troupe_generation_tokens_total", "troupe_prompt_tokens_by_source_total",
	"troupe_request_success_total", "troupe_prefix_cache_queries_total", "troupe_prefix_cache_hits_total",
	"troupe_num_preemptions_total",
	"troupe_spec_decode_num_drafts_total", "troupe_spec_decode_num_draft_tokens_total",
	"troupe_spec_decode_num_accepted_tokens_total", "troupe_spec_decode_num_accepted_tokens_per_pos_total",
	"troupe_time_to_first_token_seconds", "troupe_inter_token_latency_seconds", "troupe_e2e_request_latency_seconds",
	"troupe_request_queue_time_seconds", "troupe_request_prefill_time_seconds", "troupe_request_decode_time_seconds",
	"troupe_request_prompt_tokens", "troupe_request_generation_tokens", "troupe_iteration_tokens_total",
	"troupe_prompt_tokens_cached_total", "troupe_mm_cache_queries_total", "troupe_mm_cache_hits_total",
	"troupe_request_time_per_output_token_seconds",
	"troupe_request_inference_time_seconds", "troupe_request_max_num_generation_tokens",
	"troupe_request_params_max_tokens", "troupe_request_params_n", "troupe_request_prefill_kv_computed_tokens",
	"troupe_stage_info", "troupe_cache_config_info",
}

func TestZeroInitialReplicas(t *testing.T) {
	reg, l := newTestLogger(t, Options{})

	// No replica: only the head's own counter, at 0.
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP troupe_stats_unregistered_records_total Stat records for an engine index with no bound series; each is a bug in the caller.
# TYPE troupe_stats_unregistered_records_total counter
troupe_stats_unregistered_records_total 0
`)))
	n, err := testutil.GatherAndCount(reg, statFamilies...)
	require.NoError(t, err)
	require.Equal(t, 0, n)

	// The first join brings the families.
	idx, err := newIndexes().Attach(replicaKey{Stage: 1, Replica: 4})
	require.NoError(t, err)
	require.NoError(t, l.Register(idx, replica(1, 4)))
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP troupe_replica_attached 1 while the replica is a member the head routes to, 0 after it left.
# TYPE troupe_replica_attached gauge
troupe_replica_attached{model_name="troupe-omni-sim",replica="4",stage="1"} 1
# HELP troupe_stage_info Information about a pipeline stage; always 1.
# TYPE troupe_stage_info gauge
troupe_stage_info{stage="1",stage_name="talker"} 1
`), "troupe_replica_attached", "troupe_stage_info"))
	require.NoError(t, l.Record(idx, statsOf(3, 1)))
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP troupe_prompt_tokens_total Number of prefill tokens processed.
# TYPE troupe_prompt_tokens_total counter
troupe_prompt_tokens_total{model_name="troupe-omni-sim",replica="4",stage="1"} 3
`), "troupe_prompt_tokens_total"))
}

// TestNewReplicaAtZero checks that Register binds every child of every family
// at 0 (awake = 1) before any record.
func TestNewReplicaAtZero(t *testing.T) {
	reg, l := newTestLogger(t, Options{})
	r := replica(0, 3)
	r.NumSpeculativeTokens = 2
	r.Cache = &stagepb.CacheConfig{BlockSize: 16, NumKvBlocks: 4096, EnablePrefixCaching: true, MaxNumSeqs: 256}
	require.NoError(t, l.Register(0, r))

	const lbl = `model_name="troupe-omni-sim",replica="3",stage="0"`
	expected := `
# HELP troupe_num_requests_running Number of requests in model execution batches.
# TYPE troupe_num_requests_running gauge
troupe_num_requests_running{` + lbl + `} 0
# HELP troupe_num_requests_waiting Number of requests waiting to be processed.
# TYPE troupe_num_requests_waiting gauge
troupe_num_requests_waiting{` + lbl + `} 0
# HELP troupe_kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE troupe_kv_cache_usage_perc gauge
troupe_kv_cache_usage_perc{` + lbl + `} 0
# HELP troupe_num_requests_waiting_by_reason Number of requests waiting, by why they wait.
# TYPE troupe_num_requests_waiting_by_reason gauge
` + seriesKey("troupe_num_requests_waiting_by_reason", 0, 3, "reason", "capacity") + ` 0
` + seriesKey("troupe_num_requests_waiting_by_reason", 0, 3, "reason", "deferred") + ` 0
# HELP troupe_engine_sleep_state 1 for the engine's current sleep state, 0 for the others.
# TYPE troupe_engine_sleep_state gauge
` + seriesKey("troupe_engine_sleep_state", 0, 3, "sleep_state", "awake") + ` 1
` + seriesKey("troupe_engine_sleep_state", 0, 3, "sleep_state", "discard_all") + ` 0
` + seriesKey("troupe_engine_sleep_state", 0, 3, "sleep_state", "weights_offloaded") + ` 0
# HELP troupe_replica_attached 1 while the replica is a member the head routes to, 0 after it left.
# TYPE troupe_replica_attached gauge
troupe_replica_attached{` + lbl + `} 1
# HELP troupe_prompt_tokens_total Number of prefill tokens processed.
# TYPE troupe_prompt_tokens_total counter
troupe_prompt_tokens_total{` + lbl + `} 0
# HELP troupe_generation_tokens_total Number of generation tokens processed.
# TYPE troupe_generation_tokens_total counter
troupe_generation_tokens_total{` + lbl + `} 0
# HELP troupe_prompt_tokens_by_source_total Number of prompt tokens by where they came from.
# TYPE troupe_prompt_tokens_by_source_total counter
` + seriesKey("troupe_prompt_tokens_by_source_total", 0, 3, "source", "external_kv_transfer") + ` 0
` + seriesKey("troupe_prompt_tokens_by_source_total", 0, 3, "source", "local_cache_hit") + ` 0
` + seriesKey("troupe_prompt_tokens_by_source_total", 0, 3, "source", "local_compute") + ` 0
# HELP troupe_request_success_total Count of finished requests, by finish reason.
# TYPE troupe_request_success_total counter
` + seriesKey("troupe_request_success_total", 0, 3, "finished_reason", "abort") + ` 0
` + seriesKey("troupe_request_success_total", 0, 3, "finished_reason", "error") + ` 0
` + seriesKey("troupe_request_success_total", 0, 3, "finished_reason", "length") + ` 0
` + seriesKey("troupe_request_success_total", 0, 3, "finished_reason", "stop") + ` 0
# HELP troupe_prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE troupe_prefix_cache_queries_total counter
troupe_prefix_cache_queries_total{` + lbl + `} 0
# HELP troupe_prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE troupe_prefix_cache_hits_total counter
troupe_prefix_cache_hits_total{` + lbl + `} 0
# HELP troupe_num_preemptions_total Cumulative number of preemptions from the engine.
# TYPE troupe_num_preemptions_total counter
troupe_num_preemptions_total{` + lbl + `} 0
# HELP troupe_prompt_tokens_cached_total Number of cached prompt tokens (local + external).
# TYPE troupe_prompt_tokens_cached_total counter
troupe_prompt_tokens_cached_total{` + lbl + `} 0
# HELP troupe_mm_cache_queries_total Multi-modal cache queries, in terms of number of queried media items.
# TYPE troupe_mm_cache_queries_total counter
troupe_mm_cache_queries_total{` + lbl + `} 0
# HELP troupe_mm_cache_hits_total Multi-modal cache hits, in terms of number of cached media items.
# TYPE troupe_mm_cache_hits_total counter
troupe_mm_cache_hits_total{` + lbl + `} 0
# HELP troupe_spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE troupe_spec_decode_num_drafts_total counter
troupe_spec_decode_num_drafts_total{` + lbl + `} 0
# HELP troupe_spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE troupe_spec_decode_num_draft_tokens_total counter
troupe_spec_decode_num_draft_tokens_total{` + lbl + `} 0
# HELP troupe_spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE troupe_spec_decode_num_accepted_tokens_total counter
troupe_spec_decode_num_accepted_tokens_total{` + lbl + `} 0
# HELP troupe_spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE troupe_spec_decode_num_accepted_tokens_per_pos_total counter
` + seriesKey("troupe_spec_decode_num_accepted_tokens_per_pos_total", 0, 3, "position", "0") + ` 0
` + seriesKey("troupe_spec_decode_num_accepted_tokens_per_pos_total", 0, 3, "position", "1") + ` 0
# HELP troupe_stage_info Information about a pipeline stage; always 1.
# TYPE troupe_stage_info gauge
troupe_stage_info{stage="0",stage_name="thinker"} 1
# HELP troupe_cache_config_info Information of a replica's engine and cache config; always 1.
# TYPE troupe_cache_config_info gauge
troupe_cache_config_info{block_size="16",enable_prefix_caching="true",engine_kind="sim",max_num_seqs="256",model_name="troupe-omni-sim",num_kv_blocks="4096",replica="3",stage="0",version="v0.1.0"} 1
`
	var nonHistogram []string
	for _, name := range statFamilies {
		if mf := familyOf(t, reg, name); mf == nil || mf.GetType() != 4 /* HISTOGRAM */ {
			nonHistogram = append(nonHistogram, name)
		}
	}
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(expected), nonHistogram...))

	// Histograms: one child each, empty, with vLLM's buckets (and troupe's
	// finer floors).
	wantBuckets := map[string][]float64{
		"troupe_request_time_per_output_token_seconds": interTokenBuckets,
		"troupe_request_inference_time_seconds":        requestLatencyBuckets,
		"troupe_request_max_num_generation_tokens":     buckets125(DefaultMaxModelLen),
		"troupe_request_params_max_tokens":             buckets125(DefaultMaxModelLen),
		"troupe_request_params_n":                      {1, 2, 5, 10, 20},
		"troupe_request_prefill_kv_computed_tokens":    buckets125(DefaultMaxModelLen),
		"troupe_time_to_first_token_seconds":           ttftBuckets,
		"troupe_inter_token_latency_seconds":           interTokenBuckets,
		"troupe_e2e_request_latency_seconds":           requestLatencyBuckets,
		"troupe_request_queue_time_seconds":            requestLatencyBuckets,
		"troupe_request_prefill_time_seconds":          requestLatencyBuckets,
		"troupe_request_decode_time_seconds":           requestLatencyBuckets,
		"troupe_request_prompt_tokens":                 buckets125(DefaultMaxModelLen),
		"troupe_request_generation_tokens":             buckets125(DefaultMaxModelLen),
		"troupe_iteration_tokens_total":                iterationTokenBuckets,
	}
	for name, buckets := range wantBuckets {
		mf := familyOf(t, reg, name)
		require.NotNil(t, mf, name)
		require.Len(t, mf.GetMetric(), 1, name)
		h := mf.GetMetric()[0].GetHistogram()
		require.Zero(t, h.GetSampleCount(), name)
		require.Zero(t, h.GetSampleSum(), name)
		var bounds []float64
		for _, b := range h.GetBucket() {
			require.Zero(t, b.GetCumulativeCount(), name)
			bounds = append(bounds, b.GetUpperBound())
		}
		require.Equal(t, buckets, bounds, name)
	}
	require.Equal(t, []float64{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000},
		buckets125(DefaultMaxModelLen))

	// Every family of the contract has exactly the children of this replica.
	n, err := testutil.GatherAndCount(reg, statFamilies...)
	require.NoError(t, err)
	const (
		gauges     = 1 + 1 + 1 + 2 + 3 + 1             // running, waiting, kv, by reason, sleep states, attached
		counters   = 1 + 1 + 3 + 4 + 1 + 1 + 1 + 1 + 2 // ..., mm cache queries and hits
		spec       = 1 + 1 + 1 + 2                     // K = 2 positions
		histograms = 15
		info       = 2
	)
	require.Equal(t, gauges+counters+spec+histograms+info, n)
}

func TestTwoStagesSparseIDs(t *testing.T) {
	reg, l := newTestLogger(t, Options{})
	rg := newIndexes()
	for _, k := range []replicaKey{{Stage: 0, Replica: 7}, {Stage: 1, Replica: 1000}, {Stage: 0, Replica: 2}} {
		idx, err := rg.Attach(k)
		require.NoError(t, err)
		require.NoError(t, l.Register(idx, replica(k.Stage, k.Replica)))
		require.NoError(t, l.Record(idx, statsOf(uint64(k.Replica), 0)))
	}
	// The replica label is the replica id, never the engine index (0, 1, 2).
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP troupe_prompt_tokens_total Number of prefill tokens processed.
# TYPE troupe_prompt_tokens_total counter
troupe_prompt_tokens_total{model_name="troupe-omni-sim",replica="2",stage="0"} 2
troupe_prompt_tokens_total{model_name="troupe-omni-sim",replica="7",stage="0"} 7
troupe_prompt_tokens_total{model_name="troupe-omni-sim",replica="1000",stage="1"} 1000
# HELP troupe_stage_info Information about a pipeline stage; always 1.
# TYPE troupe_stage_info gauge
troupe_stage_info{stage="0",stage_name="thinker"} 1
troupe_stage_info{stage="1",stage_name="talker"} 1
`), "troupe_prompt_tokens_total", "troupe_stage_info"))
}

// TestCounterPreservedAcrossJoin is the vLLM scale-up bug: another replica's
// join must not reset or rebuild an existing replica's counters.
func TestCounterPreservedAcrossJoin(t *testing.T) {
	reg, l := newTestLogger(t, Options{})
	rg := newIndexes()
	i0, err := rg.Attach(replicaKey{Stage: 0, Replica: 0})
	require.NoError(t, err)
	require.NoError(t, l.Register(i0, replica(0, 0)))
	require.NoError(t, l.Record(i0, statsOf(16, 0)))

	i1, err := rg.Attach(replicaKey{Stage: 0, Replica: 1})
	require.NoError(t, err)
	require.NoError(t, l.Register(i1, replica(0, 1)))
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP troupe_prompt_tokens_total Number of prefill tokens processed.
# TYPE troupe_prompt_tokens_total counter
troupe_prompt_tokens_total{model_name="troupe-omni-sim",replica="0",stage="0"} 16
troupe_prompt_tokens_total{model_name="troupe-omni-sim",replica="1",stage="0"} 0
`), "troupe_prompt_tokens_total"))

	require.NoError(t, l.Record(i0, statsOf(64, 0)))
	require.NoError(t, l.Record(i1, statsOf(64, 0)))
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP troupe_prompt_tokens_total Number of prefill tokens processed.
# TYPE troupe_prompt_tokens_total counter
troupe_prompt_tokens_total{model_name="troupe-omni-sim",replica="0",stage="0"} 80
troupe_prompt_tokens_total{model_name="troupe-omni-sim",replica="1",stage="0"} 64
`), "troupe_prompt_tokens_total"))
}

func TestRepeatRegistration(t *testing.T) {
	reg, l := newTestLogger(t, Options{})
	r := replica(2, 5)
	require.NoError(t, l.Register(0, r))
	require.NoError(t, l.Record(0, &stagepb.EngineStats{PromptTokens: 10, NumRequestsRunning: 2}))
	require.NoError(t, l.RecordFinished(0, Finished{Reason: stagepb.FinishReason_FINISH_REASON_STOP, E2E: time.Second}))

	// Same key, same index, new metadata and a sleeping engine.
	r.SleepState = stagepb.SleepState_SLEEP_STATE_WEIGHTS_OFFLOADED
	r.Version = "v0.2.0"
	r.Addr = "127.0.0.1:2"
	require.NoError(t, l.Register(0, r))
	require.NoError(t, l.Register(0, r), "registering twice in a row is idempotent")

	s := gatherSeries(t, reg)
	require.Equal(t, 10.0, s[seriesKey("troupe_prompt_tokens_total", 2, 5)])
	require.Equal(t, 1.0, s[seriesKey("troupe_request_success_total", 2, 5, "finished_reason", "stop")])
	require.Equal(t, 1.0, s[seriesKey("troupe_e2e_request_latency_seconds_count", 2, 5)])
	require.Equal(t, 2.0, s[seriesKey("troupe_num_requests_running", 2, 5)], "a repeated join leaves live gauges alone")
	require.Equal(t, 1.0, s[seriesKey("troupe_replica_attached", 2, 5)])
	require.Equal(t, 0.0, s[seriesKey("troupe_engine_sleep_state", 2, 5, "sleep_state", "awake")])
	require.Equal(t, 1.0, s[seriesKey("troupe_engine_sleep_state", 2, 5, "sleep_state", "weights_offloaded")])

	// cache_config_info follows the new record: one series, the new version.
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP troupe_cache_config_info Information of a replica's engine and cache config; always 1.
# TYPE troupe_cache_config_info gauge
troupe_cache_config_info{block_size="",enable_prefix_caching="",engine_kind="sim",max_num_seqs="",model_name="troupe-omni-sim",num_kv_blocks="",replica="5",stage="2",version="v0.2.0"} 1
`), "troupe_cache_config_info"))
}

func TestStageRenameConflicts(t *testing.T) {
	reg, l := newTestLogger(t, Options{})
	require.NoError(t, l.Register(0, replica(0, 1)))
	require.NoError(t, l.Record(0, statsOf(5, 0)))
	before := gatherSeries(t, reg)

	renamed := replica(0, 2)
	renamed.StageName = "other"
	err := l.Register(1, renamed)
	require.ErrorIs(t, err, ErrConflict, "stage 0 renamed")

	require.Equal(t, before, gatherSeries(t, reg), "nothing changed")
	require.False(t, l.Registered(1))
	require.ErrorIs(t, l.Record(1, statsOf(1, 0)), ErrNotRegistered)
}

func TestInvalidInput(t *testing.T) {
	reg, l := newTestLogger(t, Options{})
	bad := []struct {
		name  string
		index int
		r     Replica
	}{
		{"negative index", -1, replica(0, 0)},
		{"huge index", MaxEngineIndex + 1, replica(0, 0)},
		{"negative stage", 0, Replica{Stage: -1, StageName: "x"}},
		{"empty stage name", 0, Replica{Stage: 0}},
		{"negative K", 0, Replica{StageName: "x", NumSpeculativeTokens: -1}},
		{"huge K", 0, Replica{StageName: "x", NumSpeculativeTokens: stagepb.MaxSpeculativeTokens + 1}},
		{"bad sleep state", 0, Replica{StageName: "x", SleepState: 7}},
	}
	for _, tc := range bad {
		require.Error(t, l.Register(tc.index, tc.r), tc.name)
	}
	n, err := testutil.GatherAndCount(reg, statFamilies...)
	require.NoError(t, err)
	require.Zero(t, n, "a rejected Register binds nothing")

	_, err = New(nil, testModel, Options{})
	require.Error(t, err)
	_, err = New(prometheus.NewRegistry(), "", Options{})
	require.Error(t, err)
	_, err = New(prometheus.NewRegistry(), testModel, Options{DetachedSeriesTTL: -time.Second})
	require.Error(t, err)

	// A second logger on the same registry fails and leaves the first intact.
	_, err = New(reg, testModel, Options{})
	require.Error(t, err)
	require.NoError(t, l.Register(0, replica(0, 0)))
	require.Equal(t, 1.0, gatherSeries(t, reg)[seriesKey("troupe_replica_attached", 0, 0)])
}

func TestSpecDecodePositions(t *testing.T) {
	reg, l := newTestLogger(t, Options{})
	spec := replica(0, 0)
	spec.NumSpeculativeTokens = 3
	require.NoError(t, l.Register(0, spec))
	require.NoError(t, l.Register(1, replica(0, 1))) // K = 0

	const perPos = "troupe_spec_decode_num_accepted_tokens_per_pos_total"
	n, err := testutil.GatherAndCount(reg, perPos)
	require.NoError(t, err)
	require.Equal(t, 3, n, "positions 0..K-1 for the K=3 replica, none for K=0")
	require.Zero(t, replicaSpecSeries(t, reg, 0, 1), "no spec series for K=0")

	st := &stagepb.EngineStats{
		SpecDecodeNumDrafts: 2, SpecDecodeNumDraftTokens: 6, SpecDecodeNumAcceptedTokens: 4,
		SpecDecodeNumAcceptedTokensPerPos: []uint64{2, 1, 1, 9}, // position 3 >= K: ignored
	}
	require.NoError(t, l.Record(0, st))
	require.NoError(t, l.Record(1, st)) // K=0: spec fields ignored
	require.Zero(t, replicaSpecSeries(t, reg, 0, 1))

	// K grows on rejoin: positions 3 and 4 appear at 0, 0..2 keep their values.
	spec.NumSpeculativeTokens = 5
	require.NoError(t, l.Register(0, spec))
	// K shrinks: nothing is deleted.
	spec.NumSpeculativeTokens = 1
	require.NoError(t, l.Register(0, spec))
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP troupe_spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE troupe_spec_decode_num_accepted_tokens_per_pos_total counter
troupe_spec_decode_num_accepted_tokens_per_pos_total{model_name="troupe-omni-sim",position="0",replica="0",stage="0"} 2
troupe_spec_decode_num_accepted_tokens_per_pos_total{model_name="troupe-omni-sim",position="1",replica="0",stage="0"} 1
troupe_spec_decode_num_accepted_tokens_per_pos_total{model_name="troupe-omni-sim",position="2",replica="0",stage="0"} 1
troupe_spec_decode_num_accepted_tokens_per_pos_total{model_name="troupe-omni-sim",position="3",replica="0",stage="0"} 0
troupe_spec_decode_num_accepted_tokens_per_pos_total{model_name="troupe-omni-sim",position="4",replica="0",stage="0"} 0
# HELP troupe_spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE troupe_spec_decode_num_drafts_total counter
troupe_spec_decode_num_drafts_total{model_name="troupe-omni-sim",replica="0",stage="0"} 2
# HELP troupe_spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE troupe_spec_decode_num_draft_tokens_total counter
troupe_spec_decode_num_draft_tokens_total{model_name="troupe-omni-sim",replica="0",stage="0"} 6
# HELP troupe_spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE troupe_spec_decode_num_accepted_tokens_total counter
troupe_spec_decode_num_accepted_tokens_total{model_name="troupe-omni-sim",replica="0",stage="0"} 4
`), perPos, "troupe_spec_decode_num_drafts_total", "troupe_spec_decode_num_draft_tokens_total",
		"troupe_spec_decode_num_accepted_tokens_total"))

	// A K=0 replica that rejoins with K>0 gets spec series then.
	k0 := replica(0, 1)
	k0.NumSpeculativeTokens = 1
	require.NoError(t, l.Register(1, k0))
	require.Equal(t, 4, replicaSpecSeries(t, reg, 0, 1))
}

func replicaSpecSeries(t *testing.T, reg prometheus.Gatherer, stage int, id uint32) int {
	n := 0
	for k := range gatherSeries(t, reg) {
		if strings.HasPrefix(k, "troupe_spec_decode_") &&
			strings.Contains(k, `replica="`+itoa(int(id))+`"`) && strings.Contains(k, `stage="`+itoa(stage)+`"`) {
			n++
		}
	}
	return n
}

func TestSleepState(t *testing.T) {
	reg, l := newTestLogger(t, Options{})
	asleep := replica(1, 0)
	asleep.SleepState = stagepb.SleepState_SLEEP_STATE_DISCARD_ALL
	require.NoError(t, l.Register(0, asleep))
	require.NoError(t, l.Register(1, replica(1, 1)))

	check := func(stage int, id uint32, want string) {
		t.Helper()
		s := gatherSeries(t, reg)
		for _, state := range sleepStates {
			v, ok := s[seriesKey("troupe_engine_sleep_state", stage, id, "sleep_state", state)]
			require.True(t, ok, state)
			if state == want {
				require.Equal(t, 1.0, v, state)
			} else {
				require.Equal(t, 0.0, v, state)
			}
		}
	}
	check(1, 0, "discard_all")
	check(1, 1, "awake")

	require.NoError(t, l.SetSleepState(1, stagepb.SleepState_SLEEP_STATE_WEIGHTS_OFFLOADED))
	check(1, 1, "weights_offloaded")
	require.NoError(t, l.SetSleepState(0, stagepb.SleepState_SLEEP_STATE_AWAKE))
	check(1, 0, "awake")

	require.Error(t, l.SetSleepState(0, 3))
	require.ErrorIs(t, l.SetSleepState(9, stagepb.SleepState_SLEEP_STATE_AWAKE), ErrNotRegistered)
	check(1, 0, "awake")

	// A rejoin takes the state the worker reports: a new process is awake.
	require.NoError(t, l.Detach(1))
	require.NoError(t, l.Register(1, replica(1, 1)))
	check(1, 1, "awake")
}

func TestDetachKeepsSeries(t *testing.T) {
	reg, l := newTestLogger(t, Options{})
	require.NoError(t, l.Register(0, replica(0, 0)))
	require.NoError(t, l.Register(1, replica(0, 1)))
	require.NoError(t, l.Record(0, &stagepb.EngineStats{
		PromptTokens: 7, GenerationTokens: 3, NumRequestsRunning: 4,
		NumRequestsWaitingCapacity: 2, NumRequestsWaitingDeferred: 1, KvCacheUsagePerc: 0.5,
	}))
	require.NoError(t, l.RecordFinished(0, Finished{Reason: stagepb.FinishReason_FINISH_REASON_LENGTH, E2E: time.Second}))
	before := gatherSeries(t, reg)
	require.Equal(t, 3.0, before[seriesKey("troupe_num_requests_waiting", 0, 0)])

	require.NoError(t, l.Detach(0))
	require.NoError(t, l.Detach(0), "detach twice is harmless")
	after := gatherSeries(t, reg)
	require.Equal(t, len(before), len(after), "every series kept")
	changed := map[string]float64{
		seriesKey("troupe_replica_attached", 0, 0):                                     0,
		seriesKey("troupe_num_requests_running", 0, 0):                                 0,
		seriesKey("troupe_num_requests_waiting", 0, 0):                                 0,
		seriesKey("troupe_num_requests_waiting_by_reason", 0, 0, "reason", "capacity"): 0,
		seriesKey("troupe_num_requests_waiting_by_reason", 0, 0, "reason", "deferred"): 0,
	}
	for k, v := range before {
		if want, ok := changed[k]; ok {
			require.Equal(t, want, after[k], k)
			continue
		}
		require.Equal(t, v, after[k], k)
	}
	require.Equal(t, 0.5, after[seriesKey("troupe_kv_cache_usage_perc", 0, 0)], "kv usage is not live load: kept")

	// A late chunk after leave still counts, but sets no live load.
	require.NoError(t, l.Record(0, &stagepb.EngineStats{PromptTokens: 1, NumRequestsRunning: 9, IterationTokens: []uint32{4}}))
	require.NoError(t, l.RecordFinished(0, Finished{Reason: stagepb.FinishReason_FINISH_REASON_ABORT}))
	late := gatherSeries(t, reg)
	require.Equal(t, 8.0, late[seriesKey("troupe_prompt_tokens_total", 0, 0)])
	require.Equal(t, 1.0, late[seriesKey("troupe_iteration_tokens_total_count", 0, 0)])
	require.Equal(t, 1.0, late[seriesKey("troupe_request_success_total", 0, 0, "finished_reason", "abort")])
	require.Equal(t, 0.0, late[seriesKey("troupe_num_requests_running", 0, 0)])
	require.Equal(t, 1.0, late[seriesKey("troupe_replica_attached", 0, 1)], "the other replica is untouched")

	require.ErrorIs(t, l.Detach(7), ErrNotRegistered)
}

func TestRejoinContinuity(t *testing.T) {
	reg, l := newTestLogger(t, Options{})
	rg := newIndexes()
	k := replicaKey{Stage: 0, Replica: 3}
	idx, err := rg.Attach(k)
	require.NoError(t, err)
	require.NoError(t, l.Register(idx, replica(0, 3)))
	require.NoError(t, l.Record(idx, &stagepb.EngineStats{PromptTokens: 20, GenerationTokens: 5, PrefixCacheQueries: 20, PrefixCacheHits: 8, MmCacheQueries: 3, MmCacheHits: 2}))
	require.NoError(t, l.Detach(idx))

	// Another replica joins meanwhile; then 0/3 comes back as a new process.
	other, err := rg.Attach(replicaKey{Stage: 0, Replica: 4})
	require.NoError(t, err)
	require.NoError(t, l.Register(other, replica(0, 4)))
	again, err := rg.Attach(k)
	require.NoError(t, err)
	require.Equal(t, idx, again)
	r := replica(0, 3)
	r.Addr = "127.0.0.1:9"
	require.NoError(t, l.Register(again, r))
	require.NoError(t, l.Record(again, &stagepb.EngineStats{PromptTokens: 1, PrefixCacheQueries: 1, MmCacheQueries: 1}))

	s := gatherSeries(t, reg)
	require.Equal(t, 4.0, s[seriesKey("troupe_mm_cache_queries_total", 0, 3)])
	require.Equal(t, 2.0, s[seriesKey("troupe_mm_cache_hits_total", 0, 3)])
	require.Equal(t, 21.0, s[seriesKey("troupe_prompt_tokens_total", 0, 3)])
	require.Equal(t, 5.0, s[seriesKey("troupe_generation_tokens_total", 0, 3)])
	require.Equal(t, 21.0, s[seriesKey("troupe_prefix_cache_queries_total", 0, 3)])
	require.Equal(t, 8.0, s[seriesKey("troupe_prefix_cache_hits_total", 0, 3)])
	require.Equal(t, 1.0, s[seriesKey("troupe_replica_attached", 0, 3)])
	require.Equal(t, 0.0, s[seriesKey("troupe_prompt_tokens_total", 0, 4)])
}

func TestStatsDisabled(t *testing.T) {
	reg, l := newTestLogger(t, Options{Disabled: true})
	require.NoError(t, l.Register(0, replica(0, 0)))
	require.NoError(t, l.Record(0, statsOf(5, 5)))
	require.NoError(t, l.Record(42, statsOf(5, 5)))
	require.NoError(t, l.RecordFinished(0, Finished{Reason: stagepb.FinishReason_FINISH_REASON_STOP}))
	require.NoError(t, l.SetSleepState(0, stagepb.SleepState_SLEEP_STATE_AWAKE))
	require.NoError(t, l.Detach(0))
	require.Zero(t, l.Sweep(time.Now()))
	require.False(t, l.Registered(0))

	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP troupe_stats_unregistered_records_total Stat records for an engine index with no bound series; each is a bug in the caller.
# TYPE troupe_stats_unregistered_records_total counter
troupe_stats_unregistered_records_total 0
`)), "only the head's own counter is registered")

	// The stat family names stay free on the registry.
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: "troupe_prompt_tokens_total", Help: "x"})
	require.NoError(t, reg.Register(c))
}

func TestUnknownIndex(t *testing.T) {
	reg, l := newTestLogger(t, Options{})
	require.NoError(t, l.Register(0, replica(0, 0)))

	calls := []func() error{
		func() error { return l.Record(-1, statsOf(1, 1)) },
		func() error { return l.Record(math.MinInt, statsOf(1, 1)) },
		func() error { return l.Record(math.MaxInt, statsOf(1, 1)) },
		func() error { return l.Record(MaxEngineIndex+1, statsOf(1, 1)) },
		func() error { return l.Record(1, statsOf(1, 1)) },
		func() error { return l.Record(5000, nil) },
		func() error {
			return l.RecordFinished(3, Finished{Reason: stagepb.FinishReason_FINISH_REASON_STOP})
		},
	}
	for i, call := range calls {
		err := call()
		require.ErrorIs(t, err, ErrNotRegistered, "call %d", i)
	}
	require.NoError(t, l.Record(0, nil), "nil stats for a known index is nothing to record")

	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP troupe_stats_unregistered_records_total Stat records for an engine index with no bound series; each is a bug in the caller.
# TYPE troupe_stats_unregistered_records_total counter
troupe_stats_unregistered_records_total 7
`), "troupe_stats_unregistered_records_total"))
	require.Equal(t, 0.0, gatherSeries(t, reg)[seriesKey("troupe_prompt_tokens_total", 0, 0)])
}

func TestRecordFinished(t *testing.T) {
	reg, l := newTestLogger(t, Options{})
	require.NoError(t, l.Register(0, replica(0, 0)))
	const traceID = "4bf92f3577b34da6a3ce929d0e0e4736"
	require.NoError(t, l.RecordFinished(0, Finished{
		Reason: stagepb.FinishReason_FINISH_REASON_STOP, PromptTokens: 12, GenerationTokens: 3,
		TTFT: 50 * time.Millisecond, E2E: 2 * time.Second,
		InterTokenLatencies: []time.Duration{20 * time.Millisecond, 30 * time.Millisecond},
		Queue:               time.Millisecond, Prefill: 40 * time.Millisecond, Decode: 50 * time.Millisecond,
		TraceID: traceID,
	}))
	require.NoError(t, l.RecordFinished(0, Finished{Reason: stagepb.FinishReason_FINISH_REASON_ERROR, E2E: time.Second}))

	s := gatherSeries(t, reg)
	want := map[string]float64{
		seriesKey("troupe_request_success_total", 0, 0, "finished_reason", "stop"):   1,
		seriesKey("troupe_request_success_total", 0, 0, "finished_reason", "error"):  1,
		seriesKey("troupe_request_success_total", 0, 0, "finished_reason", "length"): 0,
		seriesKey("troupe_time_to_first_token_seconds_count", 0, 0):                  1, // the error had no first token
		seriesKey("troupe_time_to_first_token_seconds_sum", 0, 0):                    0.05,
		seriesKey("troupe_e2e_request_latency_seconds_count", 0, 0):                  2,
		seriesKey("troupe_e2e_request_latency_seconds_sum", 0, 0):                    3,
		seriesKey("troupe_inter_token_latency_seconds_count", 0, 0):                  2,
		seriesKey("troupe_request_queue_time_seconds_count", 0, 0):                   2,
		seriesKey("troupe_request_prefill_time_seconds_sum", 0, 0):                   0.04,
		seriesKey("troupe_request_decode_time_seconds_sum", 0, 0):                    0.05,
		seriesKey("troupe_request_prompt_tokens_sum", 0, 0):                          12,
		seriesKey("troupe_request_generation_tokens_sum", 0, 0):                      3,
		seriesKey("troupe_request_generation_tokens_count", 0, 0):                    2,
	}
	for k, v := range want {
		require.InDelta(t, v, s[k], 1e-9, k)
	}
	require.InDelta(t, 0.05, s[seriesKey("troupe_inter_token_latency_seconds_sum", 0, 0)], 1e-9)

	// The trace id is an exemplar on TTFT and e2e, in the bucket of the sample.
	for _, name := range []string{"troupe_time_to_first_token_seconds", "troupe_e2e_request_latency_seconds"} {
		mf := familyOf(t, reg, name)
		require.NotNil(t, mf)
		found := 0
		for _, b := range mf.GetMetric()[0].GetHistogram().GetBucket() {
			if ex := b.GetExemplar(); ex != nil {
				require.Len(t, ex.GetLabel(), 1)
				require.Equal(t, "trace_id", ex.GetLabel()[0].GetName())
				require.Equal(t, traceID, ex.GetLabel()[0].GetValue())
				found++
			}
		}
		require.Equal(t, 1, found, name)
	}

	// Invalid requests are rejected whole.
	before := gatherSeries(t, reg)
	for i, f := range []Finished{
		{Reason: stagepb.FinishReason_FINISH_REASON_UNSPECIFIED},
		{Reason: 9},
		{Reason: stagepb.FinishReason_FINISH_REASON_STOP, PromptTokens: -1},
		{Reason: stagepb.FinishReason_FINISH_REASON_STOP, E2E: -time.Second},
		{Reason: stagepb.FinishReason_FINISH_REASON_STOP, InterTokenLatencies: []time.Duration{-1}},
		{Reason: stagepb.FinishReason_FINISH_REASON_STOP, TraceID: strings.Repeat("a", 200)},
		{Reason: stagepb.FinishReason_FINISH_REASON_STOP, TraceID: "\xff"},
	} {
		err := l.RecordFinished(0, f)
		require.Error(t, err, "case %d", i)
		require.False(t, errors.Is(err, ErrNotRegistered), "case %d", i)
	}
	require.Equal(t, before, gatherSeries(t, reg))
}

func TestTTLSweep(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1_000_000, 0)}
	const ttl = time.Minute
	reg, l := newTestLogger(t, Options{DetachedSeriesTTL: ttl, Now: clock.now})
	for i := range 3 {
		require.NoError(t, l.Register(i, replica(0, uint32(i))))
		require.NoError(t, l.Record(i, statsOf(10, 0)))
	}
	perReplica := replicaSeriesCount(t, reg, 0, 0)
	require.Positive(t, perReplica)

	require.NoError(t, l.Detach(0))
	require.NoError(t, l.Detach(1))
	t0 := clock.t
	clock.t = t0.Add(30 * time.Second)
	require.NoError(t, l.Register(1, replica(0, 1)), "rejoin before the TTL cancels the sweep")

	require.Zero(t, l.Sweep(t0.Add(ttl-time.Nanosecond)))
	require.Equal(t, perReplica, replicaSeriesCount(t, reg, 0, 0))
	require.Equal(t, 1, l.Sweep(t0.Add(ttl)))
	require.Zero(t, replicaSeriesCount(t, reg, 0, 0), "every series of 0/0 deleted")
	require.Equal(t, perReplica, replicaSeriesCount(t, reg, 0, 1))
	require.Equal(t, perReplica, replicaSeriesCount(t, reg, 0, 2))
	require.Zero(t, l.Sweep(t0.Add(time.Hour)), "nothing left to sweep")
	require.NotNil(t, familyOf(t, reg, "troupe_stage_info"), "stage info stays")

	// Records for a swept replica fail and are counted.
	require.ErrorIs(t, l.Record(0, statsOf(1, 0)), ErrNotRegistered)
	require.Equal(t, 1.0, gatherSeries(t, reg)["troupe_stats_unregistered_records_total{}"])

	// The key rejoins at its index with fresh series.
	require.NoError(t, l.Register(0, replica(0, 0)))
	s := gatherSeries(t, reg)
	require.Equal(t, 0.0, s[seriesKey("troupe_prompt_tokens_total", 0, 0)])
	require.Equal(t, 10.0, s[seriesKey("troupe_prompt_tokens_total", 0, 1)])
	require.Equal(t, perReplica, replicaSeriesCount(t, reg, 0, 0))

	// TTL 0 keeps detached series forever.
	reg2, keep := newTestLogger(t, Options{Now: clock.now})
	require.NoError(t, keep.Register(0, replica(0, 0)))
	require.NoError(t, keep.Detach(0))
	require.Zero(t, keep.Sweep(clock.t.Add(24*365*time.Hour)))
	require.Equal(t, perReplica, replicaSeriesCount(t, reg2, 0, 0))
}

// TestHotPathsDoNotAllocate: Record, RecordFinished and SetSleepState.
func TestHotPathsDoNotAllocate(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates")
	}
	_, l := newTestLogger(t, Options{})
	r := replica(0, 0)
	r.NumSpeculativeTokens = 2
	require.NoError(t, l.Register(0, r))
	st := benchStats()
	allocs := testing.AllocsPerRun(1000, func() {
		if err := l.Record(0, st); err != nil {
			t.Fatal(err)
		}
	})
	require.Zero(t, allocs)
	// The other hot paths, a trace id of up to 48 bytes included.
	f := benchFinished()
	require.Zero(t, testing.AllocsPerRun(100, func() { _ = l.RecordFinished(0, f) }))
	require.Zero(t, testing.AllocsPerRun(100, func() { _ = l.SetSleepState(0, stagepb.SleepState_SLEEP_STATE_AWAKE) }))
}

func benchStats() *stagepb.EngineStats {
	return &stagepb.EngineStats{
		PromptTokens: 12, GenerationTokens: 1, PrefixCacheQueries: 12, PrefixCacheHits: 4,
		PromptTokensLocalCompute: 8, PromptTokensLocalCacheHit: 4,
		SpecDecodeNumDrafts: 1, SpecDecodeNumDraftTokens: 2, SpecDecodeNumAcceptedTokens: 1,
		SpecDecodeNumAcceptedTokensPerPos: []uint64{1, 0},
		IterationTokens:                   []uint32{13},
		NumRequestsRunning:                3, NumRequestsWaitingCapacity: 1, KvCacheUsagePerc: 0.25,
	}
}
