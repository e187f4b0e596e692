package e2e

import (
	"io"
	"net/http"
	"regexp"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var headAdminRE = regexp.MustCompile(`^troupe head: admin and metrics on (http://\S+)$`)

// TestAdminListener: with --admin-http, admin routes and /metrics move to
// their own listener; the serving listener keeps the API and the probes.
func TestAdminListener(t *testing.T) {
	if testing.Short() {
		t.Skip("process test; skipped with -short")
	}
	etcd := startEtcd(t)
	h := startHead(t, etcd, "--pipeline", thinkerOnly(t), "--admin-http", "127.0.0.1:0")
	admin := h.waitLine(t, h.stdout, headAdminRE)[1]
	startWorker(t, etcd, "thinker")

	status := func(url string) int {
		req, err := http.NewRequestWithContext(testCtx(t), http.MethodGet, url, nil)
		require.NoError(t, err)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	eventually(testCtx(t), t, "ready", func() (bool, string, error) {
		code := status(h.base + "/readyz")
		return code == http.StatusOK, http.StatusText(code), nil
	})
	assert.Equal(t, http.StatusOK, status(admin+"/metrics"))
	assert.Equal(t, http.StatusOK, status(admin+"/v1/replicas"))
	assert.Equal(t, http.StatusNotFound, status(h.base+"/metrics"), "metrics only on the admin listener")
	assert.Equal(t, http.StatusNotFound, status(h.base+"/v1/replicas"), "admin only on the admin listener")
	assert.Equal(t, http.StatusOK, status(h.base+"/v1/models"))
	assert.Equal(t, http.StatusOK, status(h.base+"/readyz"))
	assert.Equal(t, http.StatusOK, status(admin+"/healthz"))
}
