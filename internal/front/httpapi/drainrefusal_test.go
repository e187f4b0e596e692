package httpapi

import (
	"errors"
	"fmt"
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
// failed most requests with 502.
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

	assert.Zero(t, counter(t, c, "troupe_router_ejections_total", "0", "", ""),
		"a replica that refuses while it drains is not failing: none ejected")
}
