package orchestrator_test

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/worker/sim"
)

// A pipeline whose second stage cannot take what the first gives: the sim
// names make the thinker give text and the vocoder take codes.
var thinkerVocoder = orchestrator.Pipeline{Model: "troupe-omni-sim", Stages: []orchestrator.Stage{{Name: "thinker"}, {Name: "vocoder"}}}

// waitRefused waits until the head lists the replica as refused.
func waitRefused(t *testing.T, c *orchestratortest.Cluster, stage string, replica uint32) orchestrator.ReplicaStatus {
	t.Helper()
	var got orchestrator.ReplicaStatus
	require.Eventually(t, func() bool {
		for _, r := range c.Head.Replicas() {
			if r.StageName == stage && r.Replica == replica {
				got = r
				return r.State == "unhealthy" && strings.HasPrefix(r.Reason, "refused: ")
			}
		}
		return false
	}, 30*time.Second, 5*time.Millisecond, "replica %s/%d never refused", stage, replica)
	return got
}

func roleErrors(t *testing.T, c *orchestratortest.Cluster) float64 {
	v, _ := value(t, c.Metrics, "troupe_head_attach_errors_total", map[string]string{"step": "role"})
	return v
}

// TestRefusesReplicaThatCannotTakePreviousOutput: the vocoder (codes in)
// joins after a thinker (text out). The head refuses it on join, says why
// in /v1/replicas and counts it, and routes nothing to it: a request that
// needs it fails fast with no replica, not later on the vocoder.
func TestRefusesReplicaThatCannotTakePreviousOutput(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerVocoder, ReplicasPerStage: -1})
	th := c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{})
	c.WaitState(t, "thinker", th.ReplicaID(), "attached")
	voc := c.AddWorker(t, "vocoder", orchestratortest.WorkerOptions{})
	st := waitRefused(t, c, "vocoder", voc.ReplicaID())
	assert.Equal(t, 1.0, roleErrors(t, c))
	assert.Contains(t, st.Reason, "refused: this replica takes codes, but stage thinker before it gives text")
	ready, why := c.Head.Ready()
	assert.False(t, ready)
	assert.Contains(t, why, "vocoder")
	_, err := c.Head.Execute(ctxT(t), orchestrator.Request{ID: "r", Prompt: "hi", Stages: 2}, nil)
	require.ErrorIs(t, err, orchestrator.ErrNoReplica)
	// The thinker alone still serves.
	res, err := c.Head.Execute(ctxT(t), orchestrator.Request{ID: "r1", Prompt: "hi", Sampling: sampling(4, 1)}, nil)
	require.NoError(t, err)
	want, _, _ := sim.ExpectedText("hi", 1, 4)
	assert.Equal(t, want, res.Text)
}

// TestRefusesReplicaWhoseOutputNextStageCannotTake: the vocoder joined
// first; a thinker whose text the vocoder cannot take is refused. Once the
// vocoder leaves, a thinker that joins again is taken.
func TestRefusesReplicaWhoseOutputNextStageCannotTake(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: thinkerVocoder, ReplicasPerStage: -1})
	voc := c.AddWorker(t, "vocoder", orchestratortest.WorkerOptions{})
	c.WaitState(t, "vocoder", voc.ReplicaID(), "attached")
	th := c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{})
	st := waitRefused(t, c, "thinker", th.ReplicaID())
	assert.Contains(t, st.Reason, "this replica gives text, but stage vocoder after it takes codes")

	voc.Stop(t)
	c.WaitState(t, "vocoder", voc.ReplicaID(), "detached")
	th2 := c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{})
	c.WaitState(t, "thinker", th2.ReplicaID(), "attached")
	assert.Equal(t, 1.0, roleErrors(t, c))
}

// TestFirstStageTakesText: a stage 0 that takes codes can never get them.
func TestFirstStageTakesText(t *testing.T) {
	p := orchestrator.Pipeline{Model: "m", Stages: []orchestrator.Stage{{Name: "vocoder"}}}
	c := orchestratortest.Start(t, orchestratortest.Options{Pipeline: p, ReplicasPerStage: -1})
	voc := c.AddWorker(t, "vocoder", orchestratortest.WorkerOptions{})
	st := waitRefused(t, c, "vocoder", voc.ReplicaID())
	assert.Contains(t, st.Reason, "first stage, which takes text from the client, but this replica takes codes")
}

// TestDefaultPipelineRoles: the sim's thinker → talker → vocoder fits, and
// audio still comes out exactly as the sim says when the stages are chained
// by role.
func TestDefaultPipelineRoles(t *testing.T) {
	c := orchestratortest.Start(t, orchestratortest.Options{})
	for _, r := range c.Head.Replicas() {
		assert.Equal(t, orchestrator.StateAttached, r.State)
		assert.Empty(t, r.Reason)
	}
	res, err := c.Head.Execute(ctxT(t), orchestrator.Request{ID: "a", Prompt: "sing", Sampling: sampling(6, 3), Stages: 3}, nil)
	require.NoError(t, err)
	text, _, _ := sim.ExpectedText("sing", 3, 6)
	codes, _ := sim.ExpectedCodes(text, 3, 0)
	assert.Equal(t, text, res.Text)
	assert.Equal(t, codes, res.Codes)
	assert.Equal(t, sim.ExpectedAudio(codes), res.PCM)
	assert.Zero(t, roleErrors(t, c))
}
