package openai

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func parseFile(t *testing.T, name, model string) Load {
	t.Helper()
	f, err := os.Open(filepath.Join("testdata", name))
	require.NoError(t, err)
	defer f.Close()
	l, err := ParseMetrics(f, model)
	require.NoError(t, err)
	return l
}

func TestParseMetrics(t *testing.T) {
	for _, tc := range []struct {
		file, model string
		want        Load
	}{
		{"vllm.prom", "Qwen/Qwen3-0.6B", Load{Engine: "vllm", Running: 7, Waiting: 6, KVCacheUsage: 0.375,
			HasPrefixCounters: true, PrefixCacheQueries: 12000, PrefixCacheHits: 4800,
			HasMMCounters: true, MMCacheQueries: 60, MMCacheHits: 24}},
		// No configured model: every series counts.
		{"vllm.prom", "", Load{Engine: "vllm", Running: 7, Waiting: 6, KVCacheUsage: 0.375,
			HasPrefixCounters: true, PrefixCacheQueries: 12000, PrefixCacheHits: 4800,
			HasMMCounters: true, MMCacheQueries: 60, MMCacheHits: 24}},
		{"vllm_v0.prom", "meta-llama/Llama-3.1-8B-Instruct", Load{Engine: "vllm", Running: 7, Waiting: 2, KVCacheUsage: 0.9,
			HasPrefixCounters: true, PrefixCacheQueries: 5000, PrefixCacheHits: 1234}},
		{"sglang.prom", "Qwen/Qwen2.5-7B-Instruct", Load{Engine: "sglang", Running: 6, Waiting: 9, KVCacheUsage: 0.3, CacheHitRate: 0.625}},
		{"llamacpp.prom", "", Load{Engine: "llamacpp", Running: 2, Waiting: 1, KVCacheUsage: 0.125}},
		{"other.prom", "", Load{}},
	} {
		t.Run(tc.file+"/"+tc.model, func(t *testing.T) {
			got := parseFile(t, tc.file, tc.model)
			assert.Equal(t, tc.want.Engine, got.Engine)
			assert.InDelta(t, tc.want.Running, got.Running, 1e-9)
			assert.InDelta(t, tc.want.Waiting, got.Waiting, 1e-9)
			assert.InDelta(t, tc.want.KVCacheUsage, got.KVCacheUsage, 1e-9)
			assert.Equal(t, tc.want.HasPrefixCounters, got.HasPrefixCounters)
			assert.InDelta(t, tc.want.PrefixCacheQueries, got.PrefixCacheQueries, 1e-9)
			assert.InDelta(t, tc.want.PrefixCacheHits, got.PrefixCacheHits, 1e-9)
			assert.InDelta(t, tc.want.CacheHitRate, got.CacheHitRate, 1e-9)
			assert.Equal(t, tc.want.HasMMCounters, got.HasMMCounters)
			assert.InDelta(t, tc.want.MMCacheQueries, got.MMCacheQueries, 1e-9)
			assert.InDelta(t, tc.want.MMCacheHits, got.MMCacheHits, 1e-9)
		})
	}
}

// TestParseMetricsModelFilter: an upstream that serves two models reports
// only ours.
func TestParseMetricsModelFilter(t *testing.T) {
	text := `# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 3
vllm:num_requests_running{model_name="b"} 40
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="a"} 1
vllm:num_requests_waiting{model_name="b"} 10
`
	l, err := ParseMetrics(strings.NewReader(text), "a")
	require.NoError(t, err)
	assert.InDelta(t, 3, l.Running, 0)
	assert.InDelta(t, 1, l.Waiting, 0)
	l, err = ParseMetrics(strings.NewReader(text), "b")
	require.NoError(t, err)
	assert.InDelta(t, 40, l.Running, 0)
}

func TestParseMetricsRejectsGarbage(t *testing.T) {
	_, err := ParseMetrics(strings.NewReader("vllm:num_requests_running{model_name=\"a\" 3\n"), "")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "openai: parse metrics")
}

func TestEndpoints(t *testing.T) {
	for _, tc := range []struct{ in, base, root string }{
		{"http://h:8000/v1", "http://h:8000/v1", "http://h:8000"},
		{"http://h:8000/v1/", "http://h:8000/v1", "http://h:8000"},
		{"http://h:8000", "http://h:8000/v1", "http://h:8000"},
		{"http://h:8000/", "http://h:8000/v1", "http://h:8000"},
		{"https://api.example.com/openai/v1", "https://api.example.com/openai/v1", "https://api.example.com/openai"},
	} {
		base, root, err := Endpoints(tc.in)
		require.NoError(t, err, tc.in)
		assert.Equal(t, tc.base, base, tc.in)
		assert.Equal(t, tc.root, root, tc.in)
	}
	for _, bad := range []string{"h:8000", "ftp://h/v1", "http:///v1", "http://user:key@h/v1", "http://h/v1?x=1"} {
		_, _, err := Endpoints(bad)
		assert.Error(t, err, bad)
	}
}
