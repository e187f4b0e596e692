//go:build unix

package e2e

import (
	"fmt"
	"net"
	"regexp"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"
)

const (
	genTokens    = "troupe_generation_tokens_total"
	attached     = "troupe_replica_attached"
	sleepState   = "troupe_engine_sleep_state"
	success      = "troupe_request_success_total"
	unregistered = "troupe_stats_unregistered_records_total"
)

// flowPrompt is long enough that a replica prefilling at 50 tokens/s
// takes a while over it.
const flowPrompt = "keep the requests flowing while another replica joins the stage, " +
	"and make sure every one of them is answered in full by whichever replica serves it"

func seeded(req chatRequest, seed int64) chatRequest {
	req.Seed = &seed
	return req
}

// mustValue is the value of exactly one series, which must exist.
func mustValue(t *testing.T, m metrics, family string, labels map[string]string) float64 {
	t.Helper()
	v, ok, err := m.value(family, labels)
	require.NoError(t, err)
	require.True(t, ok, "series %s%v exists", family, labels)
	return v
}

// TestSeedServingCheck is the scenario that crashed vLLM-Omni (issue 7296),
// with processes: a second replica joins a running stage, with stats on,
// while requests flow. Its series must be bound at 0 (awake) before it gets
// a request, replica 0's counters only grow, and the per-replica counters
// add up to the usage the clients were told.
func TestSeedServingCheck(t *testing.T) {
	requireBinary(t)
	ctx := testCtx(t)
	etcd := startEtcd(t)
	h := startHead(t, etcd, "--pipeline", thinkerOnly(t))
	w0 := startWorker(t, etcd, "thinker", "--replica-id", "auto")
	require.Equal(t, uint32(0), w0.replica, "auto takes the smallest free id")
	row0 := h.waitState(ctx, t, "thinker", 0, "attached")

	var completion atomic.Int64 // usage.completion_tokens of every response
	// 1. One replica: 8 requests with max_tokens 2.
	for i := range 8 {
		res, err := h.chat(ctx, seeded(userPrompt(modelName, fmt.Sprintf("warm up %d", i), 2), int64(i)))
		require.NoError(t, err)
		require.Equal(t, 2, res.Usage.CompletionTokens)
		require.Equal(t, "length", res.Choices[0].FinishReason)
		require.NotEmpty(t, res.Choices[0].Message.Content)
		completion.Add(int64(res.Usage.CompletionTokens))
	}
	m, err := h.scrape(ctx)
	require.NoError(t, err)
	require.Equal(t, 16.0, mustValue(t, m, genTokens, replicaLabels(0)), "the seed saw 16")

	// 2. Requests flow while a second replica joins with --replica-id auto.
	// The flow stops taking new requests when told, and lets the ones in
	// flight finish, so every token counted has a response.
	stop := make(chan struct{})
	var flowed atomic.Int64
	var flow errgroup.Group
	for g := range 4 {
		flow.Go(func() error {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return nil
				default:
				}
				res, err := h.chat(ctx, seeded(userPrompt(modelName, flowPrompt, 2), int64(g*1000+i)))
				if err != nil {
					return fmt.Errorf("flow %d request %d: %w", g, i, err)
				}
				completion.Add(int64(res.Usage.CompletionTokens))
				flowed.Add(1)
			}
		})
	}
	stopFlow := sync.OnceFunc(func() { close(stop) })
	t.Cleanup(func() { stopFlow(); _ = flow.Wait() })
	eventually(ctx, t, "requests flowing", func() (bool, string, error) {
		return flowed.Load() > 0, "none finished", nil
	})

	// The new replica prefills slowly (the flow's prompt, 28 tokens, takes
	// it over half a second), so its first request cannot count a
	// token for a while after it is routed: a scrape that sees its series
	// as soon as they exist sees them before any request reached them.
	flowedBefore := flowed.Load()
	p1 := launchWorker(t, etcd, "thinker", "--replica-id", "auto", "--prefill-tps", "50")
	var first metrics
	last0 := 16.0
	eventually(ctx, t, "replica 1's series on /metrics", func() (bool, string, error) {
		// Listed routable first, then scraped: registration comes before
		// routing, so the scrape must then hold its series.
		row, _, err := h.replica(ctx, "thinker", 1)
		if err != nil {
			return false, "", err
		}
		m, err := h.scrape(ctx)
		if err != nil {
			return false, "", err
		}
		if row.State == "attached" && len(m.series(attached, replicaLabels(1))) == 0 {
			return false, "", errorf("replica 1 is listed attached but has no series")
		}
		g0, _, err := m.value(genTokens, replicaLabels(0))
		if err != nil {
			return false, "", err
		}
		if g0 < last0 {
			return false, "", errorf("replica 0's %s went down: %v → %v", genTokens, last0, g0)
		}
		last0 = g0
		if len(m.series(attached, replicaLabels(1))) == 0 {
			return false, "replica 1 has no series yet", nil
		}
		first = m
		return true, "", nil
	})
	flowedAtAttach := flowed.Load()
	w1 := p1.waitLine(t, p1.stdout, workerReadyRE)
	require.Equal(t, "1", w1[2], "auto takes the smallest free id")

	// Bound at attach, before its first request: every child at 0, awake.
	assert.Equal(t, 1.0, mustValue(t, first, attached, replicaLabels(1)), "replica_attached")
	assert.Equal(t, 1.0, mustValue(t, first, sleepState, replicaLabels(1, "sleep_state", "awake")), "awake")
	assert.Zero(t, mustValue(t, first, sleepState, replicaLabels(1, "sleep_state", "weights_offloaded")))
	assert.Zero(t, mustValue(t, first, sleepState, replicaLabels(1, "sleep_state", "discard_all")))
	assert.Zero(t, mustValue(t, first, genTokens, replicaLabels(1)), "generation tokens bound at 0")
	assert.Zero(t, mustValue(t, first, "troupe_prompt_tokens_total", replicaLabels(1)), "prompt tokens bound at 0")
	for _, reason := range []string{"stop", "length", "abort", "error"} {
		assert.Zero(t, mustValue(t, first, success, replicaLabels(1, "finished_reason", reason)), "request_success %s bound at 0", reason)
	}
	assert.Zero(t, mustValue(t, first, "troupe_time_to_first_token_seconds", replicaLabels(1)), "histograms bound, empty")
	assert.Zero(t, mustValue(t, first, "troupe_e2e_request_latency_seconds", replicaLabels(1)), "histograms bound, empty")

	row1 := h.waitState(ctx, t, "thinker", 1, "attached")
	assert.NotEqual(t, row0.EngineIndex, row1.EngineIndex, "its own engine index")
	assert.Equal(t, w1[3], row1.Addr)
	// Keep the flow going until the new replica took part of it.
	eventually(ctx, t, "replica 1 serving the flow", func() (bool, string, error) {
		m, err := h.scrape(ctx)
		if err != nil {
			return false, "", err
		}
		v, _, err := m.value(success, replicaLabels(1, "finished_reason", "length"))
		return v > 0, "no request finished on replica 1", err
	})
	stopFlow()
	require.NoError(t, flow.Wait(), "every request while the replica joins succeeds")
	assert.Greater(t, flowedAtAttach, flowedBefore, "requests finished while the replica joined")
	t.Logf("%d requests finished while replica 1 joined, %d in the whole flow", flowedAtAttach-flowedBefore, flowed.Load())

	// 3. 64 requests at concurrency 8.
	m, err = h.scrape(ctx)
	require.NoError(t, err)
	before0, before1 := mustValue(t, m, genTokens, replicaLabels(0)), mustValue(t, m, genTokens, replicaLabels(1))
	require.GreaterOrEqual(t, before0, last0, "replica 0's counter only grew")
	var g errgroup.Group
	g.SetLimit(8)
	for i := range 64 {
		g.Go(func() error {
			res, err := h.chat(ctx, seeded(userPrompt(modelName, fmt.Sprintf("request %d", i), 2), int64(i)))
			if err != nil {
				return fmt.Errorf("request %d: %w", i, err)
			}
			completion.Add(int64(res.Usage.CompletionTokens))
			return nil
		})
	}
	require.NoError(t, g.Wait(), "every request succeeds")

	// 4. The checks of the seed's serving check.
	m, err = h.scrape(ctx)
	require.NoError(t, err)
	after0, after1 := mustValue(t, m, genTokens, replicaLabels(0)), mustValue(t, m, genTokens, replicaLabels(1))
	assert.Greater(t, after0, before0, "replica 0's counter only grew")
	assert.Greater(t, after1, before1, "replica 1 served")
	assert.Equal(t, float64(completion.Load()), after0+after1, "per-replica sums equal the usage of the responses")
	assert.Equal(t, float64(completion.Load()), m.sum(genTokens, map[string]string{"stage": "0"}), "no other series counted tokens")
	assert.Zero(t, mustValue(t, m, unregistered, nil), "no record for an unbound engine index")
	assert.Equal(t, 1.0, mustValue(t, m, attached, replicaLabels(0)))
	assert.Equal(t, 1.0, mustValue(t, m, attached, replicaLabels(1)))
}

// TestKilledWorkerFailsOver: a worker killed with SIGKILL mid-request. The
// requests in flight on it (non-streaming: nothing reached the client yet)
// are retried on the other replica and succeed; the dead replica leaves
// when its 3s lease expires, well before any periodic re-list, and its
// series are kept.
func TestKilledWorkerFailsOver(t *testing.T) {
	requireBinary(t)
	ctx := testCtx(t)
	etcd := startEtcd(t)
	// No re-list during the test: only the lease's expiry can detach.
	h := startHead(t, etcd, "--pipeline", thinkerOnly(t), "--reconcile-interval", "10m")
	slow := []string{"--lease-ttl", "3s", "--decode-latency", "20ms"}
	victim := startWorker(t, etcd, "thinker", append([]string{"--replica-id", "0"}, slow...)...)
	startWorker(t, etcd, "thinker", append([]string{"--replica-id", "1"}, slow...)...)
	h.waitState(ctx, t, "thinker", 0, "attached")
	h.waitState(ctx, t, "thinker", 1, "attached")

	var g errgroup.Group
	for i := range 8 {
		g.Go(func() error {
			req := seeded(userPrompt(modelName, "a long answer, please", 40), int64(i))
			req.IgnoreEOS = true
			res, err := h.chat(ctx, req)
			if err != nil {
				return fmt.Errorf("request %d: %w", i, err)
			}
			if res.Usage.CompletionTokens != 40 {
				return fmt.Errorf("request %d: %d completion tokens, want 40", i, res.Usage.CompletionTokens)
			}
			return nil
		})
	}
	// Kill it mid-generation: requests in flight that already made tokens
	// there (counted on its series), none of which reached a client.
	eventually(ctx, t, "requests generating on replica 0", func() (bool, string, error) {
		r, _, err := h.replica(ctx, "thinker", 0)
		if err != nil || r.InFlight == 0 {
			return false, "none in flight", err
		}
		m, err := h.scrape(ctx)
		if err != nil {
			return false, "", err
		}
		v, _, err := m.value(genTokens, replicaLabels(0))
		return v > 0, "no token yet", err
	})
	victim.kill(t)
	killed := time.Now()
	require.Equal(t, -1, victim.exitCode(t, wait), "killed by a signal")
	require.NoError(t, g.Wait(), "every request in flight during the kill succeeds")

	eventuallyWithin(ctx, t, 10*time.Second, "replica 0 detached by its lease's expiry", func() (bool, string, error) {
		r, _, err := h.replica(ctx, "thinker", 0)
		return r.State == "detached", "state " + r.State, err
	})
	t.Logf("replica 0 detached %s after SIGKILL (lease TTL 3s)", time.Since(killed).Round(10*time.Millisecond))

	m, err := h.scrape(ctx)
	require.NoError(t, err)
	assert.Zero(t, mustValue(t, m, attached, replicaLabels(0)), "replica_attached 0")
	kept := mustValue(t, m, genTokens, replicaLabels(0))
	assert.Positive(t, kept, "the dead replica's counters are kept")
	assert.Positive(t, mustValue(t, m, success, replicaLabels(0, "finished_reason", "error")), "the failed attempts count as errors")
	assert.Zero(t, mustValue(t, m, "troupe_num_requests_running", replicaLabels(0)), "live load of a detached replica is 0")

	// The head keeps serving on the survivor.
	for i := range 4 {
		_, err := h.chat(ctx, seeded(userPrompt(modelName, "after the crash", 3), int64(i)))
		require.NoError(t, err)
	}
	m, err = h.scrape(ctx)
	require.NoError(t, err)
	assert.Equal(t, kept, mustValue(t, m, genTokens, replicaLabels(0)), "still kept, unchanged")
	assert.Equal(t, 1.0, mustValue(t, m, attached, replicaLabels(1)))
	assert.Zero(t, mustValue(t, m, unregistered, nil))
}

// TestRejoinSameIDContinuesCounters: a replica that left comes back as a
// new process under the same --replica-id; it keeps its engine index, the
// head dials its new address, and its counters go on from where they were.
func TestRejoinSameIDContinuesCounters(t *testing.T) {
	requireBinary(t)
	ctx := testCtx(t)
	etcd := startEtcd(t)
	h := startHead(t, etcd, "--pipeline", thinkerOnly(t))
	old := startWorker(t, etcd, "thinker", "--replica-id", "0")
	idx := h.waitState(ctx, t, "thinker", 0, "attached").EngineIndex

	var tokens int
	for i := range 3 {
		res, err := h.chat(ctx, seeded(userPrompt(modelName, "before the restart", 5), int64(i)))
		require.NoError(t, err)
		tokens += res.Usage.CompletionTokens
	}
	require.Positive(t, tokens)

	old.signal(t, syscall.SIGTERM)
	require.Equal(t, 0, old.exitCode(t, wait))
	h.waitState(ctx, t, "thinker", 0, "detached")
	m, err := h.scrape(ctx)
	require.NoError(t, err)
	assert.Zero(t, mustValue(t, m, attached, replicaLabels(0)))
	assert.Equal(t, float64(tokens), mustValue(t, m, genTokens, replicaLabels(0)), "kept while away")

	nw := startWorker(t, etcd, "thinker", "--replica-id", "0")
	require.Equal(t, uint32(0), nw.replica)
	row := h.waitState(ctx, t, "thinker", 0, "attached")
	assert.Equal(t, idx, row.EngineIndex, "same key, same engine index")
	assert.Equal(t, nw.addr, row.Addr, "the head dials the new process")
	m, err = h.scrape(ctx)
	require.NoError(t, err)
	assert.Equal(t, float64(tokens), mustValue(t, m, genTokens, replicaLabels(0)), "not reset by the rejoin")
	assert.Equal(t, 1.0, mustValue(t, m, attached, replicaLabels(0)))
	assert.Equal(t, 1.0, mustValue(t, m, sleepState, replicaLabels(0, "sleep_state", "awake")), "a new process starts awake")

	res, err := h.chat(ctx, seeded(userPrompt(modelName, "after the restart", 5), 9))
	require.NoError(t, err)
	m, err = h.scrape(ctx)
	require.NoError(t, err)
	assert.Equal(t, float64(tokens+res.Usage.CompletionTokens), mustValue(t, m, genTokens, replicaLabels(0)), "and continue")
	assert.Zero(t, mustValue(t, m, unregistered, nil))
}

// TestDuplicateReplicaIDExits: a second worker claiming a live replica id
// exits 1 at once with the contract's message, and the holder is untouched.
func TestDuplicateReplicaIDExits(t *testing.T) {
	requireBinary(t)
	ctx := testCtx(t)
	etcd := startEtcd(t)
	h := startHead(t, etcd, "--pipeline", thinkerOnly(t))
	holder := startWorker(t, etcd, "thinker", "--replica-id", "0")
	h.waitState(ctx, t, "thinker", 0, "attached")

	started := time.Now()
	dup := launchWorker(t, etcd, "thinker", "--replica-id", "0")
	require.Equal(t, 1, dup.exitCode(t, wait))
	t.Logf("the duplicate exited %s after it started", time.Since(started).Round(time.Millisecond))
	want := fmt.Sprintf("membership: replica thinker/0 already registered by %s", holder.addr)
	assert.Contains(t, dup.stderr.String(), want)
	assert.NotContains(t, dup.stdout.String(), "troupe worker: stage", "never registered")

	row, ok, err := h.replica(ctx, "thinker", 0)
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, "attached", row.State)
	assert.Equal(t, holder.addr, row.Addr, "the record was not overwritten")
	_, err = h.chat(ctx, userPrompt(modelName, "still served", 3))
	require.NoError(t, err)
	rows, err := h.replicas(ctx)
	require.NoError(t, err)
	assert.Len(t, rows, 1, "the duplicate never joined")
}

// TestWorkerRestartedWithinLeaseTakesItsRecordBack (issue 47, item 5): a
// worker killed with SIGKILL and started again at the same --listen
// address while its lease lives takes its record back (it used to exit 1,
// "already registered by" its own address). The head sees a record with
// another started_at, a new process: one more Join and no Leave, and it
// probes and routes to it under the same engine index.
func TestWorkerRestartedWithinLeaseTakesItsRecordBack(t *testing.T) {
	requireBinary(t)
	ctx := testCtx(t)
	etcd := startEtcd(t)
	h := startHead(t, etcd, "--pipeline", thinkerOnly(t))
	// A TTL the whole test fits in: no expiry can free the key.
	const ttl = time.Minute
	args := []string{"--replica-id", "0", "--lease-ttl", ttl.String()}
	old := startWorker(t, etcd, "thinker", args...)
	idx := h.waitState(ctx, t, "thinker", 0, "attached").EngineIndex
	_, err := h.chat(ctx, userPrompt(modelName, "before the crash", 3))
	require.NoError(t, err)

	old.kill(t)
	killed := time.Now()
	require.Equal(t, -1, old.exitCode(t, wait), "killed by a signal")
	restarted := startWorker(t, etcd, "thinker", append(args, "--listen", old.addr, "--log-level", "info")...)
	assert.Equal(t, old.addr, restarted.addr)
	restarted.waitLine(t, restarted.stderr, regexp.MustCompile(`membership: took over the record of this replica's previous process`))

	eventually(ctx, t, "a request served after the restart", func() (bool, string, error) {
		_, err := h.chat(ctx, userPrompt(modelName, "after the restart", 3))
		return err == nil, fmt.Sprint(err), nil
	})
	row := h.waitState(ctx, t, "thinker", 0, "attached")
	assert.Equal(t, idx, row.EngineIndex, "same key, same engine index")
	assert.Equal(t, old.addr, row.Addr)
	m, err := h.scrape(ctx)
	require.NoError(t, err)
	assert.Equal(t, 2.0, mustValue(t, m, "troupe_membership_events_total", map[string]string{"type": "join"}), "a join per process")
	leaves, _, err := m.value("troupe_membership_events_total", map[string]string{"type": "leave"})
	require.NoError(t, err)
	assert.Zero(t, leaves, "no leave: the key was never free")
	require.Less(t, time.Since(killed), ttl, "all within the killed worker's lease")
	assert.Zero(t, mustValue(t, m, unregistered, nil))
}

// TestSIGTERMDrainsInFlight: SIGTERM to a worker with slow requests
// streaming through it: it leaves rotation, every one of those requests
// still completes, and it exits 0.
func TestSIGTERMDrainsInFlight(t *testing.T) {
	requireBinary(t)
	ctx := testCtx(t)
	etcd := startEtcd(t)
	h := startHead(t, etcd, "--pipeline", thinkerOnly(t))
	w := startWorker(t, etcd, "thinker", "--replica-id", "auto", "--decode-latency", "20ms")
	h.waitState(ctx, t, "thinker", w.replica, "attached")

	const n, maxTokens = 8, 50
	streams := make([]*stream, n)
	for i := range streams {
		req := seeded(userPrompt(modelName, fmt.Sprintf("a slow answer %d", i), maxTokens), int64(i))
		req.IgnoreEOS = true
		s, err := h.chatStream(ctx, req)
		require.NoError(t, err)
		t.Cleanup(func() { _ = s.Close() })
		more, err := s.next()
		require.NoError(t, err)
		require.True(t, more, "stream %d has a first chunk", i)
		streams[i] = s
	}
	eventually(ctx, t, "every request in flight", func() (bool, string, error) {
		r, _, err := h.replica(ctx, "thinker", w.replica)
		return r.InFlight == n, fmt.Sprintf("in_flight %d", r.InFlight), err
	})

	w.signal(t, syscall.SIGTERM)
	var after atomic.Int64 // content chunks read after the signal
	var g errgroup.Group
	for i, s := range streams {
		g.Go(func() error {
			before := s.chunks
			for {
				more, err := s.next()
				if err != nil {
					return fmt.Errorf("stream %d: %w", i, err)
				}
				if !more {
					break
				}
			}
			after.Add(int64(s.chunks - before))
			switch {
			case s.finish != "length":
				return fmt.Errorf("stream %d: finish_reason %q, want length", i, s.finish)
			case s.usage == nil || s.usage.CompletionTokens != maxTokens:
				return fmt.Errorf("stream %d: usage %+v, want %d completion tokens", i, s.usage, maxTokens)
			}
			return nil
		})
	}
	require.NoError(t, g.Wait(), "every in-flight request completes")
	assert.Positive(t, after.Load(), "output kept coming after SIGTERM")
	require.Equal(t, 0, w.exitCode(t, wait), "a drained worker exits 0")

	h.waitState(ctx, t, "thinker", w.replica, "detached")
	m, err := h.scrape(ctx)
	require.NoError(t, err)
	assert.Equal(t, float64(n), mustValue(t, m, success, replicaLabels(w.replica, "finished_reason", "length")))
	assert.Zero(t, mustValue(t, m, success, replicaLabels(w.replica, "finished_reason", "error")))
	assert.Zero(t, mustValue(t, m, success, replicaLabels(w.replica, "finished_reason", "abort")))
	assert.Equal(t, float64(n*maxTokens), mustValue(t, m, genTokens, replicaLabels(w.replica)))
}

// TestHeadDeadEtcdFailsFast: a head pointed at an etcd nobody serves exits
// 1 within its dial timeout, saying which endpoint it could not reach.
func TestHeadDeadEtcdFailsFast(t *testing.T) {
	requireBinary(t)
	endpoint := "http://" + deadAddr(t)
	started := time.Now()
	p := startProc(t, "head", nil, "head", "--etcd-endpoints", endpoint, "--http", "127.0.0.1:0")
	require.Equal(t, 1, p.exitCode(t, wait))
	t.Logf("exited %s after it started", time.Since(started).Round(time.Millisecond))
	stderr := p.stderr.String()
	assert.Contains(t, stderr, "troupe head: membership: etcd at ")
	assert.Contains(t, stderr, endpoint)
	assert.Contains(t, stderr, "unreachable")
	assert.NotContains(t, p.stdout.String(), "API on", "never served")
}

// deadAddr is a loopback address nothing listens on: a port the kernel
// just gave out and took back.
func deadAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	return addr
}

// freePort is a loopback port free a moment ago.
func freePort(t *testing.T) string {
	t.Helper()
	_, port, err := net.SplitHostPort(deadAddr(t))
	require.NoError(t, err)
	return port
}
