package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/membership/membershiptest"
)

// TestWorkerSeriesThroughSD: a head with --replica-series minimal and a
// worker with --metrics-listen. The head's /v1/replicas/sd?endpoint=metrics
// lists the worker's metrics address with stage, stage_name, replica and
// engine_index; the worker's /metrics has its replica's request series,
// counting the chats sent through the head's API, while the head keeps
// them per stage only. Where Debian's prometheus is installed, a real
// Prometheus discovers the worker through the head (http_sd_configs),
// scrapes it, and stores its series with the SD labels.
func TestWorkerSeriesThroughSD(t *testing.T) {
	etcd := strings.Join(membershiptest.Start(t).Endpoints(), ",")
	pipeline := filepath.Join(t.TempDir(), "pipeline.yaml")
	require.NoError(t, os.WriteFile(pipeline, []byte("model: troupe-omni-sim\nstages:\n  - name: thinker\n"), 0o600))
	h := background(t, "head", runHead, "--etcd-endpoints", etcd, "--pipeline", pipeline, "--http", "127.0.0.1:0",
		"--log-level", "error", "--replica-series", "minimal")
	base := h.wait(t, headRE)
	w := background(t, "worker", runWorker, "--etcd-endpoints", etcd, "--stage", "thinker", "--replica-id", "0",
		"--log-level", "error", "--metrics-listen", "127.0.0.1:0")
	metricsURL := w.wait(t, regexp.MustCompile(`metrics on (http://\S+)\n`))
	w.wait(t, workRE)

	get := httpGetter(t)
	require.Eventually(t, func() bool { code, _ := get(base + "/readyz"); return code == http.StatusOK }, 60*time.Second, 20*time.Millisecond)
	const chats = 3
	for i := range chats {
		chat(t, base, fmt.Sprintf(`{"model":"troupe-omni-sim","seed":%d,"messages":[{"role":"user","content":"hi"}],"max_tokens":4}`, i))
	}

	code, body := get(base + "/v1/replicas/sd?endpoint=metrics")
	require.Equal(t, http.StatusOK, code, body)
	var groups []struct {
		Targets []string          `json:"targets"`
		Labels  map[string]string `json:"labels"`
	}
	require.NoError(t, json.Unmarshal([]byte(body), &groups), body)
	require.Len(t, groups, 1, body)
	metricsAddr := strings.TrimSuffix(strings.TrimPrefix(metricsURL, "http://"), "/metrics")
	assert.Equal(t, []string{metricsAddr}, groups[0].Targets)
	assert.Equal(t, map[string]string{"stage": "0", "stage_name": "thinker", "replica": "0", "engine_index": "0", "endpoint": "metrics"}, groups[0].Labels)
	code, body = get(base + "/v1/replicas/sd?endpoint=ftp")
	assert.Equal(t, http.StatusBadRequest, code, body)

	e2e := regexp.MustCompile(`\ntroupe_e2e_request_latency_seconds_count\{model_name="[^"]*",replica="0",stage="thinker"\} 3\n`)
	require.Eventually(t, func() bool { _, b := get(metricsURL); body = b; return e2e.MatchString(b) }, 30*time.Second, 20*time.Millisecond,
		"the worker's own e2e histogram counts the 3 chats")
	assert.Regexp(t, `\ntroupe_num_requests_running\{model_name="[^"]*",replica="0",stage="thinker"\} 0\n`, body)
	assert.Regexp(t, `\ntroupe_request_success_total\{finished_reason="length",model_name="[^"]*",replica="0",stage="thinker"\} 3\n`, body)
	_, headBody := get(base + "/metrics")
	assert.Contains(t, headBody, `troupe_e2e_request_latency_seconds_count{model_name="troupe-omni-sim",replica="",stage="0"} 3`)
	assert.NotContains(t, headBody, `troupe_e2e_request_latency_seconds_count{model_name="troupe-omni-sim",replica="0"`, "minimal: no per-replica histogram on the head")
	assert.Contains(t, headBody, `troupe_replica_attached{model_name="troupe-omni-sim",replica="0",stage="0"} 1`)

	scrapeThroughSD(t, base)
}

// scrapeThroughSD runs Debian's Prometheus with the SD snippet of
// docs/stats.md against the head and reads the worker's series back.
func scrapeThroughSD(t *testing.T, base string) {
	bin, err := exec.LookPath("prometheus")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("prometheus is not installed (Debian package prometheus; scripts/test.sh installs it): %v", err)
		}
		t.Skip("prometheus is not on PATH (apt-get install -y prometheus); CI fails here instead")
	}
	dir := t.TempDir()
	cfg := fmt.Sprintf(`global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: troupe-replicas
    http_sd_configs:
      - url: %s/v1/replicas/sd?endpoint=metrics
        refresh_interval: 1s
    metric_relabel_configs:
      - action: labeldrop
        regex: exported_.*
`, base)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "prometheus.yml"), []byte(cfg), 0o600))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	listen := ln.Addr().String()
	require.NoError(t, ln.Close())
	ctx, cancel := context.WithCancel(context.Background())
	var logs bytes.Buffer
	cmd := exec.CommandContext(ctx, bin, "--config.file="+filepath.Join(dir, "prometheus.yml"),
		"--storage.tsdb.path="+filepath.Join(dir, "data"), "--web.listen-address="+listen, "--log.level=warn")
	cmd.Stdout, cmd.Stderr = &logs, &logs
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 10 * time.Second
	require.NoError(t, cmd.Start())
	defer func() {
		cancel()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("prometheus output:\n%s", logs.String())
		}
	}()

	client := &http.Client{Timeout: 5 * time.Second}
	defer client.CloseIdleConnections()
	q := `troupe_e2e_request_latency_seconds_count{job="troupe-replicas",stage="0",stage_name="thinker",replica="0",engine_index="0",endpoint="metrics"}`
	var got []struct {
		Metric map[string]string `json:"metric"`
		Value  []any             `json:"value"`
	}
	require.Eventually(t, func() bool {
		resp, err := client.Get("http://" + listen + "/api/v1/query?" + url.Values{"query": {q}}.Encode())
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		var out struct {
			Data struct {
				Result json.RawMessage `json:"result"`
			} `json:"data"`
		}
		if json.NewDecoder(resp.Body).Decode(&out) != nil || json.Unmarshal(out.Data.Result, &got) != nil {
			return false
		}
		return len(got) == 1
	}, 90*time.Second, 250*time.Millisecond, "Prometheus never stored the worker's e2e histogram with the SD labels")
	assert.Equal(t, "3", got[0].Value[1], "the worker's count of the chats")
	assert.NotContains(t, got[0].Metric, "exported_stage", "the worker's stage name is dropped for the SD's index")
	t.Logf("stored series: %v", got[0].Metric)
}

// TestWorkerSeriesCountStreamedCalls: in a streamed pipeline the talker
// and the vocoder are fed by GenerateStream; their workers' own series
// count those calls too (one request each per chat), as the head does.
func TestWorkerSeriesCountStreamedCalls(t *testing.T) {
	etcd := strings.Join(membershiptest.Start(t).Endpoints(), ",")
	pipeline := filepath.Join(t.TempDir(), "pipeline.yaml")
	require.NoError(t, os.WriteFile(pipeline, []byte("model: troupe-omni-sim\nstages:\n  - name: thinker\n  - name: talker\n  - name: vocoder\n"), 0o600))
	h := background(t, "head", runHead, "--etcd-endpoints", etcd, "--pipeline", pipeline, "--http", "127.0.0.1:0", "--log-level", "error")
	base := h.wait(t, headRE)
	metrics := map[string]string{}
	for _, stage := range []string{"thinker", "talker", "vocoder"} {
		w := background(t, "worker "+stage, runWorker, "--etcd-endpoints", etcd, "--stage", stage, "--replica-id", "0",
			"--log-level", "error", "--metrics-listen", "127.0.0.1:0")
		metrics[stage] = w.wait(t, regexp.MustCompile(`metrics on (http://\S+)\n`))
		w.wait(t, workRE)
	}

	get := httpGetter(t)
	require.Eventually(t, func() bool { code, _ := get(base + "/readyz"); return code == http.StatusOK }, 60*time.Second, 20*time.Millisecond)
	const chats = 2
	for i := range chats {
		a := chat(t, base, fmt.Sprintf(`{"model":"troupe-omni-sim","seed":%d,"messages":[{"role":"user","content":"say hi"}],"max_tokens":8,`+
			`"modalities":["text","audio"],"audio":{"voice":"alloy","format":"wav"}}`, i))
		require.NotNil(t, a.Choices[0].Message.Audio, "the chat ran every stage")
	}
	for _, stage := range []string{"talker", "vocoder"} {
		done := regexp.MustCompile(fmt.Sprintf(`\ntroupe_e2e_request_latency_seconds_count\{model_name="[^"]*",replica="0",stage="%s"\} %d\n`, stage, chats))
		var body string
		require.Eventually(t, func() bool { _, b := get(metrics[stage]); body = b; return done.MatchString(b) }, 30*time.Second, 20*time.Millisecond,
			"the %s worker's own e2e histogram counts its %d streamed calls", stage, chats)
		assert.Regexp(t, fmt.Sprintf(`\ntroupe_time_to_first_token_seconds_count\{model_name="[^"]*",replica="0",stage="%s"\} %d\n`, stage, chats), body)
		assert.Regexp(t, fmt.Sprintf(`\ntroupe_num_requests_running\{model_name="[^"]*",replica="0",stage="%s"\} 0\n`, stage), body)
	}
}

// httpGetter returns a GET that answers the status and body (0 and the
// error's text when the request failed); its connections close when the
// test ends.
func httpGetter(t *testing.T) func(url string) (int, string) {
	hc := &http.Client{Transport: &http.Transport{}, Timeout: 5 * time.Second}
	t.Cleanup(hc.CloseIdleConnections)
	return func(u string) (int, string) {
		resp, err := hc.Get(u)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
}
