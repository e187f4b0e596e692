package openai

import (
	"fmt"
	"io"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Load is what an upstream's Prometheus metrics say about its load.
type Load struct {
	// Engine is the metric family prefix that matched: vllm, sglang,
	// llamacpp, or "" when none did (then everything else is zero).
	Engine       string
	Running      float64 // requests being computed
	Waiting      float64 // requests queued
	KVCacheUsage float64 // 0..1
	// HasPrefixCounters says whether the two cumulative prefix-cache
	// counters (tokens, as vLLM counts them) were found.
	HasPrefixCounters  bool
	PrefixCacheQueries float64
	PrefixCacheHits    float64
	// HasMMCounters says whether the two cumulative multimodal-cache
	// counters (media items, as vLLM counts them) were found.
	HasMMCounters  bool
	MMCacheQueries float64
	MMCacheHits    float64
	// CacheHitRate is SGLang's prefix-cache hit rate gauge (0..1). It is
	// parsed but not forwarded: the head has counters, not a rate.
	CacheHitRate float64
}

// metricNames maps one engine's metric names to Load's fields. Earlier
// names in a list win; a family is a gauge or a counter (the name is then
// tried with and without _total).
type metricNames struct {
	engine                    string
	running, waiting, kv      []string
	prefixQueries, prefixHits []string
	mmQueries, mmHits         []string
	hitRate                   []string
}

// engines are the published names: vLLM v1 (kv_cache_usage_perc;
// gpu_cache_usage_perc in older releases; gpu_prefix_cache_* in v0;
// mm_cache_* for the multimodal encoder cache, v0.11 on),
// SGLang and llama.cpp (server --metrics).
var engines = []metricNames{
	{
		engine:        "vllm",
		running:       []string{"vllm:num_requests_running"},
		waiting:       []string{"vllm:num_requests_waiting"},
		kv:            []string{"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"},
		prefixQueries: []string{"vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"},
		prefixHits:    []string{"vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"},
		mmQueries:     []string{"vllm:mm_cache_queries"},
		mmHits:        []string{"vllm:mm_cache_hits"},
	},
	{
		engine:  "sglang",
		running: []string{"sglang:num_running_reqs"},
		waiting: []string{"sglang:num_queue_reqs"},
		kv:      []string{"sglang:token_usage"},
		hitRate: []string{"sglang:cache_hit_rate"},
	},
	{
		engine:  "llamacpp",
		running: []string{"llamacpp:requests_processing"},
		waiting: []string{"llamacpp:requests_deferred"},
		kv:      []string{"llamacpp:kv_cache_usage_ratio"},
	},
}

// ParseMetrics reads Prometheus text exposition (format 0.0.4) with the
// Prometheus parser and maps the first engine whose running-requests
// family is present. Only series of model (their model_name label) count
// when model is set and any series carries that label value; otherwise
// every series counts. Counts and counters are summed over the series
// (data-parallel engines report one per rank); cache usage and hit rate
// are averaged.
func ParseMetrics(r io.Reader, model string) (Load, error) {
	p := expfmt.NewTextParser(modelValidation)
	fams, err := p.TextToMetricFamilies(r)
	if err != nil {
		return Load{}, fmt.Errorf("openai: parse metrics: %w", err)
	}
	for _, e := range engines {
		running, ok := find(fams, e.running)
		if !ok {
			continue
		}
		l := Load{Engine: e.engine}
		l.Running = sum(running, model)
		if f, ok := find(fams, e.waiting); ok {
			l.Waiting = sum(f, model)
		}
		if f, ok := find(fams, e.kv); ok {
			l.KVCacheUsage = mean(f, model)
		}
		q, okQ := find(fams, e.prefixQueries)
		h, okH := find(fams, e.prefixHits)
		if okQ && okH {
			l.HasPrefixCounters = true
			l.PrefixCacheQueries, l.PrefixCacheHits = sum(q, model), sum(h, model)
		}
		mq, okQ := find(fams, e.mmQueries)
		mh, okH := find(fams, e.mmHits)
		if okQ && okH {
			l.HasMMCounters = true
			l.MMCacheQueries, l.MMCacheHits = sum(mq, model), sum(mh, model)
		}
		if f, ok := find(fams, e.hitRate); ok {
			l.CacheHitRate = mean(f, model)
		}
		return l, nil
	}
	return Load{}, nil
}

// modelValidation accepts the colons of vllm:… and sglang:… names.
var modelValidation = model.UTF8Validation

// find returns the first family present under one of names, trying each
// name as it is and with _total (the text format names counters either way).
func find(fams map[string]*dto.MetricFamily, names []string) (*dto.MetricFamily, bool) {
	for _, n := range names {
		for _, k := range []string{n, n + "_total"} {
			if f, ok := fams[k]; ok && len(f.GetMetric()) > 0 {
				return f, true
			}
		}
	}
	return nil, false
}

// series returns the values of f's series that belong to model.
func series(f *dto.MetricFamily, model string) []float64 {
	all := make([]float64, 0, len(f.GetMetric()))
	var mine []float64
	for _, m := range f.GetMetric() {
		v := value(m)
		all = append(all, v)
		for _, lp := range m.GetLabel() {
			if lp.GetName() == "model_name" && model != "" && lp.GetValue() == model {
				mine = append(mine, v)
			}
		}
	}
	if len(mine) > 0 {
		return mine
	}
	return all
}

func value(m *dto.Metric) float64 {
	switch {
	case m.GetGauge() != nil:
		return m.GetGauge().GetValue()
	case m.GetCounter() != nil:
		return m.GetCounter().GetValue()
	case m.GetUntyped() != nil:
		return m.GetUntyped().GetValue()
	}
	return 0
}

func sum(f *dto.MetricFamily, model string) float64 {
	var s float64
	for _, v := range series(f, model) {
		s += v
	}
	return s
}

func mean(f *dto.MetricFamily, model string) float64 {
	vs := series(f, model)
	if len(vs) == 0 {
		return 0
	}
	var s float64
	for _, v := range vs {
		s += v
	}
	return s / float64(len(vs))
}
