package httpapi

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
)

// TestDrainingRefusalsAreNotAttempts: replicas that drain refuse new calls
// before the head learns it (here etcd is down, so their records cannot
// go; in a leave storm the watch is simply behind). A refusal is not an
// attempt: every request still reaches the one replica that serves, and
// no refusing replica is counted as failing. With refusals counted as
// attempts, round robin over four refusing replicas and one serving one
// failed most requests with 502. A refusal also takes its replica out of
// routing at once (GET /v1/replicas lists it unhealthy, draining): in a
// leave storm of half a fleet, requests that each met their own refusals
// until the head learned of the drains could run out of them.
func TestDrainingRefusalsAreNotAttempts(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{
		Pipeline:         orchestrator.Pipeline{Model: model, Stages: []orchestrator.Stage{{Name: "thinker", Policy: "round_robin"}}},
		ReplicasPerStage: 5,
	})
	a := startAPI(t, c, Config{}, nil, nil)
	ctx := testCtx(t)
	workers := c.Workers()
	require.Len(t, workers, 5)

	c.Etcd.Stop()
	t.Cleanup(func() { c.Etcd.Restart(t) })
	var drained sync.WaitGroup
	for _, w := range workers[1:] {
		drained.Go(func() { w.Server.Drain() }) // its deregistration waits for etcd, in vain
	}
	client := a.openai()
	for i := range 20 {
		res, err := client.Chat.Completions.New(ctx, chatParams(fmt.Sprint("request ", i), 1, 3))
		var apiErr *openai.Error
		if errors.As(err, &apiErr) {
			t.Logf("request %d: %s", i, apiErr.RawJSON())
		}
		require.NoError(t, err, "request %d: a draining replica's refusal sends it on: %+v", i, err)
		require.Len(t, res.Choices, 1)
	}
	drained.Wait()

	// Every draining replica refused once and is routed no more; the
	// serving one is attached.
	resp, body := a.do(t, "GET", "/v1/replicas", nil, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", body)
	var list replicaList
	require.NoError(t, json.Unmarshal(body, &list))
	states := map[uint32]orchestrator.ReplicaStatus{}
	for _, r := range list.Data {
		states[r.Replica] = r
	}
	assert.Equal(t, orchestrator.StateAttached, states[workers[0].ReplicaID()].State)
	for _, w := range workers[1:] {
		st := states[w.ReplicaID()]
		assert.Equal(t, orchestrator.StateUnhealthy, st.State, "replica %d", w.ReplicaID())
		assert.True(t, strings.HasPrefix(st.Reason, "draining:"), "replica %d: %q", w.ReplicaID(), st.Reason)
	}

	assert.Zero(t, counter(t, c, "troupe_router_ejections_total", "0", "", ""),
		"a replica that refuses while it drains is not failing: none ejected")
}
