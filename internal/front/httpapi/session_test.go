package httpapi

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
)

// servedBy returns, per replica id of stage 0, how many requests it finished.
func servedBy(t *testing.T, c *orchestratortest.Cluster) map[string]float64 {
	t.Helper()
	fams, err := c.Metrics.Gather()
	require.NoError(t, err)
	out := map[string]float64{}
	for _, f := range fams {
		if f.GetName() != "troupe_request_success_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			if labelOf(m, "stage") == "0" {
				out[labelOf(m, "replica")] += m.GetCounter().GetValue()
			}
		}
	}
	return out
}

// moved returns the replicas whose count grew between two servedBy maps.
func moved(before, after map[string]float64) []string {
	var out []string
	for r, n := range after {
		if n > before[r] {
			out = append(out, r)
		}
	}
	return out
}

func TestSessionKeyRoutesToOneReplica(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{
		Pipeline:         orchestrator.Pipeline{Model: model, Stages: []orchestrator.Stage{{Name: "thinker"}}},
		ReplicasPerStage: 3,
		Policy:           "round_robin",
	})
	a := startAPI(t, c, Config{SessionHeader: "X-Session-ID", SessionFromUser: true}, nil, nil)
	chat := func(extra string, header http.Header) {
		t.Helper()
		body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"hi"}],"max_tokens":2%s}`, model, extra)
		resp, data := a.do(t, http.MethodPost, "/v1/chat/completions", strings.NewReader(body), header)
		require.Equal(t, http.StatusOK, resp.StatusCode, "body: %s", data)
	}
	decisions := func(reason string) float64 {
		return counter(t, c, "troupe_router_decisions_total", "0", "reason", reason)
	}

	cases := []struct {
		name   string
		extra  string
		header http.Header
	}{
		{"header", "", http.Header{"X-Session-Id": {"alice"}}},
		{"user field", `,"user":"bob"`, nil},
		{"header wins over user", `,"user":"bob"`, http.Header{"X-Session-Id": {"carol"}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before, aff := servedBy(t, c), decisions("affinity")
			for range 6 {
				chat(tc.extra, tc.header)
			}
			assert.Len(t, moved(before, servedBy(t, c)), 1, "one session, one replica")
			assert.Equal(t, 6.0, decisions("affinity")-aff)
		})
	}

	// Without a key, the stage's policy (round robin) spreads them.
	before, rot := servedBy(t, c), decisions("rotation")
	for range 6 {
		chat("", nil)
	}
	assert.Len(t, moved(before, servedBy(t, c)), 3)
	assert.Equal(t, 6.0, decisions("rotation")-rot)

	// An API that takes no session keys ignores both.
	plain := startAPI(t, c, Config{}, nil, nil)
	rot = decisions("rotation")
	resp, data := plain.do(t, http.MethodPost, "/v1/chat/completions",
		strings.NewReader(fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"user":"bob"}`, model)),
		http.Header{"X-Session-Id": {"alice"}})
	require.Equal(t, http.StatusOK, resp.StatusCode, "body: %s", data)
	assert.Equal(t, 1.0, decisions("rotation")-rot)

	// A user field that is not a string is refused, naming the field.
	resp, data = a.post(t, "/v1/chat/completions", fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"hi"}],"user":7}`, model))
	e := wantError(t, resp, data, http.StatusBadRequest, typeInvalidRequest, "invalid_type")
	require.NotNil(t, e.Param)
	assert.Equal(t, "user", *e.Param)
}
