package stats

import (
	"fmt"
	"strconv"
	"sync"
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

// families holds every stat family, built once in New.
type families struct {
	running, waiting, kvUsage, attached *prometheus.GaugeVec
	waitingByReason, sleepState         *prometheus.GaugeVec

	promptTokens, generationTokens          *prometheus.CounterVec
	promptBySource, success                 *prometheus.CounterVec
	prefixQueries, prefixHits, preemptions  *prometheus.CounterVec
	specDrafts, specDraftTokens, specAccept *prometheus.CounterVec
	specAcceptPerPos                        *prometheus.CounterVec

	promptCached *prometheus.CounterVec

	ttft, interToken, e2e          *prometheus.HistogramVec
	queue, prefill, decode         *prometheus.HistogramVec
	promptHist, genHist, iteration *prometheus.HistogramVec
	tpot, inference                *prometheus.HistogramVec
	maxGen, paramsMaxTokens        *prometheus.HistogramVec
	paramsN, prefillKV             *prometheus.HistogramVec

	stageInfo, cacheInfo *prometheus.GaugeVec
}

func newFamilies(maxModelLen int) *families {
	gauge := func(name, help string, extra ...string) *prometheus.GaugeVec {
		return prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: namespace, Name: name, Help: help},
			append(append([]string{}, replicaLabels...), extra...))
	}
	counter := func(name, help string, extra ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: namespace, Name: name, Help: help},
			append(append([]string{}, replicaLabels...), extra...))
	}
	histogram := func(name, help string, buckets []float64) *prometheus.HistogramVec {
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: namespace, Name: name, Help: help, Buckets: buckets},
			replicaLabels)
	}
	tokenBuckets := buckets125(maxModelLen)
	return &families{
		running:         gauge("num_requests_running", "Number of requests in model execution batches."),
		waiting:         gauge("num_requests_waiting", "Number of requests waiting to be processed."),
		kvUsage:         gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
		attached:        gauge("replica_attached", "1 while the replica is a member the head routes to, 0 after it left."),
		waitingByReason: gauge("num_requests_waiting_by_reason", "Number of requests waiting, by why they wait.", labelReason),
		sleepState:      gauge("engine_sleep_state", "1 for the engine's current sleep state, 0 for the others.", labelSleepState),

		promptTokens:     counter("prompt_tokens_total", "Number of prefill tokens processed."),
		generationTokens: counter("generation_tokens_total", "Number of generation tokens processed."),
		promptBySource:   counter("prompt_tokens_by_source_total", "Number of prompt tokens by where they came from.", labelSource),
		success:          counter("request_success_total", "Count of finished requests, by finish reason.", labelFinishedReason),
		prefixQueries:    counter("prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens."),
		prefixHits:       counter("prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens."),
		preemptions:      counter("num_preemptions_total", "Cumulative number of preemptions from the engine."),
		specDrafts:       counter("spec_decode_num_drafts_total", "Number of spec decoding drafts."),
		specDraftTokens:  counter("spec_decode_num_draft_tokens_total", "Number of draft tokens."),
		specAccept:       counter("spec_decode_num_accepted_tokens_total", "Number of accepted tokens."),
		specAcceptPerPos: counter("spec_decode_num_accepted_tokens_per_pos_total", "Accepted tokens per draft position.", labelPosition),
		promptCached:     counter("prompt_tokens_cached_total", "Number of cached prompt tokens (local + external)."),

		ttft:            histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.", ttftBuckets),
		interToken:      histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", interTokenBuckets),
		e2e:             histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", requestLatencyBuckets),
		queue:           histogram("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", requestLatencyBuckets),
		prefill:         histogram("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", requestLatencyBuckets),
		decode:          histogram("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", requestLatencyBuckets),
		promptHist:      histogram("request_prompt_tokens", "Number of prefill tokens processed.", tokenBuckets),
		genHist:         histogram("request_generation_tokens", "Number of generation tokens processed.", tokenBuckets),
		iteration:       histogram("iteration_tokens_total", "Histogram of number of tokens per engine step.", iterationTokenBuckets),
		tpot:            histogram("request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.", interTokenBuckets),
		inference:       histogram("request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", requestLatencyBuckets),
		maxGen:          histogram("request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.", tokenBuckets),
		paramsMaxTokens: histogram("request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokenBuckets),
		paramsN:         histogram("request_params_n", "Histogram of the n request parameter.", paramsNBuckets),
		prefillKV:       histogram("request_prefill_kv_computed_tokens", "Histogram of new KV tokens computed during prefill (excluding cached tokens).", tokenBuckets),

		stageInfo: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: namespace, Name: "stage_info",
			Help: "Information about a pipeline stage; always 1."}, []string{labelStage, labelStageName}),
		cacheInfo: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: namespace, Name: "cache_config_info",
			Help: "Information of a replica's engine and cache config; always 1."}, cacheInfoLabels),
	}
}

// collectors lists every family, for registration.
func (f *families) collectors() []prometheus.Collector {
	return []prometheus.Collector{
		f.running, f.waiting, f.kvUsage, f.attached, f.waitingByReason, f.sleepState,
		f.promptTokens, f.generationTokens, f.promptBySource, f.success,
		f.prefixQueries, f.prefixHits, f.preemptions,
		f.specDrafts, f.specDraftTokens, f.specAccept, f.specAcceptPerPos, f.promptCached,
		f.ttft, f.interToken, f.e2e, f.queue, f.prefill, f.decode,
		f.promptHist, f.genHist, f.iteration,
		f.tpot, f.inference, f.maxGen, f.paramsMaxTokens, f.paramsN, f.prefillKV,
		f.stageInfo, f.cacheInfo,
	}
}

// engine holds one replica's pre-bound children. Everything Record and
// RecordFinished touch is either immutable after bind or atomic, so they run
// without locks. Fields below "writer side" belong to Logger.mu.
type engine struct {
	lv [3]string // model_name, stage, replica

	running, waiting, kvUsage, attached prometheus.Gauge
	waitingBy                           [2]prometheus.Gauge
	sleep                               [len(stagepb.SleepStates)]prometheus.Gauge
	sleepMu                             sync.Mutex // makes the three sleep gauges change together

	promptTokens, generationTokens         prometheus.Counter
	promptBySource                         [3]prometheus.Counter
	success                                [len(stagepb.FinishReasons)]prometheus.Counter
	prefixQueries, prefixHits, preemptions prometheus.Counter
	promptCached                           prometheus.Counter
	spec                                   atomic.Pointer[specChildren] // nil when K was always 0

	ttft, e2e                                               exemplarHistogram
	interToken, queue, prefill, decode, promptHist, genHist prometheus.Observer
	iteration, tpot, inference, maxGen                      prometheus.Observer
	paramsMaxTokens, paramsN, prefillKV                     prometheus.Observer

	// detached is set by Detach before it zeroes the live-load gauges, and
	// cleared by Register; Record reads it to leave those gauges alone.
	detached atomic.Bool

	// writer side
	detachedAt  time.Time
	cacheLabels []string
}

// exemplarHistogram is a histogram child that takes exemplars.
type exemplarHistogram interface {
	prometheus.Observer
	prometheus.ExemplarObserver
}

// specChildren are the spec-decode counters of one replica. Replaced whole
// (never mutated) when a rejoin raises K, so Record sees a consistent set.
type specChildren struct {
	drafts, draftTokens, accepted prometheus.Counter
	perPos                        []prometheus.Counter // index = position
}

// bind creates (at 0) every child of one replica and returns them.
func (f *families) bind(lv [3]string, k int) (*engine, error) {
	e := &engine{lv: lv}
	m, s, r := lv[0], lv[1], lv[2]
	e.running = f.running.WithLabelValues(m, s, r)
	e.waiting = f.waiting.WithLabelValues(m, s, r)
	e.kvUsage = f.kvUsage.WithLabelValues(m, s, r)
	e.attached = f.attached.WithLabelValues(m, s, r)
	for i, v := range waitingReasons {
		e.waitingBy[i] = f.waitingByReason.WithLabelValues(m, s, r, v)
	}
	for i, v := range sleepStates {
		e.sleep[i] = f.sleepState.WithLabelValues(m, s, r, v)
	}
	e.promptTokens = f.promptTokens.WithLabelValues(m, s, r)
	e.generationTokens = f.generationTokens.WithLabelValues(m, s, r)
	for i, v := range promptSources {
		e.promptBySource[i] = f.promptBySource.WithLabelValues(m, s, r, v)
	}
	for i, v := range finishedReasons {
		e.success[i] = f.success.WithLabelValues(m, s, r, v)
	}
	e.prefixQueries = f.prefixQueries.WithLabelValues(m, s, r)
	e.prefixHits = f.prefixHits.WithLabelValues(m, s, r)
	e.preemptions = f.preemptions.WithLabelValues(m, s, r)
	e.promptCached = f.promptCached.WithLabelValues(m, s, r)
	f.growSpec(e, k)

	var ok1, ok2 bool
	e.ttft, ok1 = f.ttft.WithLabelValues(m, s, r).(exemplarHistogram)
	e.e2e, ok2 = f.e2e.WithLabelValues(m, s, r).(exemplarHistogram)
	if !ok1 || !ok2 {
		return nil, fmt.Errorf("stats: histogram child does not take exemplars")
	}
	e.interToken = f.interToken.WithLabelValues(m, s, r)
	e.queue = f.queue.WithLabelValues(m, s, r)
	e.prefill = f.prefill.WithLabelValues(m, s, r)
	e.decode = f.decode.WithLabelValues(m, s, r)
	e.promptHist = f.promptHist.WithLabelValues(m, s, r)
	e.genHist = f.genHist.WithLabelValues(m, s, r)
	e.iteration = f.iteration.WithLabelValues(m, s, r)
	e.tpot = f.tpot.WithLabelValues(m, s, r)
	e.inference = f.inference.WithLabelValues(m, s, r)
	e.maxGen = f.maxGen.WithLabelValues(m, s, r)
	e.paramsMaxTokens = f.paramsMaxTokens.WithLabelValues(m, s, r)
	e.paramsN = f.paramsN.WithLabelValues(m, s, r)
	e.prefillKV = f.prefillKV.WithLabelValues(m, s, r)
	return e, nil
}

// growSpec makes sure the replica has spec-decode children for positions
// 0..k-1. It never removes any: counters of a replica are never deleted
// while it is known.
func (f *families) growSpec(e *engine, k int) {
	old := e.spec.Load()
	have := 0
	if old != nil {
		have = len(old.perPos)
	}
	if k <= 0 || (old != nil && k <= have) {
		return
	}
	m, s, r := e.lv[0], e.lv[1], e.lv[2]
	next := &specChildren{
		drafts:      f.specDrafts.WithLabelValues(m, s, r),
		draftTokens: f.specDraftTokens.WithLabelValues(m, s, r),
		accepted:    f.specAccept.WithLabelValues(m, s, r),
		perPos:      make([]prometheus.Counter, k),
	}
	for pos := range k {
		next.perPos[pos] = f.specAcceptPerPos.WithLabelValues(m, s, r, strconv.Itoa(pos))
	}
	e.spec.Store(next)
}

// unbind deletes every series of one replica (TTL sweep).
func (f *families) unbind(e *engine) {
	m, s, r := e.lv[0], e.lv[1], e.lv[2]
	for _, v := range []*prometheus.GaugeVec{f.running, f.waiting, f.kvUsage, f.attached} {
		v.DeleteLabelValues(m, s, r)
	}
	for _, v := range waitingReasons {
		f.waitingByReason.DeleteLabelValues(m, s, r, v)
	}
	for _, v := range sleepStates {
		f.sleepState.DeleteLabelValues(m, s, r, v)
	}
	for _, v := range []*prometheus.CounterVec{f.promptTokens, f.generationTokens, f.prefixQueries, f.prefixHits, f.preemptions, f.promptCached} {
		v.DeleteLabelValues(m, s, r)
	}
	for _, v := range promptSources {
		f.promptBySource.DeleteLabelValues(m, s, r, v)
	}
	for _, v := range finishedReasons {
		f.success.DeleteLabelValues(m, s, r, v)
	}
	if sp := e.spec.Load(); sp != nil {
		f.specDrafts.DeleteLabelValues(m, s, r)
		f.specDraftTokens.DeleteLabelValues(m, s, r)
		f.specAccept.DeleteLabelValues(m, s, r)
		for pos := range sp.perPos {
			f.specAcceptPerPos.DeleteLabelValues(m, s, r, strconv.Itoa(pos))
		}
	}
	for _, v := range []*prometheus.HistogramVec{
		f.ttft, f.interToken, f.e2e, f.queue, f.prefill, f.decode, f.promptHist, f.genHist, f.iteration,
		f.tpot, f.inference, f.maxGen, f.paramsMaxTokens, f.paramsN, f.prefillKV,
	} {
		v.DeleteLabelValues(m, s, r)
	}
	if e.cacheLabels != nil {
		f.cacheInfo.DeleteLabelValues(e.cacheLabels...)
	}
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

// setSleep sets engine_sleep_state: 1 for s, 0 for the others.
func (e *engine) setSleep(s stagepb.SleepState) {
	e.sleepMu.Lock()
	defer e.sleepMu.Unlock()
	for i := range e.sleep {
		v := 0.0
		if stagepb.SleepState(i) == s {
			v = 1
		}
		e.sleep[i].Set(v)
	}
}

// zeroLoad sets the live-load gauges to 0.
func (e *engine) zeroLoad() {
	e.running.Set(0)
	e.waiting.Set(0)
	e.waitingBy[0].Set(0)
	e.waitingBy[1].Set(0)
}
