package orchestrator_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/worker/sim"
)

// desiredReplicas reads troupe_stage_desired_replicas of every stage.
func desiredReplicas(t *testing.T, c *orchestratortest.Cluster) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	for _, st := range c.Head.Pipeline().Stages {
		v, ok := value(t, c.Metrics, "troupe_stage_desired_replicas", map[string]string{"stage_name": st.Name})
		require.True(t, ok, "no troupe_stage_desired_replicas for %s", st.Name)
		out[st.Name] = v
	}
	return out
}

// A load step through the head on stages of different speeds raises each
// stage's troupe_stage_desired_replicas, the slow vocoder's above the fast
// thinker's, and once the load stops the figure falls back to 1 only after
// the scale-down cooldown.
func TestDesiredReplicasFollowLoad(t *testing.T) {
	const (
		cooldown = 2 * time.Second
		interval = 50 * time.Millisecond
		clients  = 24
	)
	c := orchestratortest.Start(t, orchestratortest.Options{
		ReplicasPerStage: -1,
		Autoscale:        orchestrator.AutoscaleConfig{ScaleDownCooldown: cooldown, Interval: interval, TargetUtilization: 1},
	})
	speeds := map[string]time.Duration{"thinker": 2 * time.Millisecond, "talker": 2 * time.Millisecond, "vocoder": 20 * time.Millisecond}
	for _, st := range c.Head.Pipeline().Stages {
		cfg := sim.Config{MaxNumSeqs: 2, DecodeTokenLatency: speeds[st.Name]}
		w := c.AddWorker(t, st.Name, orchestratortest.WorkerOptions{Sim: &cfg})
		c.WaitState(t, st.Name, w.ReplicaID(), orchestrator.StateAttached)
	}
	require.Equal(t, 3, countFamily(t, c), "one child per stage")
	for name, v := range desiredReplicas(t, c) {
		require.Equal(t, 1.0, v, "idle stage %s", name)
	}

	load, stop := context.WithCancel(ctxT(t))
	defer stop()
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	for g := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; load.Err() == nil; i++ {
				_, err := c.Head.Execute(load, orchestrator.Request{ID: fmt.Sprint("load", g, "-", i), Prompt: "scale me out", Sampling: sampling(8, int64(i)), Stages: 3}, nil)
				if err != nil && load.Err() == nil {
					errs <- err
					return
				}
			}
		}()
	}
	// rose[s] is when the poll first saw stage s above 1, idle[s] the
	// poll before, which still saw 1: the raw figure that raised it was
	// computed after idle[s].
	var now map[string]float64
	rose, idle, peak := map[string]time.Time{}, map[string]time.Time{}, map[string]float64{}
	require.Eventually(t, func() bool {
		at := time.Now()
		now = desiredReplicas(t, c)
		for name, v := range now {
			if _, ok := rose[name]; ok {
				peak[name] = max(peak[name], v)
				continue
			}
			if v > 1 {
				rose[name], peak[name] = at, v
			} else {
				idle[name] = at
			}
		}
		return len(rose) == 3 && now["vocoder"] >= 2*max(now["thinker"], now["talker"])
	}, 30*time.Second, 10*time.Millisecond, "recommendations under load never rose, the slow stage's at least twice the fast ones': %v", &now)
	t.Logf("under load: %v (peaks %v)", now, peak)
	for name := range rose {
		t.Logf("%s rose %v after the load started", name, rose[name].Sub(idle[name]))
	}

	cancelled := time.Now()
	stop()
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	fell := map[string]time.Time{}
	require.Eventually(t, func() bool {
		at := time.Now()
		for name, v := range desiredReplicas(t, c) {
			if _, ok := fell[name]; !ok && v == 1 {
				fell[name] = at
			}
		}
		return len(fell) == 3
	}, cooldown+30*time.Second, 10*time.Millisecond, "recommendations never fell back to 1")
	for name, at := range fell {
		// Every raw figure above 1 was computed after idle[name]; the
		// published figure may fall only a cooldown after the last one.
		assert.GreaterOrEqual(t, at.Sub(idle[name]), cooldown, "stage %s fell before the cooldown", name)
		t.Logf("%s fell %v after its rise began", name, at.Sub(idle[name]))
	}
	// The vocoder was the bottleneck until the load stopped: its raw
	// figure stayed high until then, less one computation.
	assert.GreaterOrEqual(t, fell["vocoder"].Sub(cancelled), cooldown-interval, "the vocoder fell before the cooldown")
	t.Logf("vocoder fell %v after the load stopped", fell["vocoder"].Sub(cancelled))
}

// countFamily counts the children of troupe_stage_desired_replicas.
func countFamily(t *testing.T, c *orchestratortest.Cluster) int {
	t.Helper()
	n, err := testutil.GatherAndCount(c.Metrics, "troupe_stage_desired_replicas")
	require.NoError(t, err)
	return n
}
