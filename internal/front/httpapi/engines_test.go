package httpapi

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
)

// TestParseChatCarriesMessagesAndVoice: the conversation reaches the head
// as messages (role and content, array parts joined), not only as the
// flattened prompt, and audio.voice as the voice name.
func TestParseChatCarriesMessagesAndVoice(t *testing.T) {
	j, e := parseChat([]byte(`{"model":"troupe-omni-sim","messages":[
		{"role":"system","content":"be brief"},
		{"role":"user","content":[{"type":"text","text":"hello"},{"type":"text","text":"world"}]},
		{"role":"assistant","content":null}],
		"modalities":["text","audio"],"audio":{"voice":"en+f3","format":"wav"}}`), testModel)
	require.Nil(t, e)
	require.Len(t, j.messages, 3)
	for i, want := range [][2]string{{"system", "be brief"}, {"user", "hello\nworld"}, {"assistant", ""}} {
		assert.Equal(t, want[0], j.messages[i].GetRole())
		assert.Equal(t, want[1], j.messages[i].GetContent())
	}
	assert.Equal(t, "en+f3", j.voice)

	j, e = parseChat([]byte(`{"model":"troupe-omni-sim","messages":[{"role":"user","content":"hi"}],"audio":{"voice":{"id":"voice_123"}}}`), testModel)
	require.Nil(t, e)
	assert.Equal(t, "voice_123", j.voice)
	j, e = parseChat([]byte(`{"model":"troupe-omni-sim","messages":[{"role":"user","content":"hi"}]}`), testModel)
	require.Nil(t, e)
	assert.Empty(t, j.voice)
	assert.Nil(t, j.sampling.Temperature, "no temperature: the engine's default")
}

// TestReplicasReason: a replica the head refused (its roles do not fit:
// a vocoder, codes in, after a thinker, text out) is listed as unhealthy
// with the reason.
func TestReplicasReason(t *testing.T) {
	p := orchestrator.Pipeline{Model: "troupe-omni-sim", Stages: []orchestrator.Stage{{Name: "thinker"}, {Name: "vocoder"}}}
	c := startCluster(t, orchestratortest.Options{Pipeline: p, ReplicasPerStage: -1})
	a := startAPI(t, c, Config{}, nil, nil)
	th := c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{})
	c.WaitState(t, "thinker", th.ReplicaID(), "attached")
	c.AddWorker(t, "vocoder", orchestratortest.WorkerOptions{})

	var rows replicaList
	require.Eventually(t, func() bool {
		resp, body := a.do(t, http.MethodGet, "/v1/replicas", nil, nil)
		require.Equal(t, http.StatusOK, resp.StatusCode)
		require.NoError(t, json.Unmarshal(body, &rows))
		for _, r := range rows.Data {
			if r.StageName == "vocoder" && strings.HasPrefix(r.Reason, "refused:") {
				return true
			}
		}
		return false
	}, wait, 5*time.Millisecond)
	for _, r := range rows.Data {
		switch r.StageName {
		case "vocoder":
			assert.Equal(t, orchestrator.StateUnhealthy, r.State)
			assert.Contains(t, r.Reason, "takes codes, but stage thinker before it gives text")
		case "thinker":
			assert.Equal(t, orchestrator.StateAttached, r.State)
			assert.Empty(t, r.Reason)
		}
	}
	// An attached replica's row has no reason key at all.
	resp, body := a.do(t, http.MethodGet, "/v1/replicas", nil, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	var raw struct {
		Data []map[string]any `json:"data"`
	}
	require.NoError(t, json.Unmarshal(body, &raw))
	for _, r := range raw.Data {
		if r["stage_name"] == "thinker" {
			assert.NotContains(t, r, "reason")
		}
	}
}
