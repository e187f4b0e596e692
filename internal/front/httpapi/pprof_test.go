package httpapi

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
)

// The head serves Go's profiles as admin routes: with an admin key only it
// opens them, they are on the admin handler and not on the serving one,
// and a CPU profile is a gzipped profile an operator can open with
// `go tool pprof`. The command line is not served (it may hold an API key
// given as a flag).
func TestProfiles(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{})
	bearer := func(k string) http.Header { return http.Header{"Authorization": {"Bearer " + k}} }
	a := startAPI(t, c, Config{APIKey: "infer", AdminAPIKey: "admin", Gatherer: c.Metrics}, nil, nil)

	resp, b := a.do(t, "GET", "/debug/pprof/heap?debug=1", nil, bearer("infer"))
	wantError(t, resp, b, http.StatusForbidden, typePermission, "admin_key_required")
	resp, b = a.do(t, "GET", "/debug/pprof/goroutine?debug=1", nil, nil)
	wantError(t, resp, b, http.StatusUnauthorized, typeAuthentication, "invalid_api_key")

	resp, b = a.do(t, "GET", "/debug/pprof/", nil, bearer("admin"))
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", b)
	assert.Contains(t, string(b), "goroutine", "the index lists the profiles")
	resp, b = a.do(t, "GET", "/debug/pprof/heap?debug=1", nil, bearer("admin"))
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", b)
	assert.Contains(t, string(b), "heap profile:")
	resp, b = a.do(t, "GET", "/debug/pprof/profile?seconds=1", nil, bearer("admin"))
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", b)
	assert.True(t, bytes.HasPrefix(b, []byte{0x1f, 0x8b}), "a gzipped profile")
	resp, _ = a.do(t, "GET", "/debug/pprof/cmdline", nil, bearer("admin"))
	assert.Equal(t, http.StatusNotFound, resp.StatusCode, "no command line")

	// The split listeners: profiles on the admin one only.
	s := New(c.Head, Config{Gatherer: c.Metrics})
	for _, tc := range []struct {
		h    http.Handler
		want int
	}{{s.AdminHandler(), http.StatusOK}, {s.ServingHandler(), http.StatusNotFound}} {
		rec := httptest.NewRecorder()
		tc.h.ServeHTTP(rec, httptest.NewRequestWithContext(testCtx(t), "GET", "/debug/pprof/goroutine?debug=1", nil))
		assert.Equal(t, tc.want, rec.Code)
	}
}
