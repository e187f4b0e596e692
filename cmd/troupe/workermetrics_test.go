package main

import (
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/membership/membershiptest"
)

// TestWorkerMetricsEndpoint: `troupe worker --metrics-listen` serves the
// worker's own /metrics, with its etcd gauges, and /healthz.
func TestWorkerMetricsEndpoint(t *testing.T) {
	etcd := membershiptest.Start(t)
	w := background(t, "worker", runWorker, "--etcd-endpoints", strings.Join(etcd.Endpoints(), ","), "--stage", "thinker",
		"--log-level", "error", "--metrics-listen", "127.0.0.1:0")
	url := w.wait(t, regexp.MustCompile(`metrics on (http://\S+)\n`))
	w.wait(t, workRE)

	hc := &http.Client{Transport: &http.Transport{}, Timeout: 5 * time.Second}
	defer hc.CloseIdleConnections()
	var body string
	require.Eventually(t, func() bool {
		resp, err := hc.Get(url)
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		body = string(b)
		return err == nil && resp.StatusCode == http.StatusOK && strings.Contains(body, "\ntroupe_etcd_up 1\n")
	}, 30*time.Second, 20*time.Millisecond, "troupe_etcd_up 1 on the worker's /metrics")
	assert.Regexp(t, `\ntroupe_lease_keepalive_lag_seconds \d`, body)
	assert.Contains(t, body, "go_goroutines")

	// GET /healthz beside it: the liveness probe of the chart's workers.
	resp, err := hc.Get(strings.TrimSuffix(url, "/metrics") + "/healthz")
	require.NoError(t, err)
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, resp.Body.Close())
	require.NoError(t, err)
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, "ok\n", string(b))
}
