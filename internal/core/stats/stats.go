// Package stats is the head's Prometheus stat logger: the families of vLLM's
// PrometheusStatLogger under the troupe_ namespace, with one set of series
// per stage replica, keyed by the replica's engine index, which the head's
// loop assigns (docs/stats.md, "Engine indices").
//
// Unlike vLLM's logger, which builds its per-engine tables once for the
// engines it starts with (and rebuilds them, resetting every series, on
// scale-up), a Logger binds a replica's series when the replica joins, in
// O(1), and never resets or rebuilds the series of other replicas.
//
// The Logger stores its series itself (atomic counters, gauges and
// histograms, see hist.go) rather than as client_golang children, and
// serves them two ways: as a prometheus.Collector registered on the
// Registerer given to New (Gather: complete and slow, a dto.Metric per
// series), and through WriteMetrics, which writes the same families in the
// text format or OpenMetrics straight from the atomics (the /metrics path;
// docs/stats.md, "Scrapes: the fast path").
//
// Concurrency:
//   - Register, Detach and Sweep change membership. The head calls them from
//     its event loop goroutine; they are serialized by a mutex anyway.
//   - Record, RecordFinished and SetSleepState may be called concurrently from
//     any number of request goroutines, also while membership changes. They
//     take no locks and do not allocate: the index is resolved through a
//     lock-free paged table of pre-bound series.
//   - Collect, Describe, WriteMetrics and MetricFamilyNames may be called
//     concurrently with everything, also with themselves.
//
// Record on a replica that has been detached but not swept still counts: a
// chunk that arrives after the replica left describes work that happened, so
// its counter deltas and histogram samples are kept. Its engine snapshot
// gauges (running, waiting, KV-cache usage) are not applied, so a detached
// replica keeps showing no live load.
package stats

import (
	"errors"
	"fmt"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// MaxEngineIndex is the largest engine index the Logger can bind: its
// per-index table is sized for it. The head refuses joins beyond it.
const MaxEngineIndex = 1<<20 - 1

// DefaultMaxModelLen sets the upper bucket of the token-count histograms when
// Options.MaxModelLen is 0.
const DefaultMaxModelLen = 131072

var (
	// ErrNotRegistered is returned (wrapped) for an engine index that has no
	// bound series: never registered, or swept.
	ErrNotRegistered = errors.New("stats: engine index not registered")
	// ErrConflict is returned (wrapped) when a stage index is registered
	// under another name than before. Nothing is changed.
	ErrConflict = errors.New("stats: conflict")
)

// Replica describes one stage replica as it joins.
type Replica struct {
	Stage                int    // stage index in the pipeline (label "stage")
	StageName            string // stage name (troupe_stage_info)
	ReplicaID            uint32 // label "replica"
	NumSpeculativeTokens int    // K; spec-decode series exist for K > 0
	SleepState           stagepb.SleepState
	Engine, Version      string
	Addr                 string
	Cache                *stagepb.CacheConfig // may be nil
	// StageLabel, when set, is the value of the replica's "stage" label
	// instead of its index, and the replica adds no stage_info: a
	// worker's own endpoint, which knows its stage's name, not its index
	// in the pipeline (docs/stats.md, "Scraping the workers").
	StageLabel string
}

// Finished is one request on one replica, as the head measured it.
//
// TTFT is observed only when it is > 0 (0 means no token came). Each element
// of InterTokenLatencies is one sample of inter_token_latency_seconds, as in
// vLLM. E2E, Queue, Prefill and Decode (the last three from the worker's
// Timings), their sum Prefill+Decode (request_inference_time_seconds), the
// token counts, PrefillComputedTokens and GenerationTokens again as
// request_max_num_generation_tokens (troupe serves n=1, so the maximum over
// a request's sequences is its one sequence) are observed for every finished
// request. request_time_per_output_token_seconds is Decode/(GenerationTokens-1),
// observed only when GenerationTokens > 1 (vLLM also observes a 0 for shorter
// requests; a 0 is not a time per token). MaxTokensParam and N are observed
// only when > 0 (not set by the client, or not known).
//
// A non-empty TraceID is attached as exemplar {trace_id="..."} to the TTFT
// and e2e samples. A Finished with an unknown Reason, a negative value or an
// unusable TraceID is rejected whole.
type Finished struct {
	Reason                         stagepb.FinishReason
	PromptTokens, GenerationTokens int
	// PrefillComputedTokens: prompt tokens whose KV the engine computed
	// (the request's prompt_tokens_local_compute), not cache hits.
	PrefillComputedTokens  int
	TTFT, E2E              time.Duration
	InterTokenLatencies    []time.Duration
	Queue, Prefill, Decode time.Duration
	// MaxTokensParam is the request's max_tokens as sent to the stage (0:
	// not set); N its n parameter (0: not known).
	MaxTokensParam, N int
	TraceID           string
}

// Options configures a Logger.
type Options struct {
	// Disabled (--log-stats=false): no stat families are registered, and
	// every method is a no-op. troupe_stats_unregistered_records_total is
	// registered all the same.
	Disabled bool
	// DetachedSeriesTTL: Sweep deletes the series of replicas detached for
	// at least this long. 0 keeps them forever.
	DetachedSeriesTTL time.Duration
	// Now tells the time of a Detach; default time.Now.
	Now func() time.Time
	// MaxModelLen is the largest bucket bound of the token-count histograms
	// (1-2-5 series, as vLLM); default DefaultMaxModelLen.
	MaxModelLen int
	// StageNames are the pipeline's stage names by index. New sets
	// stage_info for each at once, so a stage that has no replica yet is
	// visible (the alert on a stage without replicas needs it). Register
	// refuses another name for one of these indexes.
	StageNames []string
	// Series is how much each replica has of its own (ReplicaSeriesFull,
	// the default, or ReplicaSeriesMinimal; see ReplicaSeries).
	Series ReplicaSeries
}

// ReplicaSeries says which families a Logger keeps per replica.
//
//   - ReplicaSeriesFull (the default, ""): every family per replica.
//   - ReplicaSeriesMinimal: per replica only the gauges (running, waiting,
//     waiting by reason, KV-cache usage, replica_attached, sleep state) and
//     cache_config_info, 10 series; every counter and histogram is kept
//     per stage instead, with replica="" (which Prometheus stores as no
//     replica label), so sum by (stage) reads the same in both modes. A
//     replica's gauges are still bound at Register and kept after Detach,
//     and its stage's aggregates exist from its stage's first Register and
//     are never swept.
type ReplicaSeries string

// The ReplicaSeries modes (--replica-series).
const (
	ReplicaSeriesFull    ReplicaSeries = "full"
	ReplicaSeriesMinimal ReplicaSeries = "minimal"
)

// ParseReplicaSeries reads a --replica-series value.
func ParseReplicaSeries(s string) (ReplicaSeries, error) {
	switch ReplicaSeries(s) {
	case ReplicaSeriesFull, ReplicaSeriesMinimal:
		return ReplicaSeries(s), nil
	}
	return "", fmt.Errorf("stats: replica series %q: want full or minimal", s)
}

// Logger owns the stat families of one head. Build it with New.
type Logger struct {
	disabled     bool
	model        string
	modelPair    string // model_name="…", escaped
	ttl          time.Duration
	now          func() time.Time
	unregistered atomic.Uint64
	fams         []*family // sorted by name
	bounds       [numHistograms][]float64
	table        engineTable
	// maxIndex is the highest index ever bound (-1: none); the
	// expositions walk the table up to it.
	maxIndex atomic.Int64
	// stages are the stage_info series, sorted by stage index; replaced
	// whole under mu.
	stages atomic.Pointer[[]stageSeries]
	// minimal: ReplicaSeriesMinimal. aggs are then the per-stage engines
	// that counters and histograms go to, sorted by stage; replaced whole
	// under mu.
	minimal bool
	aggs    atomic.Pointer[[]*engine]

	mu         sync.Mutex // serializes Register, Detach, Sweep
	byIndex    map[int]*engine
	stageNames map[int]string
	detached   map[int]struct{} // indices detached and not swept
	aggByStage map[int]*engine  // minimal: the stage aggregates
}

// stageSeries is one troupe_stage_info series.
type stageSeries struct {
	index    int
	name     string
	rendered string // stage="…",stage_name="…"
}

// New builds the families and registers the Logger, as a Collector, on reg
// (never the global registry). Series appear only as replicas register, so
// a head with no replicas exposes no stat series yet.
func New(reg prometheus.Registerer, model string, opts Options) (*Logger, error) {
	if reg == nil {
		return nil, errors.New("stats: nil prometheus registerer")
	}
	if model == "" {
		return nil, errors.New("stats: empty model name")
	}
	if opts.DetachedSeriesTTL < 0 {
		return nil, fmt.Errorf("stats: negative detached series TTL %v", opts.DetachedSeriesTTL)
	}
	if opts.MaxModelLen < 0 {
		return nil, fmt.Errorf("stats: negative max model len %d", opts.MaxModelLen)
	}
	if opts.MaxModelLen == 0 {
		opts.MaxModelLen = DefaultMaxModelLen
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Series != "" {
		if _, err := ParseReplicaSeries(string(opts.Series)); err != nil {
			return nil, err
		}
	}
	l := &Logger{
		minimal:    opts.Series == ReplicaSeriesMinimal,
		aggByStage: make(map[int]*engine),
		disabled:   opts.Disabled,
		model:      model,
		modelPair:  labelPair(labelModel, model),
		ttl:        opts.DetachedSeriesTTL,
		now:        opts.Now,
		byIndex:    make(map[int]*engine),
		stageNames: make(map[int]string),
		detached:   make(map[int]struct{}),
	}
	for i, name := range opts.StageNames {
		if name == "" {
			return nil, fmt.Errorf("stats: empty name for stage %d", i)
		}
	}
	l.maxIndex.Store(-1)
	l.fams = newFamilies(opts.MaxModelLen, opts.Disabled)
	l.bounds = bucketsOf(l.fams)
	if !opts.Disabled {
		for i, name := range opts.StageNames {
			l.stageNames[i] = name
		}
		l.publishStages()
	}
	if err := reg.Register(l); err != nil {
		return nil, fmt.Errorf("stats: register families: %w", err)
	}
	return l, nil
}

// publishStages renders stage_info from stageNames. Called with mu held
// (or before the Logger is shared).
func (l *Logger) publishStages() {
	stages := make([]stageSeries, 0, len(l.stageNames))
	for i, name := range l.stageNames {
		stages = append(stages, stageSeries{index: i, name: name,
			rendered: labelPair(labelStage, strconv.Itoa(i)) + "," + labelPair(labelStageName, name)})
	}
	sort.Slice(stages, func(i, j int) bool { return stages[i].index < stages[j].index })
	l.stages.Store(&stages)
}

func validateIndex(index int) error {
	if index < 0 || index >= maxEngines {
		return fmt.Errorf("stats: engine index %d out of range 0..%d", index, maxEngines-1)
	}
	return nil
}

func validateSleepState(s stagepb.SleepState) error {
	if s < 0 || int(s) >= len(sleepStates) {
		return fmt.Errorf("stats: unknown sleep state %d", s)
	}
	return nil
}

func (r Replica) validate() error {
	switch {
	case r.Stage < 0:
		return fmt.Errorf("stats: negative stage index %d", r.Stage)
	case r.StageName == "":
		return fmt.Errorf("stats: empty stage name for stage %d", r.Stage)
	case r.NumSpeculativeTokens < 0 || r.NumSpeculativeTokens > stagepb.MaxSpeculativeTokens:
		return fmt.Errorf("stats: num_speculative_tokens %d out of range 0..%d", r.NumSpeculativeTokens, stagepb.MaxSpeculativeTokens)
	}
	return validateSleepState(r.SleepState)
}

// Register binds every series of the replica at index at 0 (nested label
// tables, spec-decode positions 0..K-1, cache_config_info, and stage_info the
// first time its stage is seen), sets replica_attached=1 and the sleep state
// as reported. Its cost does not depend on how many replicas exist.
//
// The caller owns the mapping from (stage, replica) to index and must keep
// it stable: registering an index again (a rejoin or a changed record) keeps
// every counter, sets attached=1 and the reported sleep state, refreshes
// cache_config_info, and adds spec-decode positions if K grew (none is ever
// deleted). Another name for a known stage index is rejected with an error;
// nothing is changed.
func (l *Logger) Register(index int, r Replica) error {
	if l.disabled {
		return nil
	}
	if err := validateIndex(index); err != nil {
		return err
	}
	if err := r.validate(); err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	e := l.byIndex[index]
	name, stageKnown := l.stageNames[r.Stage]
	if stageKnown && name != r.StageName {
		return fmt.Errorf("%w: stage %d is named %q, not %q", ErrConflict, r.Stage, name, r.StageName)
	}

	swept := e != nil && l.table.load(index) == nil
	if e == nil || swept {
		stage := r.StageLabel
		if stage == "" {
			stage = strconv.Itoa(r.Stage)
		}
		lv := [3]string{l.model, stage, strconv.FormatUint(uint64(r.ReplicaID), 10)}
		if l.minimal {
			e = newEngine(lv, nil, r.NumSpeculativeTokens, time.Now())
			e.sink = l.stageAggregate(r.Stage)
		} else {
			e = newEngine(lv, &l.bounds, r.NumSpeculativeTokens, time.Now())
		}
	} else {
		e.growSpec(r.NumSpeculativeTokens)
	}
	e.sink.growSpec(r.NumSpeculativeTokens)
	if !stageKnown && r.StageLabel == "" {
		l.stageNames[r.Stage] = r.StageName
		l.publishStages()
	}
	e.setCache(r)
	e.setSleep(r.SleepState)
	e.detached.Store(false)
	e.detachedAt = time.Time{}
	delete(l.detached, index)

	l.byIndex[index] = e
	l.table.store(index, e)
	if int64(index) > l.maxIndex.Load() {
		l.maxIndex.Store(int64(index))
	}
	return nil
}

// stageAggregate returns the stage's aggregate engine (minimal mode),
// binding it on first use. Called with mu held.
func (l *Logger) stageAggregate(stage int) *engine {
	if a := l.aggByStage[stage]; a != nil {
		return a
	}
	a := newEngine([3]string{l.model, strconv.Itoa(stage), ""}, &l.bounds, 0, time.Now())
	l.aggByStage[stage] = a
	aggs := make([]*engine, 0, len(l.aggByStage))
	for _, e := range l.aggByStage {
		aggs = append(aggs, e)
	}
	sort.Slice(aggs, func(i, j int) bool { return aggs[i].stage < aggs[j].stage })
	l.aggs.Store(&aggs)
	return a
}

func equalStrings(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// Detach marks the replica at index as gone: replica_attached=0 and the
// live-load gauges (running, waiting, waiting by reason) 0. Every other series
// is kept, and later records still count. Detaching twice is harmless; the
// TTL runs from the first Detach.
func (l *Logger) Detach(index int) error {
	if l.disabled {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	e := l.table.load(index)
	if e == nil {
		return fmt.Errorf("stats: detach engine index %d: %w", index, ErrNotRegistered)
	}
	if !e.detached.Load() {
		e.detachedAt = l.now()
		l.detached[index] = struct{}{}
	}
	// Flag first, then zero: a concurrent Record either sees the flag or has
	// set its gauges before they are zeroed (see Record).
	e.detached.Store(true)
	e.zeroLoad()
	return nil
}

// Sweep deletes every series of each replica that has been detached for at
// least DetachedSeriesTTL at now, and returns how many replicas it swept. With
// a TTL of 0 it does nothing. Registering a swept index again binds fresh
// series at 0. Records for it fail until then.
func (l *Logger) Sweep(now time.Time) int {
	if l.disabled || l.ttl <= 0 {
		return 0
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for index := range l.detached {
		e := l.byIndex[index]
		if now.Sub(e.detachedAt) < l.ttl {
			continue
		}
		l.table.store(index, nil)
		delete(l.detached, index)
		n++
	}
	return n
}

// SetSleepState sets engine_sleep_state of the replica at index: 1 for s, 0
// for the other states. Safe for concurrent use.
func (l *Logger) SetSleepState(index int, s stagepb.SleepState) error {
	if l.disabled {
		return nil
	}
	if err := validateSleepState(s); err != nil {
		return err
	}
	e := l.table.load(index)
	if e == nil {
		return fmt.Errorf("stats: set sleep state of engine index %d: %w", index, ErrNotRegistered)
	}
	e.setSleep(s)
	return nil
}

// Registered reports whether index has bound series (registered and not
// swept). Safe for concurrent use.
func (l *Logger) Registered(index int) bool {
	return !l.disabled && l.table.load(index) != nil
}

// notRegistered counts a record for an unknown index and builds its error.
func (l *Logger) notRegistered(what string, index int) error {
	l.unregistered.Add(1)
	return fmt.Errorf("stats: %s for engine index %d: %w", what, index, ErrNotRegistered)
}

// Record applies one chunk's stats to the replica at index: counter fields
// are added (they are per-request deltas), snapshot fields overwrite the
// gauges (not on a detached replica), and each iteration_tokens element is
// one sample of iteration_tokens_total. prompt_tokens_cached_total gets the
// local cache hits plus the external KV transfers. Spec-decode fields count only for a
// replica registered with K > 0, and positions >= K are ignored. A nil s is
// nothing to record.
//
// An index without bound series is an error that is returned and counted in
// troupe_stats_unregistered_records_total; it never panics. Safe for
// concurrent use; it does not allocate.
func (l *Logger) Record(index int, s *stagepb.EngineStats) error {
	if l.disabled {
		return nil
	}
	e := l.table.load(index)
	if e == nil {
		return l.notRegistered("record", index)
	}
	if s == nil {
		return nil
	}
	recordCounters(e, s)
	if !e.detached.Load() {
		storeFloat(&e.running, float64(s.NumRequestsRunning))
		storeFloat(&e.waiting, float64(s.NumRequestsWaitingCapacity)+float64(s.NumRequestsWaitingDeferred))
		storeFloat(&e.waitingBy[0], float64(s.NumRequestsWaitingCapacity))
		storeFloat(&e.waitingBy[1], float64(s.NumRequestsWaitingDeferred))
		storeFloat(&e.kvUsage, s.KvCacheUsagePerc)
		// Detach may have zeroed the load gauges between the check above and
		// the sets; if so, undo the sets so a detached replica shows no load.
		if e.detached.Load() {
			e.zeroLoad()
		}
	}
	return nil
}

// recordCounters adds a chunk's counter deltas and iteration samples to
// e's sink: e itself, or its stage's aggregate in minimal mode. Spec
// decode counts only for a replica with K > 0, positions below its K.
func recordCounters(e *engine, s *stagepb.EngineStats) {
	t := e.sink
	add(&t.promptTokens, s.PromptTokens)
	add(&t.generationTokens, s.GenerationTokens)
	add(&t.promptBySource[0], s.PromptTokensLocalCompute)
	add(&t.promptBySource[1], s.PromptTokensLocalCacheHit)
	add(&t.promptBySource[2], s.PromptTokensExternalKvTransfer)
	add(&t.prefixQueries, s.PrefixCacheQueries)
	add(&t.prefixHits, s.PrefixCacheHits)
	add(&t.mmQueries, s.MmCacheQueries)
	add(&t.mmHits, s.MmCacheHits)
	add(&t.preemptions, s.NumPreemptions)
	add(&t.promptCached, s.PromptTokensLocalCacheHit+s.PromptTokensExternalKvTransfer)
	if k := int(e.specK.Load()); k > 0 {
		add(&t.specDrafts, s.SpecDecodeNumDrafts)
		add(&t.specDraftTokens, s.SpecDecodeNumDraftTokens)
		add(&t.specAccepted, s.SpecDecodeNumAcceptedTokens)
		for pos, v := range s.SpecDecodeNumAcceptedTokensPerPos {
			if pos >= k {
				break
			}
			add(&t.specPerPos[pos], v)
		}
	}
	for _, n := range s.IterationTokens {
		t.hists[hIteration].observe(float64(n))
	}
}

func add(c *atomic.Uint64, v uint64) {
	if v != 0 {
		c.Add(v)
	}
}

func (f *Finished) validate() error {
	if f.Reason < stagepb.FinishReason_FINISH_REASON_STOP || int(f.Reason) > len(finishedReasons) {
		return fmt.Errorf("stats: unknown finish reason %d", f.Reason)
	}
	if f.PromptTokens < 0 || f.GenerationTokens < 0 || f.PrefillComputedTokens < 0 {
		return fmt.Errorf("stats: negative token count (prompt %d, generation %d, prefill computed %d)", f.PromptTokens, f.GenerationTokens, f.PrefillComputedTokens)
	}
	if f.MaxTokensParam < 0 || f.N < 0 {
		return fmt.Errorf("stats: negative request parameter (max_tokens %d, n %d)", f.MaxTokensParam, f.N)
	}
	if f.TTFT < 0 || f.E2E < 0 || f.Queue < 0 || f.Prefill < 0 || f.Decode < 0 {
		return errors.New("stats: negative duration in finished request")
	}
	for _, d := range f.InterTokenLatencies {
		if d < 0 {
			return errors.New("stats: negative inter-token latency")
		}
	}
	if f.TraceID != "" {
		const name = "trace_id"
		if !utf8.ValidString(f.TraceID) || len(name)+utf8.RuneCountInString(f.TraceID) > prometheus.ExemplarMaxRunes {
			return fmt.Errorf("stats: trace id %.40q is not usable as an exemplar", f.TraceID)
		}
	}
	return nil
}

// RecordFinished counts one finished request in request_success_total and
// observes its histograms (see Finished). An unknown index is counted and
// returned like in Record. Safe for concurrent use; it takes no lock and
// does not allocate (a trace id longer than 48 bytes is copied once).
func (l *Logger) RecordFinished(index int, f Finished) error {
	if l.disabled {
		return nil
	}
	if err := f.validate(); err != nil {
		return err
	}
	e := l.table.load(index)
	if e == nil {
		return l.notRegistered("finished request", index)
	}
	t := e.sink // the replica, or its stage in minimal mode
	t.success[f.Reason-1].Add(1)
	var now int64
	if f.TraceID != "" {
		now = time.Now().UnixNano()
	}
	observe(&t.hists[hE2E], f.E2E.Seconds(), f.TraceID, now)
	if f.TTFT > 0 {
		observe(&t.hists[hTTFT], f.TTFT.Seconds(), f.TraceID, now)
	}
	for _, d := range f.InterTokenLatencies {
		t.hists[hInterToken].observe(d.Seconds())
	}
	t.hists[hQueue].observe(f.Queue.Seconds())
	t.hists[hPrefill].observe(f.Prefill.Seconds())
	t.hists[hDecode].observe(f.Decode.Seconds())
	t.hists[hInference].observe((f.Prefill + f.Decode).Seconds())
	t.hists[hPromptTokens].observe(float64(f.PromptTokens))
	t.hists[hGenerationTokens].observe(float64(f.GenerationTokens))
	t.hists[hMaxGeneration].observe(float64(f.GenerationTokens))
	t.hists[hPrefillKV].observe(float64(f.PrefillComputedTokens))
	if f.GenerationTokens > 1 {
		t.hists[hTPOT].observe(f.Decode.Seconds() / float64(f.GenerationTokens-1))
	}
	if f.MaxTokensParam > 0 {
		t.hists[hParamsMaxTokens].observe(float64(f.MaxTokensParam))
	}
	if f.N > 0 {
		t.hists[hParamsN].observe(float64(f.N))
	}
	return nil
}

// observe adds v to h, with traceID as its exemplar unless it is empty.
func observe(h *histogram, v float64, traceID string, nowNanos int64) {
	if traceID != "" {
		h.observeWithExemplar(v, traceID, nowNanos)
		return
	}
	h.observe(v)
}
