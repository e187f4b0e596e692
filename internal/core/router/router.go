// Package router holds the head's routable replicas and picks one per stage
// attempt.
//
// The membership structure (which replicas exist, their addresses and engine
// indexes) is written by one goroutine, the head's event loop, through Add
// and Remove; each change publishes a new immutable Snapshot. The request
// path only reads snapshots, as grpc-go's balancer/base does with pickers.
// Per-replica live fields (in-flight count, load, sleep state, connection
// health) are atomics on the Replica and may change between snapshots.
//
// Each stage has its own Policy instance (round_robin, least_loaded,
// power_of_two, prefix_aware, deadline) and, optionally, session affinity on top of
// it; Pick applies them. See docs/routing.md.
package router

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v5"
	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"

	"github.com/troupe-serving/troupe/internal/core/sortedseq"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// ErrNoReplica is wrapped when a stage has no routable replica.
var ErrNoReplica = errors.New("router: no routable replica")

// AsleepError is the no-replica error of a stage whose every replica is
// attached and healthy but asleep: nothing changes until someone wakes one
// (an admin call), so a client's retry cannot help. errors.Is matches it
// to ErrNoReplica.
type AsleepError struct {
	Stage    int
	Replicas []uint32 // the sleeping replicas' ids, ascending
}

func (e *AsleepError) Error() string {
	return fmt.Sprintf("%v for stage %d: every replica is asleep (%d)", ErrNoReplica, e.Stage, len(e.Replicas))
}

// Is reports the error as an ErrNoReplica.
func (e *AsleepError) Is(target error) bool { return target == ErrNoReplica }

// Key names one replica: the stage's index in the pipeline and the replica
// id the worker registered under.
type Key struct {
	Stage   int
	Replica uint32
}

// String renders the key as "stage/replica", e.g. "0/3".
func (k Key) String() string {
	return strconv.Itoa(k.Stage) + "/" + strconv.FormatUint(uint64(k.Replica), 10)
}

// Replica is one attached replica. Its identity fields never change; a
// rejoin with a new address produces a new Replica.
type Replica struct {
	// What a large stage's pick reads on each of its ~50 candidates, read
	// at random among thousands of replicas (eligible, scorer): kept
	// together so that a candidate costs one or two cache lines, not five.
	Key          Key
	inFlight     atomic.Int64
	load         atomic.Int64 // running + waiting, from the replica's latest stats
	loadAt       atomic.Int64 // when the engine measured load (unix nanoseconds; 0: never)
	sent         atomic.Int64 // requests this head started on it, ever
	sentAtLoad   atomic.Int64 // sent when load was measured; -1: unknown (the report was old when it arrived)
	ejectedUntil atomic.Int64 // the circuit breaker's: until when (unix nanoseconds, 0: not ejected) it is out of rotation
	sleep        atomic.Int32 // stagepb.SleepState
	healthy      atomic.Bool  // connection not in TRANSIENT_FAILURE/SHUTDOWN
	removed      atomic.Bool
	draining     atomic.Bool // it refused a call because it drains (MarkDraining)
	// Engine is what the replica's Health said on join. The head sets it
	// between Dial and Add; it never changes once added. Next to the
	// above: prefix_aware reads its scheme on every candidate.
	Engine EngineInfo

	StageName   string
	EngineIndex int
	Addr        string
	JoinedAt    time.Time
	Client      stagepb.StageServiceClient

	conn    *grpc.ClientConn
	cacheAt atomic.Int64 // when the engine last reported its cache (KvEvents)
	heardAt atomic.Int64 // when the latest load report arrived (unix nanoseconds; 0: never)
	// deadline is what the deadline policy learned of its timing.
	deadline deadlineStats
	// The circuit breaker (see Breaker, and ejectedUntil above):
	// consecutive failed attempts and how many ejections in a row.
	failures  atomic.Int32
	ejections atomic.Int32
	closeOnce sync.Once
	stopWatch context.CancelFunc

	mu       sync.Mutex // guards attempts
	attempts map[*context.CancelCauseFunc]struct{}
}

// Track registers the cancel function of a request running on the replica,
// so that Abort can end it; call the returned func when the request ends.
// Safe for concurrent use.
func (r *Replica) Track(cancel context.CancelCauseFunc) (untrack func()) {
	key := &cancel
	r.mu.Lock()
	if r.attempts == nil {
		r.attempts = map[*context.CancelCauseFunc]struct{}{}
	}
	r.attempts[key] = struct{}{}
	r.mu.Unlock()
	return func() {
		r.mu.Lock()
		delete(r.attempts, key)
		r.mu.Unlock()
	}
}

// Abort cancels, with cause, every tracked request on the replica (one
// that stopped answering: they are retried elsewhere) and returns how many.
// Safe for concurrent use.
func (r *Replica) Abort(cause error) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	for c := range r.attempts {
		(*c)(cause)
	}
	return len(r.attempts)
}

// InFlight is the number of requests currently on the replica.
func (r *Replica) InFlight() int64 { return r.inFlight.Load() }

// SetLoadFrom sets the replica's load from an engine's snapshot (running
// plus waiting), dated when the engine measured it: gauges_age_ms before
// now. A worker relays a scraped engine's last good load, so the relay's
// time alone would keep a load fresh whose source stopped answering.
func (r *Replica) SetLoadFrom(s *stagepb.EngineStats) {
	at := time.Now().Add(-time.Duration(s.GetGaugesAgeMs()) * time.Millisecond)
	r.SetLoadAt(int64(s.GetNumRequestsRunning())+int64(s.GetNumRequestsWaitingCapacity())+int64(s.GetNumRequestsWaitingDeferred()), at)
}

// Load is running+waiting from the replica's latest stats.
func (r *Replica) Load() int64 { return r.load.Load() }

// SetLoad records running+waiting from a stats snapshot taken now.
func (r *Replica) SetLoad(n int64) { r.SetLoadAt(n, time.Now()) }

// SetLoadAt records running+waiting as the engine measured it at t, in a
// report that arrived now.
func (r *Replica) SetLoadAt(n int64, t time.Time) {
	now := time.Now()
	r.load.Store(n)
	if now.Sub(t) < time.Millisecond {
		r.sentAtLoad.Store(r.sent.Load())
	} else {
		// Which of this head's requests an old measurement holds is not
		// known (scoreSinceReport counts them all).
		r.sentAtLoad.Store(-1)
	}
	r.loadAt.Store(t.UnixNano())
	r.heardAt.Store(now.UnixNano())
}

// LoadAt is when the engine measured Load; zero when never reported.
func (r *Replica) LoadAt() time.Time { return unixOrZero(r.loadAt.Load()) }

// HeardAt is when the latest load report arrived, however old its
// measurement (LoadAt): the replica's worker was alive then. Zero when
// never.
func (r *Replica) HeardAt() time.Time { return unixOrZero(r.heardAt.Load()) }

// CacheReportAt is when the engine last reported its cache; zero when never.
func (r *Replica) CacheReportAt() time.Time { return unixOrZero(r.cacheAt.Load()) }

func unixOrZero(ns int64) time.Time {
	if ns == 0 {
		return time.Time{}
	}
	return time.Unix(0, ns)
}

// SleepState is the replica's last known sleep state.
func (r *Replica) SleepState() stagepb.SleepState { return stagepb.SleepState(r.sleep.Load()) }

// SetSleepState records a sleep state reported by the worker.
func (r *Replica) SetSleepState(s stagepb.SleepState) { r.sleep.Store(int32(s)) }

// Healthy reports whether the replica's connection is usable.
func (r *Replica) Healthy() bool { return r.healthy.Load() }

// Routable reports whether new work may go to the replica.
func (r *Replica) Routable() bool {
	return !r.removed.Load() && r.healthy.Load() && !r.draining.Load() && r.SleepState() == stagepb.SleepState_SLEEP_STATE_AWAKE && !r.Ejected()
}

// MarkDraining takes the replica out of routing for good: it refused a
// call because it drains (a worker shutting down), so every request
// after it skips the replica at once rather than each meeting its own
// refusal until the head learns of the drain from etcd, which in a leave
// storm can use up a request's retries. One way: a
// drained worker exits, and a new process is a new Replica. Safe for
// concurrent use.
func (r *Replica) MarkDraining() { r.draining.Store(true) }

// Draining reports whether the replica refused a call because it drains
// (MarkDraining).
func (r *Replica) Draining() bool { return r.draining.Load() }

// Ejected reports whether the circuit breaker holds the replica out of
// rotation now. Once its back-off ends the replica is routed again
// ("half-open"): the next attempt's outcome closes the breaker or ejects
// it anew for twice as long.
func (r *Replica) Ejected() bool {
	until := r.ejectedUntil.Load()
	return until != 0 && time.Now().UnixNano() < until
}

// EjectedUntil is when the current ejection ends; zero when not ejected.
func (r *Replica) EjectedUntil() time.Time {
	until := r.ejectedUntil.Load()
	if until == 0 || time.Now().UnixNano() >= until {
		return time.Time{}
	}
	return time.Unix(0, until)
}

// Acquire counts a request on the replica; the caller must call Release.
func (r *Replica) Acquire() {
	r.inFlight.Add(1)
	r.sent.Add(1)
}

// Release ends a request. The last release of a removed replica closes its
// connection, so a drain's in-flight requests are never cut off by a leave.
func (r *Replica) Release() {
	if r.inFlight.Add(-1) == 0 && r.removed.Load() {
		r.close()
	}
}

func (r *Replica) close() {
	r.closeOnce.Do(func() {
		r.stopWatch()
		_ = r.conn.Close()
	})
}

// EngineInfo describes a replica's engine, from its Health.
type EngineInfo struct {
	Name      string // e.g. "sim"
	BlockSize int    // KV block size in tokens; 0: unknown
	KVEvents  bool   // the engine reports stagepb.KvEvents on its chunks
	// RoutedSubscription: the worker publishes the head-side blocks heads
	// route to it (GenerateRequest.routed_blocks) to every head
	// (HealthResponse.routed_subscription).
	RoutedSubscription bool
	// ContinuesChat: the engine continues a chat answer another replica
	// began (HealthResponse.continues_chat), so a migration may go to it.
	ContinuesChat bool
	// InputParts are the media part kinds the engine takes in a chat input
	// (Health's input_parts); InputPartURLs: also by http(s) URL.
	InputParts    []string
	InputPartURLs bool
	InputRole     string // what the engine takes (Health's effective input_role)
}

// Snapshot is an immutable view of the routable set. Safe for concurrent use.
//
// A stage's replicas are a sortedseq.Seq by replica id (chunks of at
// most a few hundred), and Lookup is a binary search in it: a join or a
// leave copies the chunk it changes and the stage's chunk index, not the
// stage (see BenchmarkSnapshotJoin).
type Snapshot struct {
	stages []*Replicas // by stage index
	// inputs count what each stage's replicas take (stageInputs), kept
	// with every change so that a request's checks read no replica.
	inputs []stageInputs
	// orders are the stages' rendezvous orders for large stages (see
	// stageOrder); nil for a stage built without one (Pick then reads
	// every replica, whatever the size).
	orders []*stageOrder
}

// Replicas are a stage's replicas in replica id order. Immutable.
type Replicas = sortedseq.Seq[uint32, *Replica]

// noReplicas is the stage that does not exist.
var noReplicas = newReplicas(nil)

// newReplicas is reps as a stage (reps is sorted by id here, not in place).
func newReplicas(reps []*Replica) *Replicas {
	reps = slices.SortedFunc(slices.Values(reps), func(a, b *Replica) int { return cmp.Compare(a.Key.Replica, b.Key.Replica) })
	return sortedseq.FromSorted(reps, replicaID, cmp.Compare[uint32])
}

func replicaID(r *Replica) uint32 { return r.Key.Replica }

// newSnapshot is a snapshot of stages with their orders built.
func newSnapshot(stages [][]*Replica) *Snapshot {
	s := &Snapshot{stages: make([]*Replicas, len(stages)), orders: make([]*stageOrder, len(stages)), inputs: make([]stageInputs, len(stages))}
	for i, st := range stages {
		s.stages[i] = newReplicas(st)
		st = slices.Collect(s.stages[i].All())
		s.orders[i] = newStageOrder(st)
		in := s.inputs[i].edit()
		for _, rep := range st {
			in.count(rep, 1)
		}
		s.inputs[i] = in
	}
	return s
}

// stageInputs counts what a stage's replicas take as input: how many
// take audio (EngineInfo.InputRole) and, by media part kind, how many
// take it (InputParts) and how many take it by URL as well. Immutable
// once in a snapshot; a change edits a copy (edit).
type stageInputs struct {
	audio int
	parts map[string]int
	urls  map[string]int
}

// edit is a copy of in that count may change.
func (in stageInputs) edit() stageInputs {
	return stageInputs{audio: in.audio, parts: maps.Clone(in.parts), urls: maps.Clone(in.urls)}
}

// count adds rep's inputs to in (sign 1) or takes them away (sign -1). in
// must be an edit's.
func (in *stageInputs) count(rep *Replica, sign int) {
	e := &rep.Engine
	if e.InputRole == stagepb.RoleAudio {
		in.audio += sign
	}
	for i, kind := range e.InputParts {
		if slices.Contains(e.InputParts[:i], kind) {
			continue // a kind listed twice is taken once
		}
		if in.parts == nil {
			in.parts, in.urls = map[string]int{}, map[string]int{}
		}
		in.parts[kind] += sign
		if e.InputPartURLs {
			in.urls[kind] += sign
		}
	}
}

// EveryReplicaTakesAudio reports whether stage has replicas and every one
// of them takes audio (EngineInfo.InputRole): a speech recognizer. It
// reads counts kept with the snapshot, not the replicas.
func (s *Snapshot) EveryReplicaTakesAudio(stage int) bool {
	if stage < 0 || stage >= len(s.stages) {
		return false
	}
	n := s.stages[stage].Len()
	return n > 0 && s.inputs[stage].audio == n
}

// EveryReplicaTakesPart reports whether every replica of stage takes a
// media part of kind in a chat input (EngineInfo.InputParts) and, when
// byURL, takes it by URL too (InputPartURLs); true for a stage without
// replicas. It reads counts kept with the snapshot, not the replicas.
func (s *Snapshot) EveryReplicaTakesPart(stage int, kind string, byURL bool) bool {
	if stage < 0 || stage >= len(s.stages) {
		return true
	}
	in := s.inputs[stage]
	taking := in.parts[kind]
	if byURL {
		taking = in.urls[kind]
	}
	return taking == s.stages[stage].Len()
}

// order is a stage's rendezvous order; nil when it has none.
func (s *Snapshot) order(stage int) *stageOrder {
	if stage < 0 || stage >= len(s.orders) {
		return nil
	}
	return s.orders[stage]
}

// Stage returns the replicas of a stage, in replica id order (none for
// a stage that does not exist).
func (s *Snapshot) Stage(stage int) *Replicas {
	if stage < 0 || stage >= len(s.stages) {
		return noReplicas
	}
	return s.stages[stage]
}

// Lookup finds a replica by key (a binary search of its stage).
func (s *Snapshot) Lookup(k Key) (*Replica, bool) {
	return s.Stage(k.Stage).Find(k.Replica)
}

// All returns every replica in stage then replica order.
func (s *Snapshot) All() []*Replica {
	var out []*Replica
	for _, st := range s.stages {
		out = slices.AppendSeq(out, st.All())
	}
	return out
}

// Breaker configures the circuit breaker: a replica whose attempts fail
// Failures times in a row is ejected from routing for Backoff, doubling
// with each ejection in a row up to MaxBackoff. A success closes the
// breaker and resets the back-off. The zero value means the defaults.
type Breaker struct {
	Failures   int           // default 3
	Backoff    time.Duration // default 1s
	MaxBackoff time.Duration // default 30s
}

func (b Breaker) withDefaults() Breaker {
	if b.Failures <= 0 {
		b.Failures = 3
	}
	if b.Backoff <= 0 {
		b.Backoff = time.Second
	}
	if b.MaxBackoff < b.Backoff {
		b.MaxBackoff = max(30*time.Second, b.Backoff)
	}
	return b
}

// ejection is the back-off of the k-th ejection in a row (k >= 1): the
// k-th step of the schedule. The schedule is replayed from the count,
// which lives in an atomic, so RecordFailure stays lock-free; it reaches
// MaxBackoff within 63 doublings.
func (b Breaker) ejection(k int) time.Duration {
	s := backoff.ExponentialBackOff{InitialInterval: b.Backoff, Multiplier: 2, MaxInterval: b.MaxBackoff}
	for range min(k, 64) - 1 {
		s.NextBackOff()
	}
	return s.NextBackOff()
}

// Ejection is what RecordFailure did: Ejected reports a new ejection
// lasting Backoff; Spared reports that the breaker tripped but the replica
// was kept because no other replica of its stage is routable (ejecting the
// last one would turn failures into a stage outage).
type Ejection struct {
	Ejected  bool
	Spared   bool
	Failures int
	Backoff  time.Duration
}

// BreakerFailures is the number of failures in a row that ejects a replica.
func (r *Router) BreakerFailures() int { return r.breaker.Failures }

// RecordSuccess closes rep's breaker; it reports whether rep had been
// ejected (it is back). Safe for concurrent use, lock-free.
func (r *Router) RecordSuccess(rep *Replica) (recovered bool) {
	if rep.failures.Load() != 0 {
		rep.failures.Store(0)
	}
	if rep.ejections.Load() == 0 {
		return false
	}
	rep.ejectedUntil.Store(0)
	return rep.ejections.Swap(0) != 0
}

// RecordFailure counts a failed attempt on rep (a failure of the replica,
// not a refused input or a client that went away) and ejects it when its
// breaker trips. Safe for concurrent use, lock-free: of concurrent failures
// while ejected, none extends the ejection.
func (r *Router) RecordFailure(rep *Replica) Ejection {
	n := int(rep.failures.Add(1))
	e := Ejection{Failures: n}
	now := time.Now()
	until := rep.ejectedUntil.Load()
	if n < r.breaker.Failures || until > now.UnixNano() {
		return e
	}
	if !r.snap.Load().otherRoutable(rep) {
		e.Spared = true
		return e
	}
	e.Backoff = r.breaker.ejection(int(rep.ejections.Load()) + 1)
	// Of concurrent failures (a dead replica fails all its attempts at
	// once), only the one that swaps the deadline ejects.
	if !rep.ejectedUntil.CompareAndSwap(until, now.Add(e.Backoff).UnixNano()) {
		return e
	}
	rep.ejections.Add(1)
	e.Ejected = true
	return e
}

// otherRoutable reports whether a replica of rep's stage other than rep
// may take work.
func (s *Snapshot) otherRoutable(rep *Replica) bool {
	for o := range s.Stage(rep.Key.Stage).All() {
		if o != rep && o.Routable() {
			return true
		}
	}
	return false
}

// Dialer opens a client connection to a replica address.
type Dialer func(addr string) (*grpc.ClientConn, error)

// Router owns the replicas' connections, their health watchers and the
// stages' policies.
type Router struct {
	numStages int
	stages    []StageRouting
	dial      Dialer
	log       *slog.Logger
	breaker   Breaker
	snap      atomic.Pointer[Snapshot]
	hints     []stageHints // by stage: large stages' recent winners
	watchers  sync.WaitGroup

	// Between Hold and Commit (the writer's only): the changes Add and
	// Remove made, by key (nil: removed), not published yet; the replicas
	// they replaced or removed, retired once the snapshot without them is
	// published; and the removed keys, forgotten then.
	held      map[Key]*Replica
	retired   []*Replica
	forgotten []Key
}

// StageRouting is how one stage routes.
type StageRouting struct {
	Policy Policy // nil: round robin
	// SessionAffinity sends requests that carry a session key to their
	// session's replica (see Affinity) instead of asking Policy.
	SessionAffinity bool
}

// New returns a router for a pipeline with one StageRouting per stage. The
// router owns the policies from now on.
func New(stages []StageRouting, dial Dialer, log *slog.Logger) *Router {
	return NewWithBreaker(stages, dial, log, Breaker{})
}

// NewWithBreaker is New with a circuit breaker configuration.
func NewWithBreaker(stages []StageRouting, dial Dialer, log *slog.Logger, b Breaker) *Router {
	if log == nil {
		log = slog.Default()
	}
	stages = slices.Clone(stages)
	for i := range stages {
		if stages[i].Policy == nil {
			stages[i].Policy = &RoundRobin{}
		}
	}
	r := &Router{numStages: len(stages), stages: stages, dial: dial, log: log, breaker: b.withDefaults()}
	r.snap.Store(newSnapshot(make([][]*Replica, len(stages))))
	r.hints = make([]stageHints, len(stages))
	return r
}

// Pick chooses a routable replica of stage for req, skipping the replicas
// in exclude (those that already failed this request). Safe for concurrent
// use.
func (r *Router) Pick(stage int, req *Request, exclude []*Replica) (Decision, error) {
	s := r.snap.Load()
	all := s.Stage(stage)
	st := r.stages[stage]
	if sp, ok := st.Policy.(sampler); ok && (!st.SessionAffinity || req.SessionKey == "") {
		if d, ok := sp.pickSampled(req, all, exclude); ok {
			return d, nil
		}
	}
	// A large stage reads a bounded set (candidates.go); the filtered
	// path below is its fallback when that finds nothing eligible.
	if o := s.order(stage); all.Len() > LargeStage && o != nil {
		if d, ok := r.pickLarge(s, stage, req, all, exclude, o); ok {
			return d, nil
		}
	}
	// The snapshot's own slice serves while every replica is routable (a
	// policy does not modify its candidates) and the stage is one chunk;
	// a copy only once one is not.
	candidates, whole := all.Contiguous()
	if whole {
		candidates = eligibleOf(candidates, exclude)
	} else {
		candidates = make([]*Replica, 0, all.Len())
		for rep := range all.All() {
			if eligible(rep, exclude) {
				candidates = append(candidates, rep)
			}
		}
	}
	if len(candidates) == 0 {
		return Decision{}, s.noReplica(stage)
	}
	if st.SessionAffinity && req.SessionKey != "" {
		rep, first := affinityOf(st.Policy).Pick(req.SessionKey, candidates)
		d := Decision{Replica: rep, Policy: st.Policy.Name(), Reason: ReasonAffinity}
		if !first {
			d.Reason = ReasonLoadFallback
		}
		return d, nil
	}
	return st.Policy.Pick(req, candidates), nil
}

// eligibleOf is the eligible replicas of c: c itself while every one is
// (a policy does not modify its candidates), a copy from the first that
// is not.
func eligibleOf(c, exclude []*Replica) []*Replica {
	for i, rep := range c {
		if eligible(rep, exclude) {
			continue
		}
		out := append(make([]*Replica, 0, len(c)-1), c[:i]...)
		for _, rep := range c[i+1:] {
			if eligible(rep, exclude) {
				out = append(out, rep)
			}
		}
		return out
	}
	return c
}

// ApplyKVEvents hands an engine's cache report to its stage's policy, if
// that policy uses them and rep is still the replica routed under its key
// (a late chunk of a replaced replica is dropped). Safe for concurrent use.
func (r *Router) ApplyKVEvents(rep *Replica, ev *stagepb.KvEvents) {
	sink, ok := r.stages[rep.Key.Stage].Policy.(interface {
		ApplyKVEvents(*Replica, *stagepb.KvEvents)
	})
	if !ok {
		return
	}
	if cur, ok := r.snap.Load().Lookup(rep.Key); !ok || cur != rep {
		return
	}
	sink.ApplyKVEvents(rep, ev)
}

// cacheSink is a policy that reads engines' cache reports.
type cacheSink interface {
	UsesKVEvents(*Replica) bool
	ApplyCacheSnapshot(*Replica, *stagepb.KvEvents)
}

// UsesKVEvents reports whether rep's stage policy reads rep's engine
// reports (so a subscription to them is worth its cost).
func (r *Router) UsesKVEvents(rep *Replica) bool {
	sink, ok := r.stages[rep.Key.Stage].Policy.(cacheSink)
	return ok && sink.UsesKVEvents(rep)
}

// routedSink is a policy that keeps a head-side index that other heads'
// picks can feed (routed-block reports).
type routedSink interface {
	UsesRoutedBlocks(*Replica) bool
	ApplyRoutedBlocks(*Replica, *stagepb.KvEvents)
}

// UsesRoutedBlocks reports whether rep's stage policy records head-side
// picks for rep that other heads should learn (so a routed SubscribeCache
// subscription is worth its cost).
func (r *Router) UsesRoutedBlocks(rep *Replica) bool {
	sink, ok := r.stages[rep.Key.Stage].Policy.(routedSink)
	return ok && sink.UsesRoutedBlocks(rep)
}

// ApplyRoutedBlocks hands a routed-block report (the blocks some head
// routed to rep, or a snapshot of the recent ones) to rep's stage policy,
// under the rules of ApplyKVEvents. Safe for concurrent use.
func (r *Router) ApplyRoutedBlocks(rep *Replica, ev *stagepb.KvEvents) {
	sink, ok := r.stages[rep.Key.Stage].Policy.(routedSink)
	if !ok {
		return
	}
	if cur, ok := r.snap.Load().Lookup(rep.Key); !ok || cur != rep {
		return
	}
	sink.ApplyRoutedBlocks(rep, ev)
}

// ReadsLoad reports whether rep's stage routes by load (every policy but
// round robin, and session affinity's bound), so a subscription to rep's
// load reports is worth its cost.
func (r *Router) ReadsLoad(rep *Replica) bool {
	st := r.stages[rep.Key.Stage]
	_, rr := st.Policy.(*RoundRobin)
	return st.SessionAffinity || (st.Policy != nil && !rr)
}

// ApplyCacheSnapshot hands an engine's snapshot of its cache (the first
// message of a SubscribeCache stream) to its stage's policy, under the
// rules of ApplyKVEvents. Safe for concurrent use.
func (r *Router) ApplyCacheSnapshot(rep *Replica, snap *stagepb.KvEvents) {
	sink, ok := r.stages[rep.Key.Stage].Policy.(cacheSink)
	if !ok {
		return
	}
	if cur, ok := r.snap.Load().Lookup(rep.Key); !ok || cur != rep {
		return
	}
	sink.ApplyCacheSnapshot(rep, snap)
}

// Forget drops what a stage's policy remembers about a replica (its cache
// was discarded). Remove and a replacing Add do it themselves.
func (r *Router) Forget(k Key) {
	if k.Stage < 0 || k.Stage >= r.numStages {
		return
	}
	if f, ok := r.stages[k.Stage].Policy.(interface{ Forget(Key) }); ok {
		f.Forget(k)
	}
}

// Policy returns stage's policy.
func (r *Router) Policy(stage int) Policy { return r.stages[stage].Policy }

// Snapshot returns the current routable set.
func (r *Router) Snapshot() *Snapshot { return r.snap.Load() }

// ReplicaSpec is what Add needs to attach a replica.
type ReplicaSpec struct {
	Key         Key
	StageName   string
	EngineIndex int
	Addr        string
	JoinedAt    time.Time
	SleepState  stagepb.SleepState
}

// Dial opens the connection for a replica that is about to be added; the
// head probes it (Health) before Add, so the probe and routing share one
// connection. The connection is owned by the returned Replica.
func (r *Router) Dial(spec ReplicaSpec) (*Replica, error) {
	conn, err := r.dial(spec.Addr)
	if err != nil {
		return nil, fmt.Errorf("router: dial %s: %w", spec.Addr, err)
	}
	rep := &Replica{
		Key:         spec.Key,
		StageName:   spec.StageName,
		EngineIndex: spec.EngineIndex,
		Addr:        spec.Addr,
		JoinedAt:    spec.JoinedAt,
		conn:        conn,
		stopWatch:   func() {},
	}
	rep.Client = stagepb.NewStageServiceClient(conn)
	rep.SetSleepState(spec.SleepState)
	rep.healthy.Store(true)
	return rep, nil
}

// Discard closes a replica that was dialled but never added.
func (r *Router) Discard(rep *Replica) {
	rep.removed.Store(true)
	rep.close()
}

// Hold makes Add and Remove collect their changes until Commit, which
// publishes them all in one snapshot: a burst of N joins then copies each
// chunk it touches and the stage's chunk index once, not once per join.
// Until Commit, readers see the snapshot before Hold. Only the writer
// (the head's loop) calls Hold and Commit.
func (r *Router) Hold() {
	if r.held == nil {
		r.held = map[Key]*Replica{}
	}
}

// Commit publishes the changes made since Hold in one snapshot, then
// retires the replicas they replaced or removed, and ends the hold.
func (r *Router) Commit() {
	held, retired, forgotten := r.held, r.retired, r.forgotten
	r.held, r.retired, r.forgotten = nil, nil, nil
	if len(held) > 0 {
		r.snap.Store(r.snap.Load().withAll(held))
	}
	for _, k := range forgotten {
		r.Forget(k)
	}
	for _, rep := range retired {
		if held[rep.Key] != rep {
			retire(rep)
		}
	}
}

// current is the replica under k as the writer sees it: held changes
// first, then the published snapshot.
func (r *Router) current(k Key) (*Replica, bool) {
	if rep, ok := r.held[k]; ok {
		return rep, rep != nil
	}
	return r.snap.Load().Lookup(k)
}

// Add publishes rep as routable, replacing any replica with the same key
// (at Commit, during a Hold). Only the head's event loop calls Add,
// Remove, Hold, Commit and Close.
func (r *Router) Add(rep *Replica) error {
	if rep.Key.Stage < 0 || rep.Key.Stage >= r.numStages {
		return fmt.Errorf("router: stage %d out of range 0..%d", rep.Key.Stage, r.numStages-1)
	}
	ctx, cancel := context.WithCancel(context.Background())
	rep.stopWatch = cancel
	r.watchers.Add(1)
	go func() {
		defer r.watchers.Done()
		r.watchConn(ctx, rep)
	}()

	// Whatever was remembered under this key (an earlier process's cache,
	// a late guess about a removed replica) describes another engine.
	r.Forget(rep.Key)
	if r.held != nil {
		if prev, ok := r.current(rep.Key); ok && prev != rep {
			r.retired = append(r.retired, prev)
		}
		r.held[rep.Key] = rep
		return nil
	}
	old := r.snap.Load()
	next := old.with(rep)
	r.snap.Store(next)
	if prev, ok := old.Lookup(rep.Key); ok && prev != rep {
		retire(prev)
	}
	return nil
}

// Remove takes a replica out of rotation. Its connection closes when its
// last in-flight request ends.
func (r *Router) Remove(k Key) (*Replica, bool) {
	if r.held != nil {
		rep, ok := r.current(k)
		if !ok {
			return nil, false
		}
		r.held[k] = nil
		r.retired = append(r.retired, rep)
		r.forgotten = append(r.forgotten, k)
		return rep, true
	}
	old := r.snap.Load()
	rep, ok := old.Lookup(k)
	if !ok {
		return nil, false
	}
	r.snap.Store(old.without(k))
	r.Forget(k)
	retire(rep)
	return rep, true
}

// CheckRoutable returns nil when a stage has a replica that may take new work,
// and otherwise the error Pick would return.
func (s *Snapshot) CheckRoutable(stage int) error {
	for r := range s.Stage(stage).All() {
		if r.Routable() {
			return nil
		}
	}
	return s.noReplica(stage)
}

// noReplica is the error of a stage with no routable replica: an
// *AsleepError when every replica it has is healthy but asleep (ejected,
// unhealthy or leaving ones clear themselves, sleepers do not).
func (s *Snapshot) noReplica(stage int) error {
	reps := s.Stage(stage)
	asleep := make([]uint32, 0, reps.Len())
	for r := range reps.All() {
		if r.removed.Load() || !r.Healthy() || r.Draining() || r.Ejected() || r.SleepState() == stagepb.SleepState_SLEEP_STATE_AWAKE {
			break
		}
		asleep = append(asleep, r.Key.Replica)
	}
	if reps.Len() > 0 && len(asleep) == reps.Len() {
		slices.Sort(asleep)
		return &AsleepError{Stage: stage, Replicas: asleep}
	}
	return fmt.Errorf("%w for stage %d (%d attached)", ErrNoReplica, stage, reps.Len())
}

// Close retires every replica and waits for the health watchers to end.
func (r *Router) Close() {
	old := r.snap.Load()
	r.snap.Store(newSnapshot(make([][]*Replica, r.numStages)))
	all := old.All()
	for _, rep := range r.held {
		if rep != nil {
			all = append(all, rep)
		}
	}
	all = append(all, r.retired...)
	r.held, r.retired, r.forgotten = nil, nil, nil
	for _, rep := range all {
		rep.removed.Store(true)
		rep.close()
	}
	r.watchers.Wait()
}

func retire(rep *Replica) {
	rep.removed.Store(true)
	if rep.inFlight.Load() == 0 {
		rep.close()
	}
}

// watchConn keeps rep.healthy in step with the connection state, so a
// broken connection leaves rotation at once instead of at lease expiry. An
// idle connection is asked to reconnect, which surfaces a dead peer as
// TRANSIENT_FAILURE promptly.
func (r *Router) watchConn(ctx context.Context, rep *Replica) {
	rep.conn.Connect()
	for {
		s := rep.conn.GetState()
		healthy := s != connectivity.TransientFailure && s != connectivity.Shutdown
		if rep.healthy.Swap(healthy) != healthy {
			r.log.Info("router: replica connection changed", "stage", rep.StageName, "replica", rep.Key.Replica, "addr", rep.Addr, "state", s.String())
		}
		if s == connectivity.Idle {
			rep.conn.Connect()
		}
		if s == connectivity.Shutdown || !rep.conn.WaitForStateChange(ctx, s) {
			return
		}
	}
}

// with is s with rep added, or replacing the replica under its key: only
// the chunk of rep's stage that holds it is copied, and the outer slices
// besides.
func (s *Snapshot) with(rep *Replica) *Snapshot {
	return s.withAll(map[Key]*Replica{rep.Key: rep})
}

// withAll is s with changes applied (a nil replica: removed): each
// changed stage is merged once with its sorted changes, copying the
// chunks they touch (sortedseq), O(changes × chunk + chunks), whatever
// the stage's size.
func (s *Snapshot) withAll(changes map[Key]*Replica) *Snapshot {
	keys := slices.SortedFunc(maps.Keys(changes), func(a, b Key) int {
		return cmp.Or(cmp.Compare(a.Stage, b.Stage), cmp.Compare(a.Replica, b.Replica))
	})
	next := &Snapshot{stages: slices.Clone(s.stages), orders: slices.Clone(s.orders), inputs: slices.Clone(s.inputs)}
	var edits []sortedseq.Change[uint32, *Replica]
	for len(keys) > 0 {
		stage, n := keys[0].Stage, 1
		for n < len(keys) && keys[n].Stage == stage {
			n++
		}
		ks := keys[:n]
		keys = keys[n:]
		in := s.inputs[stage].edit()
		edits = edits[:0]
		for _, k := range ks {
			rep := changes[k]
			edits = append(edits, sortedseq.Change[uint32, *Replica]{Key: k.Replica, Value: rep, Delete: rep == nil})
			if rep != nil {
				in.count(rep, 1)
			}
		}
		next.stages[stage] = s.stages[stage].With(edits, func(old *Replica) { in.count(old, -1) }) // replaced or removed
		next.inputs[stage] = in
		if next.orders == nil {
			continue
		}
		if len(ks) > orderRebuild {
			next.orders[stage] = newStageOrder(slices.Collect(next.stages[stage].All()))
			continue
		}
		for _, k := range ks {
			if rep := changes[k]; rep != nil {
				next.orders[stage] = next.orders[stage].with(rep)
			} else {
				next.orders[stage] = next.orders[stage].without(k)
			}
		}
	}
	return next
}

// orderRebuild is how many changes of a stage in one commit make
// rebuilding its order cheaper than changing it one replica at a time
// (each copies the group array and one group).
const orderRebuild = 16

// without is s less the replica under k (s itself when there is none).
func (s *Snapshot) without(k Key) *Snapshot {
	if _, found := s.Lookup(k); !found {
		return s
	}
	return s.withAll(map[Key]*Replica{k: nil})
}
