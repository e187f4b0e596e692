package httpapi

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
)

// replicaStream is a client's open GET /v1/replicas?watch=true.
type replicaStream struct {
	body  io.Closer
	lines *bufio.Scanner
}

func (a *api) watchReplicas(t *testing.T, ctx context.Context, query string) *replicaStream {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, a.base+"/v1/replicas?watch=true"+query, nil)
	require.NoError(t, err)
	resp, err := a.client.Do(req)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, "application/x-ndjson", resp.Header.Get("Content-Type"))
	t.Cleanup(func() { _ = resp.Body.Close() })
	return &replicaStream{body: resp.Body, lines: bufio.NewScanner(resp.Body)}
}

// next reads the stream's next event; ok is false at its end.
func (s *replicaStream) next(t *testing.T) (ev replicaEvent, ok bool) {
	t.Helper()
	if !s.lines.Scan() {
		return ev, false
	}
	require.NoError(t, json.Unmarshal(s.lines.Bytes(), &ev), "line %q", s.lines.Text())
	return ev, true
}

// until reads rows until cond holds for one, and returns it.
func (s *replicaStream) until(t *testing.T, what string, cond func(orchestrator.ReplicaStatus) bool) orchestrator.ReplicaStatus {
	t.Helper()
	for {
		ev, ok := s.next(t)
		require.True(t, ok, "the watch ended before %s", what)
		if ev.Type == "replica" && cond(*ev.Replica) {
			return *ev.Replica
		}
	}
}

// TestReplicasWatch follows the fleet through GET /v1/replicas?watch=true
// as an operator's client would: the rows as they are, "synced", a
// joining replica from unhealthy to attached, a leave, a draining refusal
// (a state no input to the loop announces: its check each second
// publishes it), a stage filter, and the stream's end when the server
// drains.
func TestReplicasWatch(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{ReplicasPerStage: 1})
	c.WaitReady(t)
	a := startAPI(t, c, Config{}, nil, nil)
	ctx := testCtx(t)

	all := a.watchReplicas(t, ctx, "")
	thinkers := a.watchReplicas(t, ctx, "&stage=thinker")
	var initial []orchestrator.ReplicaStatus
	for {
		ev, ok := all.next(t)
		require.True(t, ok)
		if ev.Type == "synced" {
			break
		}
		require.Equal(t, "replica", ev.Type)
		initial = append(initial, *ev.Replica)
	}
	listed := c.Head.Replicas()
	require.Len(t, initial, len(listed), "the watch begins with every row of GET /v1/replicas")
	for i, row := range initial {
		assert.Equal(t, listed[i].Replica, row.Replica)
		assert.Equal(t, orchestrator.StateAttached, row.State)
	}
	ev, ok := thinkers.next(t)
	require.True(t, ok)
	require.Equal(t, "thinker", ev.Replica.StageName)
	ev, ok = thinkers.next(t)
	require.True(t, ok)
	require.Equal(t, "synced", ev.Type, "?stage=thinker begins with the one thinker")

	// A join: the new replica's row comes, then comes again attached.
	w := c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{})
	joined := all.until(t, "the join", func(r orchestrator.ReplicaStatus) bool {
		return r.Replica == w.ReplicaID() && r.State == orchestrator.StateAttached
	})
	assert.Equal(t, "thinker", joined.StageName)
	assert.Equal(t, w.Addr(), joined.Addr)
	thinkers.until(t, "the join on the stage's watch", func(r orchestrator.ReplicaStatus) bool {
		require.Equal(t, "thinker", r.StageName, "?stage=thinker sends thinker rows only")
		return r.Replica == w.ReplicaID() && r.State == orchestrator.StateAttached
	})

	// A leave: its row comes again, detached.
	w.Stop(t)
	all.until(t, "the leave", func(r orchestrator.ReplicaStatus) bool {
		return r.Replica == w.ReplicaID() && r.State == orchestrator.StateDetached
	})

	// A draining refusal marks a replica without an input to the loop:
	// the loop's check publishes it. etcd is stopped so that the head
	// hears of the drain only from the refusal.
	first := c.Workers()[0]
	c.Etcd.Stop()
	t.Cleanup(func() { c.Etcd.Restart(t) })
	var drained sync.WaitGroup
	drained.Go(func() { first.Server.Drain() })
	t.Cleanup(drained.Wait)
	client := a.openai()
	_, _ = client.Chat.Completions.New(ctx, chatParams("the refusal", 1, 3))
	row := all.until(t, "the draining refusal", func(r orchestrator.ReplicaStatus) bool {
		return r.Replica == first.ReplicaID() && r.State == orchestrator.StateUnhealthy
	})
	assert.True(t, strings.HasPrefix(row.Reason, "draining:"), "%q", row.Reason)

	// The server's drain ends every watch.
	a.Drain()
	for {
		if _, ok := all.next(t); !ok {
			break
		}
	}
	for {
		if _, ok := thinkers.next(t); !ok {
			break
		}
	}
}

// TestReplicasFilters lists some replicas with ?stage= and ?state=, and
// answers a clear 400 to a filter it cannot apply.
func TestReplicasFilters(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{ReplicasPerStage: 2})
	c.WaitReady(t)
	for _, w := range c.Workers() {
		c.WaitState(t, w.Stage, w.ReplicaID(), orchestrator.StateAttached)
	}
	a := startAPI(t, c, Config{}, nil, nil)
	c.Workers()[0].Stop(t)
	c.WaitState(t, c.Workers()[0].Stage, c.Workers()[0].ReplicaID(), orchestrator.StateDetached)

	list := func(query string) []orchestrator.ReplicaStatus {
		t.Helper()
		resp, body := a.do(t, http.MethodGet, "/v1/replicas"+query, nil, nil)
		require.Equal(t, http.StatusOK, resp.StatusCode, "%s", body)
		var l replicaList
		require.NoError(t, json.Unmarshal(body, &l))
		return l.Data
	}
	all := list("")
	require.Len(t, all, 6)
	for _, q := range []string{"?stage=talker", "?stage=1"} {
		rows := list(q)
		require.Len(t, rows, 2, q)
		for _, r := range rows {
			assert.Equal(t, "talker", r.StageName, q)
		}
	}
	detached := list("?state=detached")
	require.Len(t, detached, 1)
	assert.Equal(t, c.Workers()[0].ReplicaID(), detached[0].Replica)
	assert.Len(t, list("?state=attached"), 5)
	assert.Empty(t, list(fmt.Sprintf("?stage=%s&state=detached", "vocoder")))

	for query, param := range map[string]string{
		"?stage=nope":                "stage",
		"?stage=7":                   "stage",
		"?state=asleep":              "state",
		"?watch=maybe":               "watch",
		"?watch=true&state=attached": "state",
	} {
		resp, body := a.do(t, http.MethodGet, "/v1/replicas"+query, nil, nil)
		e := wantError(t, resp, body, http.StatusBadRequest, typeInvalidRequest, "invalid_value")
		require.NotNil(t, e.Param, query)
		assert.Equal(t, param, *e.Param, query)
	}
}

// TestReplicasWatchEndsWithTheClient: a watch ends when its client goes
// (the request no longer counts in flight; its goroutines end: goleak),
// and counts under its own route.
func TestReplicasWatchEndsWithTheClient(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{ReplicasPerStage: 1})
	c.WaitReady(t)
	m, err := NewMetrics(prometheus.NewRegistry())
	require.NoError(t, err)
	a := startAPI(t, c, Config{Metrics: m}, nil, nil)
	ctx, cancel := context.WithCancel(testCtx(t))
	s := a.watchReplicas(t, ctx, "")
	for {
		ev, ok := s.next(t)
		require.True(t, ok)
		if ev.Type == "synced" {
			break
		}
	}
	require.Equal(t, 1.0, testutil.ToFloat64(m.inFlight), "the watch is a request in flight")
	cancel()
	_ = s.body.Close()
	require.Eventually(t, func() bool { return testutil.ToFloat64(m.inFlight) == 0 }, 30*time.Second, 5*time.Millisecond,
		"the watch's handler returns once its client goes")
	assert.Equal(t, 1.0, testutil.ToFloat64(m.requests.WithLabelValues(watchRoute, "get", "200")),
		"a watch counts under its own route, apart from the list's")
	assert.Equal(t, 1, testutil.CollectAndCount(m.duration),
		"one duration series, the watch's: the list's route has none of it")
}

// TestReplicasWatchLimit: past maxReplicaWatches a watch is refused with
// 429 too_many_watches and Retry-After; once one ends, a new one is served.
func TestReplicasWatchLimit(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{ReplicasPerStage: 1})
	c.WaitReady(t)
	a := startAPI(t, c, Config{}, nil, nil)
	ctx := testCtx(t)
	cancels := make([]context.CancelFunc, maxReplicaWatches)
	for i := range maxReplicaWatches {
		wctx, cancel := context.WithCancel(ctx)
		cancels[i] = cancel
		a.watchReplicas(t, wctx, "")
	}
	resp, body := a.do(t, http.MethodGet, "/v1/replicas?watch=true", nil, nil)
	wantError(t, resp, body, http.StatusTooManyRequests, typeRateLimit, "too_many_watches")
	assert.Equal(t, "1", resp.Header.Get("Retry-After"))
	resp, body = a.do(t, http.MethodGet, "/v1/replicas", nil, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode, "the list is not limited: %s", body)

	cancels[0]()
	require.Eventually(t, func() bool { return a.watches.Load() < maxReplicaWatches }, 30*time.Second, 5*time.Millisecond,
		"a watch whose client went is no longer counted")
	s := a.watchReplicas(t, ctx, "")
	ev, ok := s.next(t)
	require.True(t, ok)
	assert.Equal(t, "replica", ev.Type)
	for _, cancel := range cancels[1:] {
		cancel()
	}
}
