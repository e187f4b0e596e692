package httpapi

import (
	"encoding/json"
	"net/http"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
)

// promTargetGroup is Prometheus's http_sd target group, as its
// discovery/http package decodes one.
type promTargetGroup struct {
	Targets []string          `json:"targets"`
	Labels  map[string]string `json:"labels"`
}

// TestReplicasSD: GET /v1/replicas/sd lists every replica the head routes
// in Prometheus's http_sd format, by its gRPC address, and drops one that
// left; it is an admin route.
func TestReplicasSD(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{})
	extra := c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{})
	c.WaitState(t, "thinker", extra.ReplicaID(), "attached")
	a := startAPI(t, c, Config{APIKey: "infer", AdminAPIKey: "admin", Gatherer: c.Metrics}, nil, nil)
	admin := http.Header{"Authorization": {"Bearer admin"}}

	sd := func() []promTargetGroup {
		t.Helper()
		resp, body := a.do(t, "GET", "/v1/replicas/sd", nil, admin)
		require.Equal(t, http.StatusOK, resp.StatusCode, "body: %s", body)
		assert.Equal(t, "application/json", resp.Header.Get("Content-Type"))
		var groups []promTargetGroup
		require.NoError(t, json.Unmarshal(body, &groups), "body: %s", body)
		return groups
	}
	want := func() []promTargetGroup {
		var out []promTargetGroup
		for _, r := range c.Head.Replicas() {
			if r.State == "detached" {
				continue
			}
			out = append(out, promTargetGroup{Targets: []string{r.Addr}, Labels: map[string]string{
				"stage": r.StageName, "replica": strconv.FormatUint(uint64(r.Replica), 10),
				"engine_index": strconv.Itoa(r.EngineIndex), "endpoint": "grpc",
			}})
		}
		return out
	}
	groups := sd()
	assert.Len(t, groups, len(c.Workers()), "one group per replica")
	assert.ElementsMatch(t, want(), groups)
	var addrs []string
	for _, w := range c.Workers() {
		addrs = append(addrs, w.Addr())
	}
	var targets []string
	for _, g := range groups {
		targets = append(targets, g.Targets...)
	}
	assert.ElementsMatch(t, addrs, targets, "each worker's own address")

	extra.Stop(t)
	c.WaitState(t, "thinker", extra.ReplicaID(), "detached")
	groups = sd()
	assert.Len(t, groups, len(c.Workers())-1, "a replica that left is no target")
	for _, g := range groups {
		assert.NotEqual(t, []string{extra.Addr()}, g.Targets)
	}
	assert.ElementsMatch(t, want(), groups)

	resp, body := a.do(t, "GET", "/v1/replicas/sd", nil, http.Header{"Authorization": {"Bearer infer"}})
	wantError(t, resp, body, http.StatusForbidden, typePermission, "admin_key_required")
}
