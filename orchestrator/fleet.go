package orchestrator

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	"golang.org/x/sync/errgroup"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/internal/core/sortedseq"
	"github.com/troupe-serving/troupe/internal/core/stats"
	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// fleet is the membership side of the head: it turns membership events
// into engine indexes, bound series and routable replicas, in that order,
// and publishes what it knows as immutable snapshots (the router's, and
// view for the API). Its loop goroutine, started by Run, is the one
// writer of everything below view; readers load the atomics.
type fleet struct {
	cfg     Config
	log     *slog.Logger
	watcher *membership.Watcher
	stats   *stats.Logger
	router  *router.Router
	etcd    *clientv3.Client
	created time.Time // when New built the head: the watch lag before its first list
	m       fleetMetrics

	// view is every replica the head knows, for the API: immutable copies
	// of the loop's records, sorted by key (see publish).
	view    atomic.Pointer[recordView]
	outputs atomic.Pointer[[]string] // by stage: the role its routed replicas give (see noteRouted)
	// journal is the view's next publish: the loop fills it in with the
	// keys it changes and opens the entry after it at every publish, so
	// admin calls can wait for the loop to apply a record (changed) and
	// ReplicaWatch follows the changes without reading the whole view.
	journal atomic.Pointer[viewChange]
	// served: every stage has had a routable replica since the head
	// started; until then a request without one is told the head starts.
	served atomic.Bool

	// Owned by the loop goroutine only. known is the one owner of the
	// mapping from replica key to engine index: an index is handed out on a
	// key's first join, in join order, and never reused or moved.
	known     map[router.Key]*tracked
	nextIndex int
	gen       uint64
	routed    routedIndex
	subs      map[router.Key]*cacheSub // cache subscriptions by replica key (see cacheSub)
	loadSubs  []int                    // by stage: subscriptions that follow load (see maxLoadSubs)
	batch     loopBatch

	// firstProbes bounds the joins whose first dial and Health are in
	// flight (maxFirstProbes; see probe).
	firstProbes chan struct{}
}

// fleetMetrics are the fleet's own metrics.
type fleetMetrics struct {
	events         *prometheus.CounterVec
	invalid        prometheus.Counter
	errors         *prometheus.CounterVec
	etcdUp         prometheus.Gauge   // set by MonitorEtcd, run by Run
	desired        []prometheus.Gauge // troupe_stage_desired_replicas by stage, set by runAutoscale
	cacheSnapshots prometheus.Counter // troupe_router_cache_snapshots_total
}

// routedIndex is what noteRouted keeps of the routed records.
type routedIndex struct {
	count []int                 // by stage: how many published records are routed
	io    []stageIO             // by stage: the roles of its routed replicas, while count > 0
	by    map[string]router.Key // routed records by their worker's instance id
}

// loopBatch is the batch the loop is applying (see flush): whether it
// holds one, the keys it changed, the records it routed (stamped when the
// snapshot that routes them is published), the sleep states its records
// give (applied once the view holds them), the stage outputs to publish
// (nil: unchanged), and whether waiters on changed are due a wake-up.
type loopBatch struct {
	batching bool
	dirty    map[router.Key]struct{}
	attached []*tracked
	sleeps   []pendingSleep
	outs     *[]string
	wake     bool
}

// tracked is the loop's record of one replica key. Published copies are
// immutable.
type tracked struct {
	key        router.Key
	member     membership.Member
	modRev     int64 // mod revision of member, the record applied last
	index      int
	joinedAt   time.Time
	detached   bool
	detachedAt time.Time
	probeGen   uint64             // generation of the pending probe; 0 when none
	leaveGen   uint64             // generation of the pending leave probe; 0 when none
	graceUntil time.Time          // non-zero: record gone, replica alive, still routed until then
	cancel     context.CancelFunc // cancels the pending probe
	io         stageIO            // what its engine takes and gives, from the probe
	routed     bool               // attached: its series are bound and the router has it
	noted      bool               // routed as noteRouted last counted it
	notedInst  string             // instance as noteRouted last indexed it
	refused    string             // why the head refused to route it (roles, identity); "" when not refused
	instance   string             // the worker's instance id, from the probe ("" for older workers)
	capacity   uint32             // max_num_seqs from the probe (0: not reported)
	times      joinTimes          // of its latest join
	live       rowState           // of its routed replica, as checkLive last saw it
}

// joinTimes are when the steps of a replica's latest join happened, for
// the attach log line and the join benchmark (see docs/benchmarks.md).
// Zero: not reached (yet).
type joinTimes struct {
	event    time.Time // its record's event reached the loop
	answered time.Time // its Health probe answered SERVING (probe goroutine)
	attach   time.Time // the loop took the answer
	bound    time.Time // its series are bound
	routed   time.Time // the router snapshot that routes to it is published
}

// newFleet builds the head's fleet and registers its metrics. It starts
// nothing; Run does.
func newFleet(cli *clientv3.Client, cfg Config, st *stats.Logger, rt *router.Router) (*fleet, error) {
	f := &fleet{
		cfg:         cfg,
		log:         cfg.Logger,
		stats:       st,
		router:      rt,
		etcd:        cli,
		created:     time.Now(),
		known:       map[router.Key]*tracked{},
		subs:        map[router.Key]*cacheSub{},
		loadSubs:    make([]int, len(cfg.Pipeline.Stages)),
		firstProbes: make(chan struct{}, maxFirstProbes),
		routed: routedIndex{
			count: make([]int, len(cfg.Pipeline.Stages)),
			io:    make([]stageIO, len(cfg.Pipeline.Stages)),
			by:    map[string]router.Key{},
		},
		batch: loopBatch{dirty: map[router.Key]struct{}{}},
	}
	f.watcher = membership.NewWatcher(cli, membership.WatchConfig{
		Cluster:           cfg.Cluster,
		Stages:            cfg.Pipeline.StageNames(),
		ReconcileInterval: cfg.ReconcileInterval,
		OnInvalid:         func(string, error) { f.m.invalid.Inc() },
		Logger:            cfg.Logger,
	})
	f.view.Store(sortedseq.New(func(t *tracked) router.Key { return t.key }, compareKeys))
	f.journal.Store(&viewChange{done: make(chan struct{})})
	outputs := make([]string, len(cfg.Pipeline.Stages))
	f.outputs.Store(&outputs)
	if err := f.registerMetrics(); err != nil {
		return nil, err
	}
	return f, nil
}

// registerMetrics makes the fleet's metrics, binds every child it knows
// of at 0, and registers them on cfg.Metrics.
func (f *fleet) registerMetrics() error {
	f.m.events = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "troupe_membership_events_total",
		Help: "Membership events applied by the head, by type.",
	}, []string{"type"})
	f.m.invalid = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "troupe_membership_invalid_records_total",
		Help: "Malformed membership records skipped by the head.",
	})
	f.m.errors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "troupe_head_attach_errors_total",
		Help: "Joins the head refused (index conflict, stats binding, dial, roles that do not fit the pipeline), by step.",
	}, []string{"step"})
	f.m.etcdUp = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "troupe_etcd_up",
		Help: "1 while the head's etcd client gets answers to a linearizable read (probed every 2s), else 0.",
	})
	watchLag := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "troupe_membership_watch_lag_seconds",
		Help: "Seconds since etcd last answered the head's membership watch (a list, an event or a progress notification, asked every 2s): how stale the head's view of the membership may be.",
	}, func() float64 {
		last := f.watcher.LastContact()
		if last.IsZero() {
			last = f.created
		}
		return time.Since(last).Seconds()
	})
	for _, t := range []string{"join", "leave"} {
		f.m.events.WithLabelValues(t)
	}
	for _, s := range []string{"attach", "stats", "dial", "router", "role"} {
		f.m.errors.WithLabelValues(s)
	}
	f.m.cacheSnapshots = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "troupe_router_cache_snapshots_total",
		Help: "Engine cache snapshots the head applied from SubscribeCache streams: one per replica subscribed, one more per subscription again (a seq gap, a subscriber that fell behind, a broken stream).",
	})
	for _, c := range []prometheus.Collector{f.m.events, f.m.invalid, f.m.errors, f.m.etcdUp, watchLag, leaseLostCollector{f}, stageReplicasCollector{f}, f.newDesiredReplicas(), f.m.cacheSnapshots} {
		if err := f.cfg.Metrics.Register(c); err != nil {
			return fmt.Errorf("orchestrator: register metrics: %w", err)
		}
	}
	return nil
}

// leaseLostDesc describes troupe_replica_lease_lost.
var leaseLostDesc = prometheus.NewDesc("troupe_replica_lease_lost",
	"1 while a replica's record is gone from etcd but the replica still serves (its worker lost etcd, or its lease expired: see --lease-loss-grace), else 0; for every replica not detached.",
	[]string{"model_name", "stage", "replica"}, nil)

// leaseLostCollector writes troupe_replica_lease_lost from the published
// view at each scrape: a worker cut off from etcd, as the head sees it.
type leaseLostCollector struct{ h *fleet }

func (c leaseLostCollector) Describe(ch chan<- *prometheus.Desc) { ch <- leaseLostDesc }

func (c leaseLostCollector) Collect(ch chan<- prometheus.Metric) {
	view := c.h.view.Load()
	if view == nil {
		return
	}
	for t := range view.All() {
		if t.detached {
			continue
		}
		v := 0.0
		if !t.graceUntil.IsZero() {
			v = 1
		}
		ch <- prometheus.MustNewConstMetric(leaseLostDesc, prometheus.GaugeValue, v,
			c.h.cfg.Pipeline.Model, strconv.Itoa(t.key.Stage), strconv.FormatUint(uint64(t.key.Replica), 10))
	}
}

// stageReplicasDesc describes troupe_stage_replicas.
var stageReplicasDesc = prometheus.NewDesc("troupe_stage_replicas",
	"Replicas the head knows of a stage, by state as GET /v1/replicas shows it (attached, sleeping, unhealthy, detached): the fleet's shape in a few series, without reading every replica's row.",
	[]string{"stage", "stage_name", "state"}, nil)

// replicaStates are the states troupe_stage_replicas has a series for,
// each stage's written even at 0.
var replicaStates = [...]ReplicaState{StateAttached, StateSleeping, StateUnhealthy, StateDetached}

// stageReplicasCollector writes troupe_stage_replicas at each scrape from
// the states of the rows of GET /v1/replicas (stateOf), so the two agree.
type stageReplicasCollector struct{ h *fleet }

func (c stageReplicasCollector) Describe(ch chan<- *prometheus.Desc) { ch <- stageReplicasDesc }

func (c stageReplicasCollector) Collect(ch chan<- prometheus.Metric) {
	stages := c.h.cfg.Pipeline.Stages
	counts := make([][len(replicaStates)]int, len(stages))
	snap := c.h.router.Snapshot()
	for t := range c.h.view.Load().All() {
		rep, ok := snap.Lookup(t.key)
		state, _ := stateOf(t, rep, ok)
		if i := slices.Index(replicaStates[:], state); i >= 0 && t.key.Stage >= 0 && t.key.Stage < len(stages) {
			counts[t.key.Stage][i]++
		}
	}
	for st, byState := range counts {
		for i, n := range byState {
			ch <- prometheus.MustNewConstMetric(stageReplicasDesc, prometheus.GaugeValue, float64(n),
				strconv.Itoa(st), stages[st].Name, string(replicaStates[i]))
		}
	}
}

// probeResult is what a join's probe sends back to the loop.
type probeResult struct {
	key    router.Key
	gen    uint64
	rep    *router.Replica
	health *stagepb.HealthResponse
	at     time.Time // when Health answered
}

// run owns the fleet's goroutines: the watch, the etcd monitor, the
// autoscaling signal and the loop; it returns once they all ended.
func (f *fleet) run(ctx context.Context) error {
	// Buffered: a list (a restart's, a re-list's) reaches the loop as
	// fast as the watcher decodes it, and the loop applies it in batches
	// (drain), instead of one scheduling round trip per record.
	events := make(chan membership.Event, maxBatch)
	probes := make(chan probeResult)
	departures := make(chan departure)
	var probing sync.WaitGroup
	defer f.router.Close()
	defer probing.Wait()

	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return f.watcher.Run(gctx, events) })
	g.Go(func() error {
		membership.MonitorEtcd(gctx, f.etcd, membership.HealthConfig{
			Who:    "troupe head",
			Logger: f.log,
			OnChange: func(up bool) {
				v := 0.0
				if up {
					v = 1
				}
				f.m.etcdUp.Set(v)
			},
		})
		return nil
	})
	g.Go(func() error {
		f.runAutoscale(gctx)
		return nil
	})
	g.Go(func() error { return f.loop(gctx, events, probes, departures, &probing) })
	err := g.Wait()
	if ctx.Err() != nil {
		return nil
	}
	return err
}

// loop is the head's one writer of its state: it applies membership
// events, probe answers and leave verdicts in batches, ends lease-loss
// graces, checks the replicas' live states and sweeps long-detached
// series, until ctx ends. Run's goroutine owns it.
func (f *fleet) loop(ctx context.Context, events <-chan membership.Event, probes chan probeResult, departures chan departure, probing *sync.WaitGroup) error {
	sweep := time.NewTicker(sweepInterval(f.cfg.DetachedSeriesTTL))
	defer sweep.Stop()
	graceTick := time.NewTicker(graceCheckInterval)
	defer graceTick.Stop()
	liveTick := time.NewTicker(liveCheckInterval)
	defer liveTick.Stop()
	for {
		select {
		case <-ctx.Done():
			for _, t := range f.known {
				if t.cancel != nil {
					t.cancel()
				}
			}
			f.stopCacheSubs()
			return ctx.Err()
		case ev := <-events:
			f.begin()
			f.applyEvent(ctx, ev, probes, departures, probing)
			f.drain(ctx, events, probes, departures, probing)
			f.flush()
		case pr := <-probes:
			f.begin()
			f.attach(pr)
			f.drain(ctx, events, probes, departures, probing)
			f.flush()
		case d := <-departures:
			f.begin()
			f.departed(d)
			f.drain(ctx, events, probes, departures, probing)
			f.flush()
		case now := <-graceTick.C:
			f.begin()
			f.endGraces(now)
			f.flush()
		case <-liveTick.C:
			f.begin()
			f.checkLive()
			f.flush()
		case now := <-sweep.C:
			if n := f.stats.Sweep(now); n > 0 {
				f.log.Info("orchestrator: deleted series of long-detached replicas", "replicas", n)
			}
		}
	}
}

// Bounds of one batch of the loop: a burst of inputs is applied and
// published together, but the first of them waits at most this long (or
// this many inputs) for its snapshot.
const (
	maxBatch    = 1024
	maxBatchAge = 5 * time.Millisecond
)

// drain applies, after a batch's first input, the inputs already waiting
// (membership events, probe answers, leave verdicts), up to maxBatch and
// maxBatchAge, so that a storm of N joins publishes a snapshot per batch,
// not per replica. A batch changes a key once: an input for a key it
// already changed publishes the batch first (before), so every input
// sees its own key's previous changes published.
func (f *fleet) drain(ctx context.Context, events <-chan membership.Event, probes chan probeResult, departures chan departure, probing *sync.WaitGroup) {
	end := time.Now().Add(maxBatchAge)
	for n := 1; n < maxBatch && time.Now().Before(end); n++ {
		select {
		case ev := <-events:
			f.applyEvent(ctx, ev, probes, departures, probing)
		case pr := <-probes:
			f.before(pr.key)
			f.attach(pr)
		case d := <-departures:
			f.before(d.key)
			f.departed(d)
		default:
			return
		}
	}
}

// applyEvent applies a membership event within the current batch.
func (f *fleet) applyEvent(ctx context.Context, ev membership.Event, probes chan<- probeResult, departures chan<- departure, probing *sync.WaitGroup) {
	if stage := f.cfg.Pipeline.StageIndex(ev.Member.Stage); stage >= 0 {
		f.before(router.Key{Stage: stage, Replica: ev.Member.ReplicaID})
	}
	f.apply(ctx, ev, probes, departures, probing)
}

// begin starts a batch: the router holds its changes and publish stages
// records until flush.
func (f *fleet) begin() {
	f.batch.batching = true
	f.router.Hold()
}

// before publishes the batch and starts a new one when it already changed
// key.
func (f *fleet) before(key router.Key) {
	if _, ok := f.batch.dirty[key]; ok {
		f.flush()
		f.begin()
	}
}

func sweepInterval(ttl time.Duration) time.Duration {
	if ttl <= 0 {
		return time.Hour
	}
	return max(ttl/4, time.Second)
}

// apply handles one membership event on the loop goroutine.
func (f *fleet) apply(ctx context.Context, ev membership.Event, probes chan<- probeResult, departures chan<- departure, probing *sync.WaitGroup) {
	stage := f.cfg.Pipeline.StageIndex(ev.Member.Stage)
	if stage < 0 {
		// The watcher already filters unknown stages; this guards the head
		// against a watcher bug rather than trusting it.
		f.m.invalid.Inc()
		f.log.Warn("orchestrator: event for unknown stage", "key", ev.Key, "stage", ev.Member.Stage)
		return
	}
	key := router.Key{Stage: stage, Replica: ev.Member.ReplicaID}
	f.m.events.WithLabelValues(ev.Type.String()).Inc()
	switch ev.Type {
	case membership.Join:
		if f.update(key, ev.Member, ev.Revision) {
			break
		}
		f.join(ctx, key, ev.Member, ev.Revision, probes, probing)
	case membership.Leave:
		f.leave(ctx, key, departures, probing)
	}
	f.publish(key)
}

// update applies a changed record of a routed replica whose process is the
// same (same addr and start time): the worker changed its sleep state, or
// re-registered under a new lease (which also ends a lease-loss grace). The
// connection, the engine index and every counter stay; only the record's
// state is applied. It reports false when the record needs a full join (a
// new process, or a replica not routed yet), which then probes it.
func (f *fleet) update(key router.Key, m membership.Member, rev int64) bool {
	t := f.known[key]
	if t == nil || t.detached || !t.routed || t.refused != "" || t.probeGen != 0 ||
		t.member.Addr != m.Addr || !t.member.StartedAt.Equal(m.StartedAt) {
		return false
	}
	rep, ok := f.router.Snapshot().Lookup(key)
	if !ok {
		return false
	}
	if !t.graceUntil.IsZero() || t.leaveGen != 0 {
		f.log.Info("orchestrator: replica re-registered; its lease-loss grace ends", "stage", m.Stage, "replica", key.Replica)
	}
	t.graceUntil, t.leaveGen = time.Time{}, 0 // a pending leave probe's answer is now stale
	t.member, t.modRev = m, rev
	if m.SleepState != "" {
		// Validated by the watcher: a known state name.
		if st, err := stagepb.ParseSleepState(m.SleepState); err == nil && st != rep.SleepState() {
			f.batch.sleeps = append(f.batch.sleeps, pendingSleep{rep, st}) // at flush, after the record
			f.log.Info("orchestrator: replica sleep state changed", "stage", m.Stage, "replica", key.Replica, "sleep_state", st.Name())
		}
	}
	return true
}

// pendingSleep is a sleep state the batch's records give a routed
// replica, applied at flush.
type pendingSleep struct {
	rep   *router.Replica
	state stagepb.SleepState
}

// setSleepState applies a replica's sleep state to routing and to its
// engine_sleep_state series. Only the loop calls it.
func (f *fleet) setSleepState(rep *router.Replica, st stagepb.SleepState) {
	rep.SetSleepState(st)
	if st == stagepb.SleepState_SLEEP_STATE_DISCARD_ALL {
		f.router.Forget(rep.Key) // its cache is gone
	}
	if err := f.stats.SetSleepState(rep.EngineIndex, st); err != nil {
		f.log.Warn("orchestrator: sleep state not recorded", "err", err)
	}
}

// join assigns the engine index, then probes the replica off the loop; the
// loop binds its series and routes to it when the probe answers (attach).
func (f *fleet) join(ctx context.Context, key router.Key, m membership.Member, rev int64, probes chan<- probeResult, probing *sync.WaitGroup) {
	now := time.Now()
	t := f.known[key]
	if t == nil {
		if f.nextIndex > stats.MaxEngineIndex {
			f.m.errors.WithLabelValues("attach").Inc()
			f.log.Error("orchestrator: refusing join: every engine index is in use", "stage", m.Stage, "replica", m.ReplicaID, "max", stats.MaxEngineIndex)
			return
		}
		t = &tracked{key: key, index: f.nextIndex}
		f.nextIndex++
		f.known[key] = t
	}
	if t.cancel != nil {
		t.cancel()
	}
	t.member, t.modRev, t.detached = m, rev, false
	t.routed, t.refused = false, ""
	t.graceUntil, t.leaveGen = time.Time{}, 0
	t.times = joinTimes{event: now}
	index := t.index
	if t.joinedAt.IsZero() || t.detachedAt.After(t.joinedAt) {
		t.joinedAt = now
	}
	f.gen++
	t.probeGen = f.gen
	pctx, cancel := context.WithCancel(ctx)
	t.cancel = cancel
	spec := router.ReplicaSpec{Key: key, StageName: m.Stage, EngineIndex: index, Addr: m.Addr, JoinedAt: t.joinedAt}
	probing.Add(1)
	go func(gen uint64) {
		defer probing.Done()
		f.probe(pctx, spec, gen, probes)
	}(t.probeGen)
}

// maxFirstProbes is how many joins' first dial and Health the head has
// in flight at once.
const maxFirstProbes = 128

// probe dials the replica and asks its Health until it answers, then hands
// the result to the loop. It gives up only when ctx ends (a leave, a newer
// record, or shutdown).
func (f *fleet) probe(ctx context.Context, spec router.ReplicaSpec, gen uint64, probes chan<- probeResult) {
	// The first dial and Health take a slot of firstProbes: a restart's
	// list starts a probe per replica at once, and thousands of
	// connections set up together answer their first Health late, all of
	// them; a bounded number in flight answer in join order.
	select {
	case f.firstProbes <- struct{}{}:
	case <-ctx.Done():
		return
	}
	held := true
	release := func() {
		if held {
			held = false
			<-f.firstProbes
		}
	}
	defer release()
	rep, err := f.router.Dial(spec)
	if err != nil {
		f.m.errors.WithLabelValues("dial").Inc()
		f.log.Error("orchestrator: cannot dial replica", "stage", spec.StageName, "replica", spec.Key.Replica, "addr", spec.Addr, "err", err)
		return
	}
	// Quick retries while a replica starts; after a minute, slow ones.
	wait := backoff.ExponentialBackOff{InitialInterval: 100 * time.Millisecond, Multiplier: 2, MaxInterval: 2 * time.Second}
	started := time.Now()
	for attempt := 1; ; attempt++ {
		pctx, cancel := context.WithTimeout(ctx, f.cfg.ProbeTimeout)
		health, err := rep.Client.Health(pctx, &stagepb.HealthRequest{})
		cancel()
		release()
		if err == nil && health.GetStatus() == stagepb.ServingStatus_SERVING_STATUS_SERVING {
			select {
			case probes <- probeResult{key: spec.Key, gen: gen, rep: rep, health: health, at: time.Now()}:
			case <-ctx.Done():
				f.router.Discard(rep)
			}
			return
		}
		// Log the 1st, 10th, 100th, ... failure: a replica that never
		// answers (a wrong --advertise) is visible as unhealthy in
		// /v1/replicas without filling the log.
		if attempt == 1 || isPowerOf10(attempt) {
			f.log.Warn("orchestrator: replica not serving yet", "stage", spec.StageName, "replica", spec.Key.Replica, "addr", spec.Addr,
				"attempts", attempt, "status", health.GetStatus().String(), "err", err)
		}
		if time.Since(started) > time.Minute {
			wait.MaxInterval = 30 * time.Second
		}
		timer := time.NewTimer(wait.NextBackOff())
		select {
		case <-ctx.Done():
			timer.Stop()
			f.router.Discard(rep)
			return
		case <-timer.C:
		}
	}
}

// attach finishes a join on the loop goroutine: bind series, then route.
func (f *fleet) attach(pr probeResult) {
	t := f.known[pr.key]
	if t == nil || t.probeGen != pr.gen || t.detached {
		f.router.Discard(pr.rep) // superseded by a newer record or a leave
		return
	}
	t.probeGen, t.cancel = 0, nil
	t.times.answered, t.times.attach = pr.at, time.Now()
	t.io = ioOf(pr.health)
	why := f.checkRoles(pr.key, t.io)
	if s := pr.health.GetStage(); s != "" && s != t.member.Stage {
		why = fmt.Sprintf("the record is for stage %s, but the worker at %s serves stage %s", t.member.Stage, t.member.Addr, s)
	}
	t.instance = pr.health.GetInstanceId()
	t.capacity = pr.health.GetCacheConfig().GetMaxNumSeqs()
	if why == "" {
		why = f.checkIdentity(t, pr.health)
	}
	if why != "" {
		t.refused = why
		f.m.errors.WithLabelValues("role").Inc()
		f.log.Error("orchestrator: refusing replica: it does not fit the pipeline", "stage", t.member.Stage, "replica", pr.key.Replica, "addr", t.member.Addr, "roles", t.io.String(), "reason", why)
		f.router.Discard(pr.rep)
		f.publish(pr.key)
		return
	}
	sleep := pr.health.GetSleepState()
	k := t.member.NumSpeculativeTokens
	if n := int(pr.health.GetNumSpeculativeTokens()); n > k {
		k = n
	}
	err := f.stats.Register(t.index, stats.Replica{
		Stage:                pr.key.Stage,
		StageName:            t.member.Stage,
		ReplicaID:            pr.key.Replica,
		NumSpeculativeTokens: k,
		SleepState:           sleep,
		Engine:               t.member.Engine,
		Version:              t.member.Version,
		Addr:                 t.member.Addr,
		Cache:                pr.health.GetCacheConfig(),
	})
	if err != nil {
		f.m.errors.WithLabelValues("stats").Inc()
		f.log.Error("orchestrator: cannot bind series; not routing", "stage", t.member.Stage, "replica", pr.key.Replica, "err", err)
		f.router.Discard(pr.rep)
		f.publish(pr.key)
		return
	}
	t.times.bound = time.Now()
	pr.rep.SetSleepState(sleep)
	if g := pr.health.GetGauges(); g != nil {
		pr.rep.SetLoadFrom(g)
	}
	cache := pr.health.GetCacheConfig()
	pr.rep.Engine = router.EngineInfo{Name: pr.health.GetEngine(), BlockSize: int(cache.GetBlockSize()), KVEvents: cache.GetKvEvents(),
		ContinuesChat: pr.health.GetContinuesChat(), RoutedSubscription: pr.health.GetRoutedSubscription(),
		InputParts: pr.health.GetInputParts(), InputPartURLs: pr.health.GetInputPartUrls(), InputRole: pr.health.EffectiveInputRole()}
	if err := f.router.Add(pr.rep); err != nil {
		f.m.errors.WithLabelValues("router").Inc()
		f.log.Error("orchestrator: cannot route", "err", err)
		f.router.Discard(pr.rep)
		f.publish(pr.key)
		return
	}
	t.routed, t.times.routed = true, time.Time{}
	t.live.state, t.live.reason = stateOf(t, pr.rep, true)
	f.batch.attached = append(f.batch.attached, t)
	f.startCacheSub(pr.rep, pr.health)
	f.publish(pr.key)
}

// checkIdentity says why a record that points at a worker is not that
// worker's own, "" when it is: the worker reports another replica id, or
// the same process (instance id) already serves another routed record,
// so that one process never takes the traffic of several records. Only
// the loop calls it. The instance id tells processes apart, whatever
// address names them; a worker that reports none (an older one) is not
// checked. It reads the routed records' index (routedBy), not every
// record, so a storm of N joins stays O(N) on the loop.
func (f *fleet) checkIdentity(t *tracked, health *stagepb.HealthResponse) string {
	if health.GetInstanceId() != "" && health.GetReplicaId() != t.key.Replica {
		return fmt.Sprintf("the record is for replica %d, but the worker at %s is replica %d", t.key.Replica, t.member.Addr, health.GetReplicaId())
	}
	if t.instance == "" {
		return ""
	}
	if key, ok := f.routed.by[t.instance]; ok && key != t.key {
		stage := f.cfg.Pipeline.StageNames()[key.Stage]
		return fmt.Sprintf("the worker at %s already serves %s/%d", t.member.Addr, stage, key.Replica)
	}
	return ""
}

// Verdicts of the leave probe: why a replica's record went away.
type leaveVerdict uint8

const (
	verdictDraining leaveVerdict = iota // it says so: stop routing, let in-flight work finish
	verdictAlive                        // it still serves: its lease was lost, keep routing a while
	verdictGone                         // no answer: stop routing and retry its in-flight work
)

func (v leaveVerdict) String() string {
	return [...]string{"draining", "alive", "gone"}[v]
}

// departure is what a leave probe sends back to the loop.
type departure struct {
	key     router.Key
	gen     uint64
	verdict leaveVerdict
	// notServing: a gone replica answered, NOT_SERVING, with this reason
	// (a worker whose upstream engine is down); "" when it did not answer.
	notServing string
}

// leaveProbeTimeout bounds the Health call that tells a drain, a lost
// lease and a dead replica apart.
const leaveProbeTimeout = time.Second

// graceCheckInterval is how often the loop ends expired lease-loss graces.
const graceCheckInterval = 250 * time.Millisecond

// leave handles a vanished record. A replica that was never routed is
// detached at once; a routed one is asked for its Health off the loop, and
// departed acts on the answer.
func (f *fleet) leave(ctx context.Context, key router.Key, departures chan<- departure, probing *sync.WaitGroup) {
	t := f.known[key]
	if t == nil {
		return
	}
	if t.cancel != nil {
		t.cancel()
		t.cancel, t.probeGen = nil, 0
	}
	rep, routed := f.router.Snapshot().Lookup(key)
	if !routed || t.detached {
		f.detach(t, "left before it was routed")
		return
	}
	if !rep.Healthy() {
		// Its connection already failed (the process is gone): no probe
		// needed, and one would only wait for its timeout.
		f.abortAndDetach(t, rep)
		return
	}
	f.gen++
	t.leaveGen = f.gen
	probing.Add(1)
	go func(gen uint64) {
		defer probing.Done()
		pctx, cancel := context.WithTimeout(ctx, leaveProbeTimeout)
		defer cancel()
		verdict, why := verdictGone, ""
		if health, err := rep.Client.Health(pctx, &stagepb.HealthRequest{}); err == nil {
			switch health.GetStatus() {
			case stagepb.ServingStatus_SERVING_STATUS_SERVING:
				verdict = verdictAlive
			case stagepb.ServingStatus_SERVING_STATUS_DRAINING:
				verdict = verdictDraining
			default:
				why = cmp.Or(health.GetStatusMessage(), health.GetStatus().String())
			}
		}
		select {
		case departures <- departure{key: key, gen: gen, verdict: verdict, notServing: why}:
		case <-ctx.Done():
		}
	}(t.leaveGen)
}

// departed finishes a leave on the loop goroutine, unless a newer record
// arrived meanwhile.
func (f *fleet) departed(d departure) {
	t := f.known[d.key]
	if t == nil || t.leaveGen != d.gen || t.detached {
		return
	}
	t.leaveGen = 0
	switch d.verdict {
	case verdictAlive:
		t.graceUntil = time.Now().Add(f.cfg.LeaseLossGrace)
		f.log.Warn("orchestrator: replica's record is gone but it still serves; routing to it while it re-registers",
			"stage", t.member.Stage, "replica", d.key.Replica, "grace", f.cfg.LeaseLossGrace)
		f.publish(d.key)
	case verdictGone:
		rep, _ := f.router.Snapshot().Lookup(d.key)
		if d.notServing != "" {
			f.abortAndDetachWhy(t, rep, "left: not serving: "+d.notServing)
			return
		}
		f.abortAndDetach(t, rep)
	default:
		f.detach(t, "drained")
	}
}

// abortAndDetach detaches a replica that left and does not answer, and
// cancels its in-flight attempts so they are retried elsewhere at once. rep
// may be nil.
func (f *fleet) abortAndDetach(t *tracked, rep *router.Replica) {
	f.abortAndDetachWhy(t, rep, "left and does not answer")
}

// abortAndDetachWhy is abortAndDetach for a replica that left for the
// reason why (e.g. it answers but its upstream engine is down).
func (f *fleet) abortAndDetachWhy(t *tracked, rep *router.Replica, why string) {
	if rep != nil {
		if n := rep.Abort(errReplicaGone); n > 0 {
			f.log.Warn("orchestrator: replica left; retrying its requests elsewhere",
				"stage", t.member.Stage, "replica", t.key.Replica, "reason", why, "requests", n)
		}
	}
	f.detach(t, why)
}

// endGraces detaches the replicas whose lease-loss grace ran out without a
// new record.
func (f *fleet) endGraces(now time.Time) {
	for _, t := range f.known {
		if !t.graceUntil.IsZero() && !t.detached && now.After(t.graceUntil) {
			f.detach(t, "did not re-register within its grace")
		}
	}
}

// detach stops routing first, then detaches the series.
func (f *fleet) detach(t *tracked, why string) {
	t.graceUntil, t.leaveGen = time.Time{}, 0
	f.stopCacheSub(t.key)
	f.router.Remove(t.key)
	if !t.detached {
		if err := f.stats.Detach(t.index); err != nil {
			f.log.Debug("orchestrator: detach", "err", err) // a replica whose probe never answered was never bound
		}
	}
	t.detached, t.detachedAt = true, time.Now()
	t.routed, t.refused = false, ""
	f.log.Info("orchestrator: replica detached", "stage", t.member.Stage, "replica", t.key.Replica, "engine_index", t.index, "reason", why)
	f.publish(t.key)
}

// publish makes the loop's record of key, which it just changed, visible
// to readers, and wakes the waiters on changed. Every change of a record
// is published under its key before the loop takes another input for
// that key: within a batch (begin), publish only stages the key, and
// flush publishes the batch's records, router changes and stage outputs
// together; outside one, it flushes at once. The join checks' indexes
// (noteRouted) follow each change at once, so a batch's later joins see
// its earlier ones.
func (f *fleet) publish(key router.Key) {
	if t := f.known[key]; t != nil {
		f.noteRouted(t)
		f.batch.dirty[key] = struct{}{}
	}
	f.batch.wake = true
	if !f.batch.batching {
		f.flush()
	}
}

// flush publishes the batch: the router's held changes in one snapshot,
// then the routed stamps of the records it attached, then the view with
// the changed records copied (the others stay the copies readers already
// hold: one merge of the view per batch, O(N + changes), so a storm of N
// joins costs O(N) per batch, not per join), the sleep states of the
// records it applied, the stage outputs, and the journal's entry, which
// wakes the waiters on changed and the watches.
func (f *fleet) flush() {
	f.batch.batching = false
	f.router.Commit()
	if !f.served.Load() && f.everyStageRoutable() {
		f.served.Store(true)
	}
	now := time.Now()
	for _, t := range f.batch.attached {
		if !t.routed || !t.times.routed.IsZero() {
			continue
		}
		t.times.routed = now
		f.log.Info("orchestrator: replica attached", "stage", t.member.Stage, "replica", t.key.Replica, "engine_index", t.index, "addr", t.member.Addr, "roles", t.io.String(),
			"probe", t.times.answered.Sub(t.times.event), "join", t.times.routed.Sub(t.times.event))
	}
	clear(f.batch.attached)
	f.batch.attached = f.batch.attached[:0]
	var keys []router.Key
	if len(f.batch.dirty) > 0 {
		keys = slices.SortedFunc(maps.Keys(f.batch.dirty), compareKeys)
		f.view.Store(f.mergeView(f.view.Load(), keys))
		clear(f.batch.dirty)
	}
	// Routing takes the batch's sleep states once the view holds their
	// records: whoever sees a replica asleep or awake finds the record
	// that says so (changeSleep compares records from before its call).
	for _, s := range f.batch.sleeps {
		f.setSleepState(s.rep, s.state)
	}
	clear(f.batch.sleeps)
	f.batch.sleeps = f.batch.sleeps[:0]
	if f.batch.outs != nil {
		f.outputs.Store(f.batch.outs)
		f.batch.outs = nil
	}
	if f.batch.wake {
		f.batch.wake = false
		f.journal.Load().append(keys, &f.journal)
	}
}

// everyStageRoutable reports whether the published snapshot routes every
// stage (its counts: no replica is read).
func (f *fleet) everyStageRoutable() bool {
	snap := f.router.Snapshot()
	for i := range f.cfg.Pipeline.Stages {
		if snap.CheckRoutable(i) != nil {
			return false
		}
	}
	return true
}

// changed is closed by the loop's next publish.
func (f *fleet) changed() <-chan struct{} { return f.journal.Load().done }

// recordView is the API's view of the records: copies, by key, that
// the loop publishes and readers share (see Head.view).
type recordView = sortedseq.Seq[router.Key, *tracked]

// mergeView is old with the records of keys (sorted) copied from the
// loop's: the chunks of the view that hold them are copied, not the view.
func (f *fleet) mergeView(old *recordView, keys []router.Key) *recordView {
	changes := make([]sortedseq.Change[router.Key, *tracked], len(keys))
	for i, k := range keys {
		c := *f.known[k]
		c.cancel = nil
		changes[i] = sortedseq.Change[router.Key, *tracked]{Key: k, Value: &c}
	}
	return old.With(changes, nil)
}

// compareKeys orders keys by stage, then replica id: the view's order.
func compareKeys(a, b router.Key) int {
	return cmp.Or(cmp.Compare(a.Stage, b.Stage), cmp.Compare(a.Replica, b.Replica))
}

// lookup returns the published record of a replica.
func (f *fleet) lookup(key router.Key) (tracked, bool) {
	if t, ok := f.view.Load().Find(key); ok {
		return *t, true
	}
	return tracked{}, false
}

// ReplicaState is a replica's state as the head sees it: the "state" of a
// GET /v1/replicas row.
type ReplicaState string

// The states of a replica.
const (
	// StateAttached: routable, awake and connected.
	StateAttached ReplicaState = "attached"
	// StateSleeping: attached but asleep; not routed to until woken.
	StateSleeping ReplicaState = "sleeping"
	// StateUnhealthy: a member whose probe has not answered yet, or whose
	// connection is failing; not routed to.
	StateUnhealthy ReplicaState = "unhealthy"
	// StateDetached: left the membership; its series are kept.
	StateDetached ReplicaState = "detached"
)

// ReplicaStatus is one row of GET /v1/replicas, in the wire shape of
// docs/contracts.md (JoinedAt is UTC, whole seconds, so it encodes as
// RFC 3339).
type ReplicaStatus struct {
	Stage       int    `json:"stage"`
	StageName   string `json:"stage_name"`
	Replica     uint32 `json:"replica"`
	EngineIndex int    `json:"engine_index"`
	Addr        string `json:"addr"`
	// MetricsAddr is the worker's own /metrics address from its record
	// (absent: it serves none).
	MetricsAddr string       `json:"metrics_addr,omitempty"`
	State       ReplicaState `json:"state"`
	Reason      string       `json:"reason,omitempty"` // why it is unhealthy, when the head knows
	JoinedAt    time.Time    `json:"joined_at"`
	InFlight    int64        `json:"in_flight"`
	// Load is running+waiting from the replica's latest load report, and
	// LoadAgeSeconds that report's age; CacheReportAgeSeconds is the age
	// of its engine's latest cache report. Absent: never reported. A load
	// report older than --signal-max-age counts as unknown in routing.
	Load                  *int64   `json:"load,omitempty"`
	LoadAgeSeconds        *float64 `json:"load_age_s,omitempty"`
	CacheReportAgeSeconds *float64 `json:"cache_report_age_s,omitempty"`
	// PredictedFirstOutputSeconds is, on a stage whose policy is deadline,
	// the predicted time to first output of an attempt sent to it now
	// (absent: another policy, or nothing observed yet); RTF its observed
	// audio seconds per wall second (absent: none observed).
	PredictedFirstOutputSeconds *float64 `json:"predicted_first_output_s,omitempty"`
	RTF                         *float64 `json:"rtf,omitempty"`
	// LeaseLostUntil is set while the replica's record is gone but it still
	// serves (its lease was lost): it stays routed until then, waiting for
	// it to re-register.
	LeaseLostUntil *time.Time `json:"lease_lost_until,omitempty"`
}

func (f *fleet) replicas() []ReplicaStatus {
	snap := f.router.Snapshot()
	view := f.view.Load()
	now := time.Now()
	out := make([]ReplicaStatus, 0, view.Len())
	for t := range view.All() {
		out = append(out, f.statusOf(t, snap, now))
	}
	return out
}

// statusOf is the GET /v1/replicas row of the published record t, read
// against snap.
func (f *fleet) statusOf(t *tracked, snap *router.Snapshot, now time.Time) ReplicaStatus {
	s := ReplicaStatus{
		Stage: t.key.Stage, StageName: t.member.Stage, Replica: t.key.Replica,
		EngineIndex: t.index, Addr: t.member.Addr, MetricsAddr: t.member.MetricsAddr, JoinedAt: t.joinedAt.UTC().Truncate(time.Second),
	}
	if !t.graceUntil.IsZero() {
		until := t.graceUntil.UTC().Truncate(time.Second)
		s.LeaseLostUntil = &until
	}
	rep, ok := snap.Lookup(t.key)
	if ok {
		s.Load, s.LoadAgeSeconds, s.CacheReportAgeSeconds = signalAges(rep, now)
		s.PredictedFirstOutputSeconds, s.RTF = f.predictionOf(rep)
		s.Addr = rep.Addr // the address traffic goes to, whatever a newer record says
	}
	s.State, s.Reason = stateOf(t, rep, ok)
	if ok && !t.detached && t.refused == "" {
		s.InFlight = rep.InFlight()
	}
	return s
}

// rowState is a GET /v1/replicas row's state and, when unhealthy, why.
type rowState struct {
	state  ReplicaState
	reason string
}

// stateOf is the state and reason of the row of the published record t,
// rep its routed replica (ok false: none routed).
func stateOf(t *tracked, rep *router.Replica, ok bool) (ReplicaState, string) {
	switch {
	case t.detached:
		return StateDetached, ""
	case t.refused != "":
		return StateUnhealthy, "refused: " + t.refused
	case !ok:
		return StateUnhealthy, "joined; its Health probe has not answered SERVING yet"
	case !rep.Healthy():
		return StateUnhealthy, "connection to the replica is failing"
	case rep.Draining():
		return StateUnhealthy, "draining: it refused a request as it shuts down; not routed again"
	case rep.Ejected():
		return StateUnhealthy, "ejected after repeated failed requests; routed again from " + rep.EjectedUntil().UTC().Format(time.RFC3339Nano)
	case rep.SleepState() != stagepb.SleepState_SLEEP_STATE_AWAKE:
		return StateSleeping, ""
	default:
		return StateAttached, ""
	}
}

// signalAges are a replica's latest load report and the ages of its load
// and cache reports, nil where it never reported (ReplicaStatus).
func signalAges(rep *router.Replica, now time.Time) (load *int64, loadAge, cacheAge *float64) {
	age := func(t time.Time) *float64 {
		if t.IsZero() {
			return nil
		}
		s := now.Sub(t).Seconds()
		return &s
	}
	if at := rep.LoadAt(); !at.IsZero() {
		n := rep.Load()
		load = &n
	}
	return load, age(rep.LoadAt()), age(rep.CacheReportAt())
}

func isPowerOf10(n int) bool {
	for n >= 10 && n%10 == 0 {
		n /= 10
	}
	return n == 1
}
