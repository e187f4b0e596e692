package stats

import (
	"math"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

const namespace = "troupe"

// Label names of the metrics contract (docs/contracts.md).
const (
	labelModel          = "model_name"
	labelStage          = "stage"
	labelReplica        = "replica"
	labelStageName      = "stage_name"
	labelReason         = "reason"
	labelSource         = "source"
	labelSleepState     = "sleep_state"
	labelFinishedReason = "finished_reason"
	labelPosition       = "position"
)

// replicaLabels are the labels every per-replica series carries, in order.
var replicaLabels = []string{labelModel, labelStage, labelReplica}

// Values of the nested labels. Their order is the order of the arrays in
// engine, so Record indexes them without maps.
var (
	// waitingReasons: index 0 capacity, 1 deferred.
	waitingReasons = [2]string{"capacity", "deferred"}
	// promptSources: index 0 local_compute, 1 local_cache_hit, 2 external_kv_transfer.
	promptSources = [3]string{"local_compute", "local_cache_hit", "external_kv_transfer"}
	// sleepStates is indexed by stagepb.SleepState.
	sleepStates = namesOf(stagepb.SleepStates[:])
	// finishedReasons is indexed by stagepb.FinishReason - 1.
	finishedReasons = namesOf(stagepb.FinishReasons[:])
)

// namesOf returns the label values of protocol enum values, in order.
func namesOf[E interface{ Name() string }](values []E) []string {
	out := make([]string, len(values))
	for i, v := range values {
		out[i] = v.Name()
	}
	return out
}

// cacheInfoLabels are the labels of troupe_cache_config_info, in order. The
// engine kind is "engine_kind": in vLLM, "engine" is the engine index, and a
// join on it must not meet a kind name.
var cacheInfoLabels = []string{
	labelModel, labelStage, labelReplica,
	"engine_kind", "version",
	"block_size", "num_kv_blocks", "enable_prefix_caching", "max_num_seqs",
}

// Histogram buckets are vLLM's (vllm/v1/metrics/loggers.py) with finer
// floors below vLLM's lowest bound: the sim and fast stages (a vocoder, a
// cached prefill) finish in microseconds to milliseconds, which vLLM's
// buckets put all in the first one. Every vLLM bound is kept, so a
// dashboard or rule written for vLLM (le="0.3", histogram_quantile) reads
// troupe's histograms the same way (TestBucketsKeepVLLMBounds).
var (
	// vLLM: 0.001 ... 2560 (22 bounds); troupe adds 3 below.
	ttftBuckets = withFloor([]float64{0.0001, 0.00025, 0.0005}, vllmTTFTBuckets)
	// vLLM: 0.01 ... 80 (19 bounds), for inter-token latency and time per
	// output token; troupe adds 6 below.
	interTokenBuckets = withFloor([]float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005}, vllmInterTokenBuckets)
	// vLLM: 0.3 ... 7680 (21 bounds), for e2e, queue, prefill, decode and
	// inference time; troupe adds 7 below.
	requestLatencyBuckets = withFloor([]float64{0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1}, vllmRequestLatencyBuckets)
	iterationTokenBuckets = []float64{1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384}
	// request_params_n, as vLLM.
	paramsNBuckets = []float64{1, 2, 5, 10, 20}
)

// vLLM's own bounds, kept verbatim so the test can hold troupe to them.
var (
	vllmTTFTBuckets = []float64{
		0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
		0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
	}
	vllmInterTokenBuckets = []float64{
		0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
		1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
	}
	vllmRequestLatencyBuckets = []float64{
		0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
		40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
	}
)

// withFloor returns floor followed by vllm (floor must lie below vllm[0]).
func withFloor(floor, vllm []float64) []float64 {
	return append(append([]float64{}, floor...), vllm...)
}

// buckets125 returns 1, 2, 5, 10, 20, 50, ... up to max inclusive, as vLLM's
// build_1_2_5_buckets(max_model_len).
func buckets125(max int) []float64 {
	var out []float64
	for scale := 1; ; scale *= 10 {
		for _, m := range [3]int{1, 2, 5} {
			v := m * scale
			if v > max {
				return out
			}
			out = append(out, float64(v))
		}
	}
}

// Histograms of a replica, by index into engine.hists.
const (
	hTTFT = iota
	hInterToken
	hE2E
	hQueue
	hPrefill
	hDecode
	hPromptTokens
	hGenerationTokens
	hIteration
	hTPOT
	hInference
	hMaxGeneration
	hParamsMaxTokens
	hParamsN
	hPrefillKV
	numHistograms
)

// labelPos says where a family's nested label sorts among the replica
// labels (model_name < position < reason < replica < sleep_state < source <
// stage), so that both expositions write every label set in sorted order,
// as client_golang does.
type labelPos int

const (
	posBeforeModel labelPos = iota // finished_reason
	posAfterModel                  // position, reason
	posBeforeStage                 // sleep_state, source
	posNone                        // no nested label
)

// kind is what a family's series are made of.
type kind int

const (
	kindCounter      kind = iota // per replica, integral
	kindGauge                    // per replica, float
	kindHistogram                // per replica
	kindStageInfo                // one per stage
	kindCacheInfo                // one per replica, labels set at Register
	kindUnregistered             // troupe_stats_unregistered_records_total, no labels
)

// family is one metric family of the Logger, with what both expositions
// need: the descriptor for the Collector, and the pre-rendered text of the
// fast path (see expose.go). Built once, read-only afterwards.
type family struct {
	name, help string
	kind       kind
	label      string   // nested label name, "" if none
	pos        labelPos // where label sorts
	values     []string // nested label values
	// n is how many of values a replica has series for (len(values); K
	// for position; 0 where the replica has none of the family). nil:
	// len(values), or 1 without a nested label.
	n       func(e *engine) int
	counter func(e *engine, i int) uint64  // kindCounter
	gauge   func(e *engine, i int) float64 // kindGauge
	hist    int                            // kindHistogram: index into engine.hists
	bounds  []float64                      // kindHistogram

	desc *prometheus.Desc
	fast [numFormats]fastFamily
}

// aggregated says whether the family is kept per stage, not per replica,
// in minimal mode: every counter and histogram.
func (f *family) aggregated() bool { return f.kind == kindCounter || f.kind == kindHistogram }

func (f *family) count(e *engine) int {
	switch {
	case f.n != nil:
		return f.n(e)
	case f.values != nil:
		return len(f.values)
	}
	return 1
}

// positionValues are the label values of spec_decode_..._per_pos.
var positionValues = func() []string {
	out := make([]string, stagepb.MaxSpeculativeTokens)
	for i := range out {
		out[i] = strconv.Itoa(i)
	}
	return out
}()

func specK(e *engine) int { return int(e.specK.Load()) }

func specPresent(e *engine) int {
	if e.specK.Load() > 0 {
		return 1
	}
	return 0
}

// newFamilies lists every family of a Logger, sorted by name (the order of
// both expositions, as Gather sorts). Disabled loggers have only the
// unregistered-records counter.
func newFamilies(maxModelLen int, disabled bool) []*family {
	fams := []*family{{
		name: namespace + "_stats_unregistered_records_total",
		help: "Stat records for an engine index with no bound series; each is a bug in the caller.",
		kind: kindUnregistered,
	}}
	if !disabled {
		fams = append(fams, perReplicaFamilies(maxModelLen)...)
	}
	sort.Slice(fams, func(i, j int) bool { return fams[i].name < fams[j].name })
	for _, f := range fams {
		f.desc = prometheus.NewDesc(f.name, f.help, f.labelNames(), nil)
		f.prepare()
	}
	return fams
}

// labelNames are the variable labels of the family's descriptor, in the
// order the Collector passes their values.
func (f *family) labelNames() []string {
	switch f.kind {
	case kindUnregistered:
		return nil
	case kindStageInfo:
		return []string{labelStage, labelStageName}
	case kindCacheInfo:
		return cacheInfoLabels
	}
	names := append([]string{}, replicaLabels...)
	if f.label != "" {
		names = append(names, f.label)
	}
	return names
}

func perReplicaFamilies(maxModelLen int) []*family {
	counter := func(name, help string, get func(e *engine) *atomic.Uint64) *family {
		return &family{name: namespace + "_" + name, help: help, kind: kindCounter, pos: posNone,
			counter: func(e *engine, _ int) uint64 { return get(e).Load() }}
	}
	nestedCounter := func(name, help, label string, pos labelPos, values []string, get func(e *engine, i int) *atomic.Uint64) *family {
		return &family{name: namespace + "_" + name, help: help, kind: kindCounter, label: label, pos: pos, values: values,
			counter: func(e *engine, i int) uint64 { return get(e, i).Load() }}
	}
	gauge := func(name, help string, get func(e *engine) float64) *family {
		return &family{name: namespace + "_" + name, help: help, kind: kindGauge, pos: posNone,
			gauge: func(e *engine, _ int) float64 { return get(e) }}
	}
	histogram := func(name, help string, h int, bounds []float64) *family {
		return &family{name: namespace + "_" + name, help: help, kind: kindHistogram, pos: posNone, hist: h, bounds: bounds}
	}
	tokenBuckets := buckets125(maxModelLen)
	fams := []*family{
		gauge("num_requests_running", "Number of requests in model execution batches.", func(e *engine) float64 { return loadFloat(&e.running) }),
		gauge("num_requests_waiting", "Number of requests waiting to be processed.", func(e *engine) float64 { return loadFloat(&e.waiting) }),
		gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", func(e *engine) float64 { return loadFloat(&e.kvUsage) }),
		gauge("replica_attached", "1 while the replica is a member the head routes to, 0 after it left.", func(e *engine) float64 {
			if e.detached.Load() {
				return 0
			}
			return 1
		}),
		{name: namespace + "_num_requests_waiting_by_reason", help: "Number of requests waiting, by why they wait.",
			kind: kindGauge, label: labelReason, pos: posAfterModel, values: waitingReasons[:],
			gauge: func(e *engine, i int) float64 { return loadFloat(&e.waitingBy[i]) }},
		{name: namespace + "_engine_sleep_state", help: "1 for the engine's current sleep state, 0 for the others.",
			kind: kindGauge, label: labelSleepState, pos: posBeforeStage, values: sleepStates,
			gauge: func(e *engine, i int) float64 {
				if int(e.sleep.Load()) == i {
					return 1
				}
				return 0
			}},

		counter("prompt_tokens_total", "Number of prefill tokens processed.", func(e *engine) *atomic.Uint64 { return &e.promptTokens }),
		counter("generation_tokens_total", "Number of generation tokens processed.", func(e *engine) *atomic.Uint64 { return &e.generationTokens }),
		nestedCounter("prompt_tokens_by_source_total", "Number of prompt tokens by where they came from.", labelSource, posBeforeStage, promptSources[:],
			func(e *engine, i int) *atomic.Uint64 { return &e.promptBySource[i] }),
		nestedCounter("request_success_total", "Count of finished requests, by finish reason.", labelFinishedReason, posBeforeModel, finishedReasons,
			func(e *engine, i int) *atomic.Uint64 { return &e.success[i] }),
		counter("prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.", func(e *engine) *atomic.Uint64 { return &e.prefixQueries }),
		counter("prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.", func(e *engine) *atomic.Uint64 { return &e.prefixHits }),
		counter("num_preemptions_total", "Cumulative number of preemptions from the engine.", func(e *engine) *atomic.Uint64 { return &e.preemptions }),
		counter("prompt_tokens_cached_total", "Number of cached prompt tokens (local + external).", func(e *engine) *atomic.Uint64 { return &e.promptCached }),
		counter("mm_cache_queries_total", "Multi-modal cache queries, in terms of number of queried media items.", func(e *engine) *atomic.Uint64 { return &e.mmQueries }),
		counter("mm_cache_hits_total", "Multi-modal cache hits, in terms of number of cached media items.", func(e *engine) *atomic.Uint64 { return &e.mmHits }),
	}
	spec := []*family{
		counter("spec_decode_num_drafts_total", "Number of spec decoding drafts.", func(e *engine) *atomic.Uint64 { return &e.specDrafts }),
		counter("spec_decode_num_draft_tokens_total", "Number of draft tokens.", func(e *engine) *atomic.Uint64 { return &e.specDraftTokens }),
		counter("spec_decode_num_accepted_tokens_total", "Number of accepted tokens.", func(e *engine) *atomic.Uint64 { return &e.specAccepted }),
	}
	for _, f := range spec {
		f.n = specPresent
	}
	perPos := nestedCounter("spec_decode_num_accepted_tokens_per_pos_total", "Accepted tokens per draft position.", labelPosition, posAfterModel, positionValues,
		func(e *engine, i int) *atomic.Uint64 { return &e.specPerPos[i] })
	perPos.n = specK
	fams = append(fams, spec...)
	fams = append(fams, perPos,
		histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.", hTTFT, ttftBuckets),
		histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", hInterToken, interTokenBuckets),
		histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", hE2E, requestLatencyBuckets),
		histogram("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", hQueue, requestLatencyBuckets),
		histogram("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", hPrefill, requestLatencyBuckets),
		histogram("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", hDecode, requestLatencyBuckets),
		histogram("request_prompt_tokens", "Number of prefill tokens processed.", hPromptTokens, tokenBuckets),
		histogram("request_generation_tokens", "Number of generation tokens processed.", hGenerationTokens, tokenBuckets),
		histogram("iteration_tokens_total", "Histogram of number of tokens per engine step.", hIteration, iterationTokenBuckets),
		histogram("request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.", hTPOT, interTokenBuckets),
		histogram("request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", hInference, requestLatencyBuckets),
		histogram("request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.", hMaxGeneration, tokenBuckets),
		histogram("request_params_max_tokens", "Histogram of the max_tokens request parameter.", hParamsMaxTokens, tokenBuckets),
		histogram("request_params_n", "Histogram of the n request parameter.", hParamsN, paramsNBuckets),
		histogram("request_prefill_kv_computed_tokens", "Histogram of new KV tokens computed during prefill (excluding cached tokens).", hPrefillKV, tokenBuckets),
		&family{name: namespace + "_stage_info", help: "Information about a pipeline stage; always 1.", kind: kindStageInfo},
		&family{name: namespace + "_cache_config_info", help: "Information of a replica's engine and cache config; always 1.", kind: kindCacheInfo},
	)
	return fams
}

// engine holds one replica's series. Everything Record, RecordFinished,
// SetSleepState and the expositions touch is immutable after bind or
// atomic, so they run without locks. Fields below "writer side" belong to
// Logger.mu.
type engine struct {
	lv    [3]string // model_name, stage, replica
	stage int
	// sink gets the counters and histograms of Record and RecordFinished:
	// the engine itself, or in minimal mode its stage's aggregate (whose
	// replica label is ""; a minimal replica has no histograms).
	sink *engine
	// Pre-rendered, escaped label pairs of the fast exposition (expose.go):
	// mrs is `model_name="…",replica="…",stage="…"`; mr, rs and s the parts
	// a nested label goes between.
	mrs, mr, rs, s string
	created        time.Time // bind time: created timestamp of counters and histograms

	running, waiting, kvUsage atomic.Uint64 // float64 bits
	waitingBy                 [2]atomic.Uint64
	sleep                     atomic.Uint32 // stagepb.SleepState

	promptTokens, generationTokens         atomic.Uint64
	promptBySource                         [3]atomic.Uint64
	success                                [len(stagepb.FinishReasons)]atomic.Uint64
	prefixQueries, prefixHits, preemptions atomic.Uint64
	promptCached                           atomic.Uint64
	mmQueries, mmHits                      atomic.Uint64 // the multimodal encoder cache, in media parts

	// specK is K: spec-decode series exist for K > 0, positions 0..K-1.
	// It only grows while the replica is known.
	specK                                     atomic.Int32
	specDrafts, specDraftTokens, specAccepted atomic.Uint64
	specPerPos                                [stagepb.MaxSpeculativeTokens]atomic.Uint64

	hists [numHistograms]histogram

	// cache is the replica's cache_config_info series; replaced whole by
	// Register when it changes.
	cache atomic.Pointer[cacheInfo]

	// detached is set by Detach before it zeroes the live-load gauges, and
	// cleared by Register; Record reads it to leave those gauges alone.
	// replica_attached is its negation.
	detached atomic.Bool

	// writer side
	detachedAt time.Time
}

// cacheInfo is one troupe_cache_config_info series: its label values (in
// cacheInfoLabels order) and its label pairs rendered in sorted order.
type cacheInfo struct {
	values   []string
	rendered string
}

// bucketsOf returns the bounds of every histogram, by index.
func bucketsOf(fams []*family) [numHistograms][]float64 {
	var out [numHistograms][]float64
	for _, f := range fams {
		if f.kind == kindHistogram {
			out[f.hist] = f.bounds
		}
	}
	return out
}

// nativeRangeOf is the native bucket range of histogram i: seconds for the
// latency families, counts for the token and parameter families.
func nativeRangeOf(i int) nativeRange {
	switch i {
	case hTTFT, hInterToken, hE2E, hQueue, hPrefill, hDecode, hTPOT, hInference:
		return nativeSeconds
	}
	return nativeCounts
}

// newEngine makes one replica's series, all at 0, with the label values lv.
// Without bounds it has no histograms (a replica in minimal mode).
func newEngine(lv [3]string, bounds *[numHistograms][]float64, k int, now time.Time) *engine {
	e := &engine{lv: lv, created: now}
	e.sink = e
	e.stage, _ = strconv.Atoi(lv[1])
	m := labelPair(labelModel, lv[0])
	r := labelPair(labelReplica, lv[2])
	e.s = labelPair(labelStage, lv[1])
	e.mr = m + "," + r
	e.rs = r + "," + e.s
	e.mrs = e.mr + "," + e.s
	if bounds == nil {
		e.growSpec(k)
		return e
	}
	n := 0
	for i := range e.hists {
		n += nativeRangeOf(i).len()
	}
	native := make([]atomic.Uint64, n)
	for i := range e.hists {
		nr := nativeRangeOf(i)
		e.hists[i].init(bounds[i], nr, native[:nr.len():nr.len()], i == hTTFT || i == hE2E)
		native = native[nr.len():]
	}
	e.growSpec(k)
	return e
}

// growSpec makes sure the replica has spec-decode series for positions
// 0..k-1. It never removes any: counters of a replica are never deleted
// while it is known.
func (e *engine) growSpec(k int) {
	if k > int(e.specK.Load()) {
		e.specK.Store(int32(k))
	}
}

// setCache sets the cache_config_info series of r.
func (e *engine) setCache(r Replica) {
	values := cacheInfoValues(e.lv, r)
	if old := e.cache.Load(); old != nil && equalStrings(old.values, values) {
		return
	}
	byName := make(map[string]string, len(values))
	for i, n := range cacheInfoLabels {
		byName[n] = values[i]
	}
	names := append([]string{}, cacheInfoLabels...)
	sort.Strings(names)
	var b strings.Builder
	for i, n := range names {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(labelPair(n, byName[n]))
	}
	e.cache.Store(&cacheInfo{values: values, rendered: b.String()})
}

// cacheInfoValues are the label values of troupe_cache_config_info for r.
func cacheInfoValues(lv [3]string, r Replica) []string {
	out := []string{lv[0], lv[1], lv[2], r.Engine, r.Version, "", "", "", ""}
	if c := r.Cache; c != nil {
		out[5] = strconv.FormatUint(uint64(c.GetBlockSize()), 10)
		out[6] = strconv.FormatUint(uint64(c.GetNumKvBlocks()), 10)
		out[7] = strconv.FormatBool(c.GetEnablePrefixCaching())
		out[8] = strconv.FormatUint(uint64(c.GetMaxNumSeqs()), 10)
	}
	return out
}

// setSleep sets the sleep state; engine_sleep_state is 1 for it and 0 for
// the others, always together.
func (e *engine) setSleep(s stagepb.SleepState) { e.sleep.Store(uint32(s)) }

// zeroLoad sets the live-load gauges to 0.
func (e *engine) zeroLoad() {
	e.running.Store(0)
	e.waiting.Store(0)
	e.waitingBy[0].Store(0)
	e.waitingBy[1].Store(0)
}

func storeFloat(a *atomic.Uint64, v float64) { a.Store(math.Float64bits(v)) }

func loadFloat(a *atomic.Uint64) float64 { return math.Float64frombits(a.Load()) }

// labelPair renders name="value" with the value escaped as both text
// formats want it (backslash, double quote and line feed).
func labelPair(name, value string) string {
	return name + `="` + labelEscaper.Replace(value) + `"`
}

var labelEscaper = strings.NewReplacer(`\`, `\\`, "\n", `\n`, `"`, `\"`)
