package orchestrator_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker/sim"
)

var thinkerOnly = orchestrator.Pipeline{Model: "troupe-omni-sim", Stages: []orchestrator.Stage{{Name: "thinker"}}}

func sampling(maxTokens uint32, seed int64) *stagepb.SamplingParams {
	return &stagepb.SamplingParams{MaxTokens: maxTokens, Seed: &seed}
}

// value reads one child without creating it (see export_test.go).
var value = orchestrator.GatheredValue

func genTokens(t *testing.T, c *orchestratortest.Cluster, replica uint32) float64 {
	v, _ := value(t, c.Metrics, "troupe_generation_tokens_total", map[string]string{"stage": "0", "replica": fmt.Sprint(replica)})
	return v
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// TestSeedServingCheck automates the scenario that crashed vLLM-Omni: a
// second replica joins a running stage with stats on, while requests flow.
func TestSeedServingCheck(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly})
	ctx := ctxT(t)
	var usage atomic.Int64

	// 1. One replica, 8 requests with max_tokens 2.
	for i := range 8 {
		res, err := c.Head.Execute(ctx, orchestrator.Request{ID: fmt.Sprint("a", i), Prompt: fmt.Sprintf("warm up %d", i), Sampling: sampling(2, int64(i))}, nil)
		require.NoError(t, err)
		assert.Equal(t, 2, res.CompletionTokens)
		assert.Equal(t, "length", res.FinishReason)
		usage.Add(int64(res.CompletionTokens))
	}
	r0 := genTokens(t, c, 0)
	assert.Equal(t, 16.0, r0, "the seed saw 16")

	// 2. A second replica joins with --replica-id auto while requests flow.
	flowCtx, stopFlow := context.WithCancel(ctx)
	var flow errgroup.Group
	for g := range 4 {
		flow.Go(func() error {
			for i := 0; flowCtx.Err() == nil; i++ {
				res, err := c.Head.Execute(flowCtx, orchestrator.Request{ID: fmt.Sprint("f", g, i), Prompt: "flowing", Sampling: sampling(2, 1)}, nil)
				if err != nil {
					if flowCtx.Err() != nil {
						return nil
					}
					return err
				}
				usage.Add(int64(res.CompletionTokens))
			}
			return nil
		})
	}
	w := c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{})
	require.Equal(t, uint32(1), w.ReplicaID(), "auto takes the smallest free id")
	st := c.WaitState(t, "thinker", 1, "attached")
	// Bound at attach: the replica is routable, so its series exist.
	awake, ok := value(t, c.Metrics, "troupe_engine_sleep_state", map[string]string{"replica": "1", "sleep_state": "awake"})
	assert.True(t, ok, "replica 1's sleep state is bound")
	assert.Equal(t, 1.0, awake)
	attached, ok := value(t, c.Metrics, "troupe_replica_attached", map[string]string{"replica": "1"})
	assert.True(t, ok)
	assert.Equal(t, 1.0, attached)
	_, ok = value(t, c.Metrics, "troupe_time_to_first_token_seconds", map[string]string{"replica": "1"})
	assert.True(t, ok, "histograms bound too")
	assert.NotEqual(t, 0, st.EngineIndex)
	stopFlow()
	require.NoError(t, flow.Wait(), "every request while joining succeeds")

	// 3. 64 requests at concurrency 8.
	r0 = genTokens(t, c, 0)
	r1 := genTokens(t, c, 1)
	var g errgroup.Group
	g.SetLimit(8)
	for i := range 64 {
		g.Go(func() error {
			res, err := c.Head.Execute(ctx, orchestrator.Request{ID: fmt.Sprint("b", i), Prompt: fmt.Sprintf("request %d", i), Sampling: sampling(2, int64(i))}, nil)
			if err == nil {
				usage.Add(int64(res.CompletionTokens))
			}
			return err
		})
	}
	require.NoError(t, g.Wait())

	// 4. Checks.
	after0, after1 := genTokens(t, c, 0), genTokens(t, c, 1)
	assert.Greater(t, after0, r0, "replica 0's counter only grew")
	assert.Greater(t, after1, r1, "replica 1 served")
	assert.Equal(t, float64(usage.Load()), after0+after1, "per-replica sums equal the usage of the responses")
	unreg, ok := value(t, c.Metrics, "troupe_stats_unregistered_records_total", nil)
	assert.True(t, ok)
	assert.Zero(t, unreg)
}

// TestThreeStagesByteForByte: an audio request walks thinker → talker →
// vocoder, and each output is the pure function of the previous one.
func TestThreeStagesByteForByte(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{})
	ctx := ctxT(t)
	const prompt = "sing me a short song"
	res, err := c.Head.Execute(ctx, orchestrator.Request{ID: "audio", Prompt: prompt, Sampling: sampling(12, 7), Stages: 3}, nil)
	require.NoError(t, err)

	text, tokens, finish := sim.ExpectedText(prompt, 7, 12)
	assert.Equal(t, text, res.Text)
	assert.Equal(t, tokens, res.CompletionTokens)
	assert.Equal(t, map[stagepb.FinishReason]string{stagepb.FinishReason_FINISH_REASON_STOP: "stop", stagepb.FinishReason_FINISH_REASON_LENGTH: "length"}[finish], res.FinishReason)
	codes, _ := sim.ExpectedCodes(text, 7, 0)
	assert.Equal(t, codes, res.Codes)
	require.Equal(t, sim.ExpectedAudio(codes), res.PCM, "audio byte for byte")
	assert.Equal(t, sim.SampleRate, res.SampleRate)
}

// TestStreamingDeltasConcatenate: onText sees stage 0's text as it arrives.
func TestStreamingDeltasConcatenate(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly})
	var b strings.Builder
	n := 0
	res, err := c.Head.Execute(ctxT(t), orchestrator.Request{ID: "s", Prompt: "stream this", Sampling: sampling(20, 3)}, func(d string) error {
		b.WriteString(d)
		n++
		return nil
	})
	require.NoError(t, err)
	assert.Equal(t, res.Text, b.String())
	assert.Greater(t, n, 1, "more than one delta")
}

func TestNoReplicaFailsFast(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, ReplicasPerStage: -1})
	start := time.Now()
	_, err := c.Head.Execute(ctxT(t), orchestrator.Request{ID: "x", Prompt: "hi"}, nil)
	require.ErrorIs(t, err, orchestrator.ErrNoReplica)
	assert.Contains(t, err.Error(), `stage "thinker"`)
	assert.Less(t, time.Since(start), 5*time.Second)
}

// TestKilledReplicaFailsOver: a replica that dies mid-request is retried on
// another, and the head keeps serving; the dead one is detached within its
// lease TTL with its series kept.
func TestKilledReplicaFailsOver(t *testing.T) {
	slow := sim.Config{DecodeTokenLatency: 20 * time.Millisecond}
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, ReplicasPerStage: -1, Sim: slow})
	ctx := ctxT(t)
	victim := c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{})
	c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{})
	c.WaitState(t, "thinker", 0, "attached")
	c.WaitState(t, "thinker", 1, "attached")

	// Requests that are in flight on the victim when it dies, non-streaming
	// (nothing reached the client), are retried on the survivor.
	var g errgroup.Group
	for i := range 8 {
		g.Go(func() error {
			_, err := c.Head.Execute(ctx, orchestrator.Request{ID: fmt.Sprint("k", i), Prompt: "long answer please", Sampling: sampling(40, int64(i))}, nil)
			return err
		})
	}
	require.Eventually(t, func() bool { return victim.Server.Member().ReplicaID == 0 && inFlight(c, 0) > 0 }, 30*time.Second, time.Millisecond)
	victim.Kill(t)
	require.NoError(t, g.Wait(), "every request survives the kill")

	c.WaitState(t, "thinker", 0, "detached")
	v, ok := value(t, c.Metrics, "troupe_replica_attached", map[string]string{"replica": "0"})
	assert.True(t, ok)
	assert.Zero(t, v)
	_, kept := value(t, c.Metrics, "troupe_generation_tokens_total", map[string]string{"replica": "0"})
	assert.True(t, kept, "the dead replica's series are kept")
	errs, _ := value(t, c.Metrics, "troupe_request_success_total", map[string]string{"replica": "0", "finished_reason": "error"})
	assert.Positive(t, errs, "the failed attempts are counted as errors")
}

func inFlight(c *orchestratortest.Cluster, replica uint32) int64 {
	for _, r := range c.Head.Replicas() {
		if r.Replica == replica {
			return r.InFlight
		}
	}
	return 0
}

// TestStreamingFailureAfterOutputIsAnError: once text reached the client a
// retry would duplicate it, so the request fails clearly instead, even with
// another replica ready.
func TestStreamingFailureAfterOutputIsAnError(t *testing.T) {
	slow := sim.Config{DecodeTokenLatency: 30 * time.Millisecond}
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, Sim: slow})
	victim := c.Workers()[0]
	first := make(chan struct{})
	var once sync.Once
	errc := make(chan error, 1)
	go func() {
		_, err := c.Head.Execute(ctxT(t), orchestrator.Request{ID: "st", Prompt: "x", Sampling: &stagepb.SamplingParams{MaxTokens: 200, IgnoreEos: true}}, func(string) error {
			once.Do(func() { close(first) })
			return nil
		})
		errc <- err
	}()
	<-first
	c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{})
	c.WaitState(t, "thinker", 1, "attached")
	victim.Kill(t)
	err := <-errc
	require.ErrorIs(t, err, orchestrator.ErrStageFailed)
	errs, _ := value(t, c.Metrics, "troupe_request_success_total", map[string]string{"replica": "0", "finished_reason": "error"})
	assert.Equal(t, 1.0, errs, "counted as finish_reason error")
	served, _ := value(t, c.Metrics, "troupe_request_success_total", map[string]string{"replica": "1", "finished_reason": "stop"})
	assert.Zero(t, served, "not retried elsewhere")
}

// TestCancellationReachesWorker: a cancelled request is aborted on the
// worker and counted as abort.
func TestCancellationReachesWorker(t *testing.T) {
	slow := sim.Config{DecodeTokenLatency: 20 * time.Millisecond}
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, Sim: slow})
	ctx, cancel := context.WithCancel(ctxT(t))
	got := make(chan struct{})
	var once sync.Once
	errc := make(chan error, 1)
	go func() {
		_, err := c.Head.Execute(ctx, orchestrator.Request{ID: "c", Prompt: "x", Sampling: &stagepb.SamplingParams{MaxTokens: 500, IgnoreEos: true}}, func(string) error {
			once.Do(func() { close(got) })
			return nil
		})
		errc <- err
	}()
	<-got
	cancel()
	require.ErrorIs(t, <-errc, context.Canceled)
	require.Eventually(t, func() bool {
		v, _ := value(t, c.Metrics, "troupe_request_success_total", map[string]string{"replica": "0", "finished_reason": "abort"})
		return v == 1
	}, 30*time.Second, 5*time.Millisecond, "abort counted")
	require.Eventually(t, func() bool {
		s := c.Workers()[0].Engine.Snapshot()
		return s.Running == 0 && s.Finished[stagepb.FinishReason_FINISH_REASON_ABORT] == 1
	}, 30*time.Second, 5*time.Millisecond, "the worker aborted the request")
}

// TestSleepWake: a sleeping replica leaves rotation and its sleep state
// series follow; waking brings it back.
func TestSleepWake(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly})
	ctx := ctxT(t)
	s, err := c.Head.Sleep(ctx, 0, 0, 2)
	require.NoError(t, err)
	assert.Equal(t, stagepb.SleepState_SLEEP_STATE_DISCARD_ALL, s)
	c.WaitState(t, "thinker", 0, "sleeping")
	v, _ := value(t, c.Metrics, "troupe_engine_sleep_state", map[string]string{"replica": "0", "sleep_state": "discard_all"})
	assert.Equal(t, 1.0, v)
	_, err = c.Head.Execute(ctx, orchestrator.Request{ID: "z", Prompt: "hi"}, nil)
	require.ErrorIs(t, err, orchestrator.ErrNoReplica, "a sleeping replica is skipped")

	_, err = c.Head.Sleep(ctx, 0, 0, 3)
	require.ErrorIs(t, err, orchestrator.ErrBadRequest)
	_, err = c.Head.Sleep(ctx, 0, 9, 1)
	require.ErrorIs(t, err, orchestrator.ErrUnknownReplica)

	s, err = c.Head.WakeUp(ctx, 0, 0)
	require.NoError(t, err)
	assert.Equal(t, stagepb.SleepState_SLEEP_STATE_AWAKE, s)
	v, _ = value(t, c.Metrics, "troupe_engine_sleep_state", map[string]string{"replica": "0", "sleep_state": "awake"})
	assert.Equal(t, 1.0, v)
	_, err = c.Head.Execute(ctx, orchestrator.Request{ID: "z2", Prompt: "hi"}, nil)
	require.NoError(t, err)
}

// TestRollingRestartUnderLoad: every replica of a stage is replaced, one at
// a time, while requests flow; none fails.
func TestRollingRestartUnderLoad(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, ReplicasPerStage: 2})
	ctx := ctxT(t)
	loadCtx, stop := context.WithCancel(ctx)
	var load errgroup.Group
	var served atomic.Int64
	for g := range 4 {
		load.Go(func() error {
			for i := 0; loadCtx.Err() == nil; i++ {
				_, err := c.Head.Execute(loadCtx, orchestrator.Request{ID: fmt.Sprint("r", g, i), Prompt: "rolling", Sampling: sampling(8, 1)}, nil)
				if err != nil && loadCtx.Err() == nil {
					return err
				}
				served.Add(1)
			}
			return nil
		})
	}
	for _, old := range c.Workers() {
		id := old.ReplicaID()
		old.Stop(t) // drain: deregister, finish in flight
		c.WaitState(t, "thinker", id, "detached")
		nw := c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{ReplicaID: &id})
		c.WaitState(t, "thinker", nw.ReplicaID(), "attached")
	}
	stop()
	require.NoError(t, load.Wait(), "zero failed requests during the rolling restart")
	assert.Positive(t, served.Load())
}

// TestRejoinContinuesCounters: the same (stage, replica) comes back as a
// new process on a new port, keeps its engine index, and its counters
// continue from where they were.
func TestRejoinContinuesCounters(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly})
	ctx := ctxT(t)
	for i := range 3 {
		_, err := c.Head.Execute(ctx, orchestrator.Request{ID: fmt.Sprint(i), Prompt: "x", Sampling: sampling(5, 1)}, nil)
		require.NoError(t, err)
	}
	before := genTokens(t, c, 0)
	idx := c.WaitState(t, "thinker", 0, "attached").EngineIndex
	old := c.Workers()[0]
	oldAddr := old.Addr()
	old.Stop(t)
	c.WaitState(t, "thinker", 0, "detached")
	id := uint32(0)
	nw := c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{ReplicaID: &id})
	st := c.WaitState(t, "thinker", 0, "attached")
	assert.Equal(t, idx, st.EngineIndex)
	assert.NotEqual(t, oldAddr, nw.Addr(), "a new process on a new port")
	assert.Equal(t, nw.Addr(), st.Addr, "the head dials the new address")
	assert.Equal(t, before, genTokens(t, c, 0), "counters kept across the rejoin")
	_, err := c.Head.Execute(ctx, orchestrator.Request{ID: "after", Prompt: "x", Sampling: sampling(5, 1)}, nil)
	require.NoError(t, err)
	assert.Equal(t, before+5, genTokens(t, c, 0), "and continue")
}

// TestSpecDecodePositionsThroughTheHead: a replica with K draft positions
// is bound with one per-position child each, at 0, before it serves, and
// its per-request deltas add up on the head.
func TestSpecDecodePositionsThroughTheHead(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, Sim: sim.Config{NumSpeculativeTokens: 3}})
	for pos := range 3 {
		v, ok := value(t, c.Metrics, "troupe_spec_decode_num_accepted_tokens_per_pos_total", map[string]string{"replica": "0", "position": fmt.Sprint(pos)})
		assert.True(t, ok, "position %d bound at join", pos)
		assert.Zero(t, v)
	}
	_, ok := value(t, c.Metrics, "troupe_spec_decode_num_accepted_tokens_per_pos_total", map[string]string{"replica": "0", "position": "3"})
	assert.False(t, ok, "no position beyond K-1")

	_, err := c.Head.Execute(ctxT(t), orchestrator.Request{ID: "sd", Prompt: "speculate a little", Sampling: &stagepb.SamplingParams{MaxTokens: 40, IgnoreEos: true}}, nil)
	require.NoError(t, err)
	drafts, _ := value(t, c.Metrics, "troupe_spec_decode_num_draft_tokens_total", map[string]string{"replica": "0"})
	accepted, _ := value(t, c.Metrics, "troupe_spec_decode_num_accepted_tokens_total", map[string]string{"replica": "0"})
	var perPos float64
	for pos := range 3 {
		v, _ := value(t, c.Metrics, "troupe_spec_decode_num_accepted_tokens_per_pos_total", map[string]string{"replica": "0", "position": fmt.Sprint(pos)})
		perPos += v
	}
	assert.Positive(t, drafts)
	assert.Positive(t, accepted)
	assert.LessOrEqual(t, accepted, drafts)
	assert.Equal(t, accepted, perPos, "accepted tokens split by position")
}

// TestEtcdOutageKeepsServing: with etcd down the head keeps its last known
// membership and serves from it; when etcd returns, the replicas are still
// attached under the same engine indexes, and nothing was detached.
func TestEtcdOutageKeepsServing(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, ReplicasPerStage: 2})
	ctx := ctxT(t)
	before := map[uint32]int{}
	for _, r := range c.Head.Replicas() {
		before[r.Replica] = r.EngineIndex
	}
	require.Len(t, before, 2)

	c.Etcd.Stop()
	for i := range 20 {
		_, err := c.Head.Execute(ctx, orchestrator.Request{ID: fmt.Sprint("o", i), Prompt: "etcd is down", Sampling: sampling(4, 1)}, nil)
		require.NoError(t, err, "serving does not depend on etcd being up")
	}
	for _, r := range c.Head.Replicas() {
		assert.Equal(t, orchestrator.StateAttached, r.State, "no mass leave while etcd is unreachable")
	}

	c.Etcd.Restart(t)
	for i := range 20 {
		_, err := c.Head.Execute(ctx, orchestrator.Request{ID: fmt.Sprint("r", i), Prompt: "etcd is back", Sampling: sampling(4, 1)}, nil)
		require.NoError(t, err)
	}
	for id, idx := range before {
		st := c.WaitState(t, "thinker", id, "attached")
		assert.Equal(t, idx, st.EngineIndex)
	}
	leaves, _ := value(t, c.Metrics, "troupe_membership_events_total", map[string]string{"type": "leave"})
	assert.Zero(t, leaves, "nothing left")
}

// TestMalformedRecordsAreCountedNotFatal: garbage under the members prefix
// is skipped and counted by the head, which keeps serving.
func TestMalformedRecordsAreCountedNotFatal(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly})
	ctx := ctxT(t)
	for key, val := range map[string]string{
		"/troupe/default/members/thinker/7":   "{not json",
		"/troupe/default/members/thinker/8":   `{"stage":"thinker","replica_id":9,"addr":"127.0.0.1:1"}`, // key/value mismatch
		"/troupe/default/members/painter/0":   `{"stage":"painter","replica_id":0,"addr":"127.0.0.1:1"}`, // unknown stage
		"/troupe/default/members/thinker/abc": `{}`,
	} {
		_, err := c.Client.Put(ctx, key, val)
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool {
		v, _ := value(t, c.Metrics, "troupe_membership_invalid_records_total", nil)
		return v == 4
	}, 30*time.Second, 5*time.Millisecond, "each bad record counted once")
	assert.Len(t, c.Head.Replicas(), 1, "no replica made of garbage")
	_, err := c.Head.Execute(ctx, orchestrator.Request{ID: "ok", Prompt: "still fine"}, nil)
	require.NoError(t, err)
}

// TestRecordPointingAtAnotherStageIsRefused: a thinker record whose addr is
// the talker's worker would route text requests to a talker (a silent
// wrong answer); the join probe sees the worker's own stage and refuses it,
// visibly, and the real thinker keeps serving.
func TestRecordPointingAtAnotherStageIsRefused(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{})
	ctx := ctxT(t)
	c.WaitReady(t)
	var talkerAddr string
	for _, w := range c.Workers() {
		if w.Stage == "talker" {
			talkerAddr = w.Addr()
		}
	}
	require.NotEmpty(t, talkerAddr)
	lease, err := c.Client.Grant(ctx, 30)
	require.NoError(t, err)
	rec := fmt.Sprintf(`{"stage":"thinker","replica_id":7,"addr":%q,"engine":"sim","version":"x","started_at":"2026-01-01T00:00:00Z"}`, talkerAddr)
	_, err = c.Client.Put(ctx, "/troupe/default/members/thinker/7", rec, clientv3.WithLease(lease.ID))
	require.NoError(t, err)

	var row orchestrator.ReplicaStatus
	require.Eventually(t, func() bool {
		for _, r := range c.Head.Replicas() {
			if r.StageName == "thinker" && r.Replica == 7 {
				row = r
				return strings.HasPrefix(r.Reason, "refused")
			}
		}
		return false
	}, 30*time.Second, 5*time.Millisecond, "the bad record is listed with a reason")
	assert.Equal(t, orchestrator.StateUnhealthy, row.State)
	assert.Contains(t, row.Reason, "serves stage talker")
	refused, _ := value(t, c.Metrics, "troupe_head_attach_errors_total", map[string]string{"step": "role"})
	assert.Equal(t, 1.0, refused)
	for i := range 8 {
		res, err := c.Head.Execute(ctx, orchestrator.Request{ID: fmt.Sprint(i), Prompt: "hello", Sampling: sampling(6, int64(i))}, nil)
		require.NoError(t, err)
		want, _, _ := sim.ExpectedText("hello", int64(i), 6)
		assert.Equal(t, want, res.Text, "never answered by the talker")
	}
}

// TestStreamingFailureAfterOutputMigrates: with a migration allowed, a
// thinker that dies after text reached the client does not end the answer:
// it continues on another replica from the prompt and the text delivered,
// and the client sees one uninterrupted answer, marked on the span.
func TestStreamingFailureAfterOutputMigrates(t *testing.T) {
	slow := sim.Config{DecodeTokenLatency: 30 * time.Millisecond}
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, Sim: slow, MaxMigrations: 1})
	victim := c.Workers()[0]
	c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{})
	c.WaitState(t, "thinker", 1, "attached")
	var mu sync.Mutex
	var seen strings.Builder
	deltas := 0
	killed := make(chan struct{})
	res, err := c.Head.Execute(ctxT(t), orchestrator.Request{ID: "mig", Prompt: "x", Sampling: &stagepb.SamplingParams{MaxTokens: 40, IgnoreEos: true}}, func(d string) error {
		mu.Lock()
		defer mu.Unlock()
		seen.WriteString(d)
		deltas++
		if deltas == 5 {
			go func() { victim.Kill(t); close(killed) }()
		}
		return nil
	})
	<-killed
	require.NoError(t, err, "the answer continued on the other replica")
	mu.Lock()
	defer mu.Unlock()
	assert.Equal(t, seen.String(), res.Text, "the client saw the whole answer, once")
	assert.Equal(t, 40, res.CompletionTokens, "max_tokens counts the delivered part too")
	assert.Equal(t, 40, len(strings.Fields(res.Text)))
	served, _ := value(t, c.Metrics, "troupe_request_success_total", map[string]string{"replica": "1", "finished_reason": "length"})
	assert.Equal(t, 1.0, served, "the continuation ran on the other replica")
}

// TestRecordsThatLie: records are checked against the worker they point
// at. Extra records that name one worker's address under other ids are
// refused (the worker says which replica it is), so that process does not
// take their share of the traffic; a live record overwritten with another
// worker's address is refused too, and /v1/replicas keeps showing the
// address traffic actually goes to.
func TestRecordsThatLie(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly})
	ctx := ctxT(t)
	other := c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{})
	c.WaitState(t, "thinker", 1, "attached")
	zero := c.Workers()[0]
	require.Equal(t, uint32(0), zero.ReplicaID())

	lease, err := c.Client.Grant(ctx, 30)
	require.NoError(t, err)
	put := func(id uint32, addr string) {
		rec := fmt.Sprintf(`{"stage":"thinker","replica_id":%d,"addr":%q,"engine":"sim","version":"x","started_at":"2026-01-01T00:00:00Z"}`, id, addr)
		_, err := c.Client.Put(ctx, fmt.Sprintf("/troupe/default/members/thinker/%d", id), rec, clientv3.WithLease(lease.ID))
		require.NoError(t, err)
	}
	row := func(id uint32) (orchestrator.ReplicaStatus, bool) {
		for _, r := range c.Head.Replicas() {
			if r.Replica == id {
				return r, true
			}
		}
		return orchestrator.ReplicaStatus{}, false
	}
	refused := func(id uint32) orchestrator.ReplicaStatus {
		var r orchestrator.ReplicaStatus
		require.Eventually(t, func() bool {
			var ok bool
			r, ok = row(id)
			return ok && strings.HasPrefix(r.Reason, "refused")
		}, 30*time.Second, 5*time.Millisecond, "thinker/%d refused", id)
		assert.Equal(t, orchestrator.StateUnhealthy, r.State)
		return r
	}

	for _, id := range []uint32{5, 6, 7} {
		put(id, zero.Addr())
	}
	for _, id := range []uint32{5, 6, 7} {
		r := refused(id)
		assert.Contains(t, r.Reason, fmt.Sprintf("the record is for replica %d, but the worker at %s is replica 0", id, zero.Addr()))
	}
	for i := range 10 {
		_, err := c.Head.Execute(ctx, orchestrator.Request{ID: fmt.Sprint(i), Prompt: "hi", Sampling: sampling(2, int64(i))}, nil)
		require.NoError(t, err)
	}
	for _, id := range []string{"0", "1"} {
		n, _ := value(t, c.Metrics, "troupe_request_success_total", map[string]string{"replica": id, "finished_reason": "length"})
		assert.Equal(t, 5.0, n, "replica %s: one process, one share of the traffic", id)
	}

	// thinker/0's record overwritten, under another lease, with thinker/1's
	// address: refused, and the row still shows the address dialled.
	put(0, other.Addr())
	r := refused(0)
	assert.Contains(t, r.Reason, "is replica 1")
	assert.Equal(t, zero.Addr(), r.Addr, "the address traffic goes to, not the record's")
	assert.NotEqual(t, other.Addr(), r.Addr)

	// A record with a 1.4 MB version is refused and counted, never listed.
	before, _ := value(t, c.Metrics, "troupe_membership_invalid_records_total", nil)
	huge := fmt.Sprintf(`{"stage":"thinker","replica_id":9,"addr":%q,"version":%q}`, zero.Addr(), strings.Repeat("v", 1400<<10))
	_, err = c.Client.Put(ctx, "/troupe/default/members/thinker/9", huge, clientv3.WithLease(lease.ID))
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		v, _ := value(t, c.Metrics, "troupe_membership_invalid_records_total", nil)
		return v == before+1
	}, 30*time.Second, 5*time.Millisecond, "the oversized record counted")
	_, listed := row(9)
	assert.False(t, listed)
}

// TestEtcdOutageMetrics: the head's troupe_etcd_up follows an etcd kill
// and its return, and its watch lag stays small while etcd answers.
func TestEtcdOutageMetrics(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly})
	gauge := func(name string) float64 { v, _ := value(t, c.Metrics, name, nil); return v }
	require.Eventually(t, func() bool { return gauge("troupe_etcd_up") == 1 }, 30*time.Second, 10*time.Millisecond)
	require.Eventually(t, func() bool { return gauge("troupe_membership_watch_lag_seconds") < 3 }, 30*time.Second, 10*time.Millisecond)
	lost, ok := value(t, c.Metrics, "troupe_replica_lease_lost", map[string]string{"stage": "0", "replica": "0"})
	require.True(t, ok)
	assert.Zero(t, lost)

	c.Etcd.Stop()
	require.Eventually(t, func() bool { return gauge("troupe_etcd_up") == 0 }, 30*time.Second, 10*time.Millisecond)
	c.Etcd.Restart(t)
	require.Eventually(t, func() bool { return gauge("troupe_etcd_up") == 1 }, 30*time.Second, 10*time.Millisecond)
	require.Eventually(t, func() bool { return gauge("troupe_membership_watch_lag_seconds") < 3 }, 30*time.Second, 10*time.Millisecond)
}

// TestStageReplicasCountsStates: troupe_stage_replicas counts each stage's
// replicas by the state GET /v1/replicas shows, zeros included, and
// follows a replica that sleeps and one that leaves.
func TestStageReplicasCountsStates(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, ReplicasPerStage: 2})
	ctx := ctxT(t)
	counts := func() map[string]float64 {
		out := map[string]float64{}
		for _, s := range []string{"attached", "sleeping", "unhealthy", "detached"} {
			v, ok := value(t, c.Metrics, "troupe_stage_replicas", map[string]string{"stage": "0", "stage_name": "thinker", "state": s})
			require.True(t, ok, "a series for state %s, even at 0", s)
			out[s] = v
		}
		return out
	}
	workers := c.Workers()
	for _, w := range workers {
		c.WaitState(t, "thinker", w.ReplicaID(), "attached")
	}
	assert.Equal(t, map[string]float64{"attached": 2, "sleeping": 0, "unhealthy": 0, "detached": 0}, counts())

	_, err := c.Head.Sleep(ctx, 0, workers[0].ReplicaID(), 1)
	require.NoError(t, err)
	c.WaitState(t, "thinker", workers[0].ReplicaID(), "sleeping")
	workers[1].Stop(t)
	c.WaitState(t, "thinker", workers[1].ReplicaID(), "detached")
	assert.Equal(t, map[string]float64{"attached": 0, "sleeping": 1, "unhealthy": 0, "detached": 1}, counts())
}

// TestStartingHeadSaysSo: a head that has not yet routed every stage since
// it started says it is starting, in its requests' errors and in Ready;
// once it has, a stage without a replica is just that.
func TestStartingHeadSaysSo(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerOnly, ReplicasPerStage: -1})
	ctx := ctxT(t)
	_, err := c.Head.Execute(ctx, orchestrator.Request{ID: "early", Prompt: "hi", Sampling: sampling(2, 1)}, nil)
	require.ErrorIs(t, err, orchestrator.ErrNoReplica)
	assert.Contains(t, err.Error(), `the head is starting: stage "thinker" has no routable replica`)
	ok, why := c.Head.Ready()
	assert.False(t, ok)
	assert.Contains(t, why, "the head is starting")

	w := c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{})
	c.WaitReady(t)
	_, err = c.Head.Execute(ctx, orchestrator.Request{ID: "served", Prompt: "hi", Sampling: sampling(2, 1)}, nil)
	require.NoError(t, err)

	w.Stop(t)
	c.WaitState(t, "thinker", w.ReplicaID(), "detached")
	_, err = c.Head.Execute(ctx, orchestrator.Request{ID: "late", Prompt: "hi", Sampling: sampling(2, 1)}, nil)
	require.ErrorIs(t, err, orchestrator.ErrNoReplica)
	assert.NotContains(t, err.Error(), "starting", "it served: a stage without replicas is not a start")
}
