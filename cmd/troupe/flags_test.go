package main

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestFlagPrecedence: a flag beats TROUPE_<FLAG>, which beats the default.
func TestFlagPrecedence(t *testing.T) {
	t.Setenv("TROUPE_HTTP", "127.0.0.1:9000")
	t.Setenv("TROUPE_MAX_BODY_BYTES", "1MiB")
	t.Setenv("TROUPE_LOG_STATS", "false")

	fs := newFlagSet("head")
	hf := addHeadFlags(fs)
	require.NoError(t, parseFlags(fs, []string{"--http", "127.0.0.1:7000"}))
	assert.Equal(t, "127.0.0.1:7000", hf.http, "flag wins over env")
	assert.Equal(t, byteSize(1<<20), hf.maxBody, "env wins over default")
	assert.False(t, hf.logStats)
	assert.Equal(t, "round_robin", hf.policy, "default when neither is set")
}

func TestFlagEnvErrorsAreClear(t *testing.T) {
	t.Setenv("TROUPE_RECONCILE_INTERVAL", "soon")
	fs := newFlagSet("head")
	addHeadFlags(fs)
	err := parseFlags(fs, nil)
	require.Error(t, err)
	assert.Contains(t, err.Error(), `invalid TROUPE_RECONCILE_INTERVAL="soon"`)
}

func TestEnvName(t *testing.T) {
	assert.Equal(t, "TROUPE_ETCD_ENDPOINTS", envName("etcd-endpoints"))
	assert.Equal(t, "TROUPE_API_KEY", envName("api-key"))
}

func TestUnknownCommand(t *testing.T) {
	assert.Equal(t, 2, run([]string{"frobnicate"}, io.Discard, io.Discard))
	assert.Equal(t, 2, run(nil, io.Discard, io.Discard))
	assert.Equal(t, 0, run([]string{"version"}, io.Discard, io.Discard))
}

// TestHeadRefusesBadRoutingBeforeEtcd: a policy typo, in the flag or the
// pipeline file, fails at once with a clear error (no etcd is contacted:
// the endpoint below is never listened on).
func TestHeadRefusesBadRoutingBeforeEtcd(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	etcd := []string{"--etcd-endpoints", "http://127.0.0.1:1"}
	err := runHead(ctx, append(etcd, "--policy", "fastest"), io.Discard)
	require.ErrorContains(t, err, `router: unknown policy "fastest"`)

	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte(body), 0o600))
		return p
	}
	bad := write("bad.yaml", "model: m\nstages:\n  - name: thinker\n    policy: cache_aware\n")
	err = runHead(ctx, append(etcd, "--pipeline", bad), io.Discard)
	require.ErrorContains(t, err, `stage 0 (thinker): router: unknown policy "cache_aware"`)

	// prefix_source needs prefix_aware, from the file or from --policy.
	src := write("src.yaml", "model: m\nstages:\n  - name: thinker\n    prefix_source: head\n")
	err = runHead(ctx, append(etcd, "--pipeline", src, "--policy", "least_loaded"), io.Discard)
	require.ErrorContains(t, err, "prefix_source applies to policy prefix_aware only")
}

// TestEtcdPasswordOnArgvWarns: etcd's password on the command line (alone
// or in --etcd-user user:password) draws a warning; from the environment
// it does not.
func TestEtcdPasswordOnArgvWarns(t *testing.T) {
	warns := func(args ...string) string {
		fs := newFlagSet("worker")
		ef := addEtcdFlags(fs)
		require.NoError(t, parseFlags(fs, args))
		var logs bytes.Buffer
		ef.warnArgvPassword(fs, slog.New(slog.NewTextHandler(&logs, nil)))
		return logs.String()
	}
	assert.Contains(t, warns("--etcd-user", "troupe", "--etcd-password", "secret"), "--etcd-password on the command line")
	assert.Contains(t, warns("--etcd-user", "troupe:secret"), "--etcd-user on the command line")
	assert.Empty(t, warns("--etcd-user", "troupe"))
	t.Setenv("TROUPE_ETCD_PASSWORD", "secret")
	assert.Empty(t, warns("--etcd-user", "troupe"), "the environment is not argv")
}
