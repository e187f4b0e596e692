package stats

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// TestBucketsKeepVLLMBounds holds the latency buckets to both promises:
// every bound of vLLM's is there, in order (vLLM dashboards and rules that
// name a bound still work), and the floor reaches below what an instant
// stage measures (100 µs), where vLLM's lowest bound would swallow it all.
func TestBucketsKeepVLLMBounds(t *testing.T) {
	for _, c := range []struct {
		name        string
		troupe      []float64
		vllm        []float64
		vllmLowest  float64
		troupeFloor float64
	}{
		{"ttft", ttftBuckets, vllmTTFTBuckets, 0.001, 0.0001},
		{"inter-token", interTokenBuckets, vllmInterTokenBuckets, 0.01, 0.0001},
		{"request latency", requestLatencyBuckets, vllmRequestLatencyBuckets, 0.3, 0.0001},
	} {
		t.Run(c.name, func(t *testing.T) {
			require.Equal(t, c.vllmLowest, c.vllm[0], "vLLM's lowest bound")
			require.Equal(t, c.troupeFloor, c.troupe[0], "troupe's floor")
			for i := 1; i < len(c.troupe); i++ {
				require.Less(t, c.troupe[i-1], c.troupe[i], "bounds increase")
			}
			require.GreaterOrEqual(t, len(c.troupe), len(c.vllm))
			assert.Equal(t, c.vllm, c.troupe[len(c.troupe)-len(c.vllm):], "vLLM's bounds are the top of troupe's, unchanged")
		})
	}
}

// TestRecordFinishedRequestFamilies covers the per-request families the
// head derives from a finished request: inference time, time per output
// token, KV computed in prefill, the request parameters and the maximum
// generation tokens.
func TestRecordFinishedRequestFamilies(t *testing.T) {
	reg, l := newTestLogger(t, Options{})
	require.NoError(t, l.Register(0, replica(0, 1)))

	require.NoError(t, l.RecordFinished(0, Finished{
		Reason:       stagepb.FinishReason_FINISH_REASON_LENGTH,
		PromptTokens: 20, GenerationTokens: 11, PrefillComputedTokens: 4,
		E2E: 200 * time.Millisecond, Queue: 5 * time.Millisecond,
		Prefill: 20 * time.Millisecond, Decode: 150 * time.Millisecond,
		MaxTokensParam: 11, N: 1,
	}))
	// One token only, no parameters from the client: no time per output
	// token, no parameter samples.
	require.NoError(t, l.RecordFinished(0, Finished{
		Reason:       stagepb.FinishReason_FINISH_REASON_STOP,
		PromptTokens: 20, GenerationTokens: 1, PrefillComputedTokens: 0,
		E2E: 10 * time.Millisecond, Prefill: 1 * time.Millisecond, Decode: 0,
	}))

	got := gatherSeries(t, reg)
	wantCount := map[string]float64{
		"troupe_request_inference_time_seconds":        2,
		"troupe_request_time_per_output_token_seconds": 1,
		"troupe_request_prefill_kv_computed_tokens":    2,
		"troupe_request_max_num_generation_tokens":     2,
		"troupe_request_params_max_tokens":             1,
		"troupe_request_params_n":                      1,
	}
	wantSum := map[string]float64{
		"troupe_request_inference_time_seconds":        0.171, // 20+150 ms, then 1 ms
		"troupe_request_time_per_output_token_seconds": 0.015, // 150 ms over 10 tokens after the first
		"troupe_request_prefill_kv_computed_tokens":    4,
		"troupe_request_max_num_generation_tokens":     12,
		"troupe_request_params_max_tokens":             11,
		"troupe_request_params_n":                      1,
	}
	for name, n := range wantCount {
		assert.Equal(t, n, got[seriesKey(name+"_count", 0, 1)], name+" count")
		assert.InDelta(t, wantSum[name], got[seriesKey(name+"_sum", 0, 1)], 1e-9, name+" sum")
	}
}

func TestRecordCountsCachedPromptTokens(t *testing.T) {
	reg, l := newTestLogger(t, Options{})
	require.NoError(t, l.Register(0, replica(0, 1)))
	require.NoError(t, l.Record(0, &stagepb.EngineStats{
		PromptTokens: 40, PromptTokensLocalCompute: 8, PromptTokensLocalCacheHit: 16, PromptTokensExternalKvTransfer: 16,
	}))
	require.NoError(t, l.Record(0, &stagepb.EngineStats{PromptTokens: 5, PromptTokensLocalCompute: 5}))
	assert.Equal(t, 32.0, gatherSeries(t, reg)[seriesKey("troupe_prompt_tokens_cached_total", 0, 1)],
		"cached = local cache hits + external KV transfers")
}

func TestRecordFinishedRejectsNegativeNewFields(t *testing.T) {
	_, l := newTestLogger(t, Options{})
	require.NoError(t, l.Register(0, replica(0, 1)))
	for _, f := range []Finished{
		{Reason: stagepb.FinishReason_FINISH_REASON_STOP, PrefillComputedTokens: -1},
		{Reason: stagepb.FinishReason_FINISH_REASON_STOP, MaxTokensParam: -1},
		{Reason: stagepb.FinishReason_FINISH_REASON_STOP, N: -2},
	} {
		require.Error(t, l.RecordFinished(0, f), "%+v", f)
	}
}

// TestStageNamesBindStageInfo: the pipeline's stages are visible before any
// replica joins, and a join cannot rename one.
func TestStageNamesBindStageInfo(t *testing.T) {
	reg, l := newTestLogger(t, Options{StageNames: stageNames})
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP troupe_stage_info Information about a pipeline stage; always 1.
# TYPE troupe_stage_info gauge
troupe_stage_info{stage="0",stage_name="thinker"} 1
troupe_stage_info{stage="1",stage_name="talker"} 1
troupe_stage_info{stage="2",stage_name="vocoder"} 1
`), "troupe_stage_info"))
	n, err := testutil.GatherAndCount(reg, "troupe_replica_attached")
	require.NoError(t, err)
	require.Zero(t, n, "no replica series before a join")

	r := replica(1, 0)
	r.StageName = "speech"
	err = l.Register(0, r)
	require.True(t, errors.Is(err, ErrConflict), "got %v", err)
	require.NoError(t, l.Register(0, replica(1, 0)))

	_, err = New(prometheus.NewRegistry(), testModel, Options{StageNames: []string{"thinker", ""}})
	require.ErrorContains(t, err, "empty name for stage 1")

	// Disabled: nothing is registered, stage_info included.
	reg2, _ := newTestLogger(t, Options{Disabled: true, StageNames: stageNames})
	n, err = testutil.GatherAndCount(reg2, "troupe_stage_info")
	require.NoError(t, err)
	require.Zero(t, n)
}
