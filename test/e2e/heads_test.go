//go:build unix

package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// post sends an empty POST and returns the status and body.
func (h *head) post(ctx context.Context, path string) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, h.base+path, nil)
	if err != nil {
		return 0, "", err
	}
	resp, err := h.client.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// status is the code of GET path (0 when there was no answer).
func (h *head) status(ctx context.Context, path string) int {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, h.base+path, nil)
	if err != nil {
		return 0
	}
	resp, err := h.client.Do(req)
	if err != nil {
		return 0
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// membershipView is what every head must agree on: each replica's stage,
// id, address and state.
func membershipView(ctx context.Context, h *head) ([]string, error) {
	rows, err := h.replicas(ctx)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, r := range rows {
		out = append(out, fmt.Sprintf("%s/%d %s %s", r.StageName, r.Replica, r.Addr, r.State))
	}
	slices.Sort(out)
	return out, nil
}

// listedHeads runs `troupe members --json` and returns the heads' API
// addresses by id.
func listedHeads(ctx context.Context, t *testing.T, etcd string) map[string]string {
	t.Helper()
	out, err := exec.CommandContext(ctx, troupeBin, "members", "--etcd-endpoints", etcd, "--json").Output()
	require.NoError(t, err)
	var listing struct {
		Heads []struct {
			ID   string `json:"id"`
			Addr string `json:"addr"`
			TTL  int64  `json:"lease_ttl_seconds"`
		} `json:"heads"`
	}
	require.NoError(t, json.Unmarshal(out, &listing), "%s", out)
	heads := map[string]string{}
	for _, h := range listing.Heads {
		assert.Positive(t, h.TTL, "head %s is under a live lease", h.ID)
		heads[h.ID] = h.Addr
	}
	return heads
}

// TestTwoHeads: two heads on one etcd list the same replicas, a sleep
// through one is respected by the other within a bounded wait, and
// `troupe members` shows both heads with their API addresses. SIGTERM to
// one head turns its /readyz unready at once, lets its in-flight stream
// finish, removes its record, and it exits 0.
func TestTwoHeads(t *testing.T) {
	requireBinary(t)
	ctx := testCtx(t)
	etcd := startEtcd(t)
	pipeline := thinkerOnly(t)
	a := startHead(t, etcd, "--pipeline", pipeline, "--head-id", "head-a")
	b := startHead(t, etcd, "--pipeline", pipeline, "--head-id", "head-b", "--shutdown-delay", "1s", "--drain-timeout", "20s")
	w0 := startWorker(t, etcd, "thinker", "--decode-latency", "20ms")
	w1 := startWorker(t, etcd, "thinker", "--decode-latency", "20ms")
	for _, h := range []*head{a, b} {
		h.waitState(ctx, t, "thinker", w0.replica, "attached")
		h.waitState(ctx, t, "thinker", w1.replica, "attached")
	}
	va, err := membershipView(ctx, a)
	require.NoError(t, err)
	vb, err := membershipView(ctx, b)
	require.NoError(t, err)
	require.Equal(t, va, vb, "both heads list the same replicas")
	require.Len(t, va, 2)

	heads := listedHeads(ctx, t, etcd)
	assert.Equal(t, map[string]string{
		"head-a": strings.TrimPrefix(a.base, "http://"),
		"head-b": strings.TrimPrefix(b.base, "http://"),
	}, heads)
	table, err := exec.CommandContext(ctx, troupeBin, "members", "--etcd-endpoints", etcd).CombinedOutput()
	require.NoError(t, err, "%s", table)
	assert.Contains(t, string(table), "HEAD")
	assert.Contains(t, string(table), "head-a")
	assert.Contains(t, string(table), strings.TrimPrefix(b.base, "http://"))
	assert.Contains(t, string(table), w0.addr)

	// A sleep through A is respected by B.
	code, body, err := a.post(ctx, fmt.Sprintf("/v1/replicas/thinker/%d/sleep?level=1", w0.replica))
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, code, body)
	slept := time.Now()
	b.waitState(ctx, t, "thinker", w0.replica, "sleeping")
	t.Logf("head B saw the sleep through head A %s after A answered", time.Since(slept).Round(time.Millisecond))
	a.waitState(ctx, t, "thinker", w0.replica, "sleeping")
	for i := range 4 {
		_, err := b.chat(ctx, seeded(userPrompt(modelName, fmt.Sprint("through b ", i), 4), int64(i)))
		require.NoError(t, err)
	}
	m, err := b.scrape(ctx)
	require.NoError(t, err)
	assert.Zero(t, mustValue(t, m, success, replicaLabels(w0.replica, "finished_reason", "length")), "B sent nothing to the sleeping replica")
	assert.Equal(t, 4.0, mustValue(t, m, success, replicaLabels(w1.replica, "finished_reason", "length")))

	// And a wake through B is seen by A.
	code, body, err = b.post(ctx, fmt.Sprintf("/v1/replicas/thinker/%d/wake_up", w0.replica))
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, code, body)
	a.waitState(ctx, t, "thinker", w0.replica, "attached")

	// SIGTERM to B while a stream runs through it.
	req := seeded(userPrompt(modelName, "a slow answer", 40), 7)
	req.IgnoreEOS = true
	s, err := b.chatStream(ctx, req)
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	more, err := s.next()
	require.NoError(t, err)
	require.True(t, more)
	b.signal(t, syscall.SIGTERM)
	eventuallyWithin(ctx, t, 5*time.Second, "B's /readyz unready", func() (bool, string, error) {
		c := b.status(ctx, "/readyz")
		return c == http.StatusServiceUnavailable, fmt.Sprint("status ", c), nil
	})
	assert.Equal(t, http.StatusOK, a.status(ctx, "/readyz"), "A is not affected")
	for {
		more, err := s.next()
		require.NoError(t, err, "the in-flight stream finishes")
		if !more {
			break
		}
	}
	assert.Equal(t, "length", s.finish)
	require.Equal(t, 0, b.exitCode(t, wait), "a drained head exits 0")
	assert.Equal(t, map[string]string{"head-a": strings.TrimPrefix(a.base, "http://")}, listedHeads(ctx, t, etcd), "B's record is gone")
	va2, err := membershipView(ctx, a)
	require.NoError(t, err)
	assert.Equal(t, va, va2, "the replicas are untouched by a head leaving")
}

// TestDuplicateHeadID: a second head with a live head's --head-id exits 1
// at once, naming the holder.
func TestDuplicateHeadID(t *testing.T) {
	requireBinary(t)
	etcd := startEtcd(t)
	a := startHead(t, etcd, "--pipeline", thinkerOnly(t), "--head-id", "same")
	p := startProc(t, "head 2", nil, "head", "--etcd-endpoints", etcd, "--http", "127.0.0.1:0", "--head-id", "same", "--pipeline", thinkerOnly(t))
	require.Equal(t, 1, p.exitCode(t, wait))
	assert.Contains(t, p.stderr.String(), "membership: head same already registered by "+strings.TrimPrefix(a.base, "http://"))
}
