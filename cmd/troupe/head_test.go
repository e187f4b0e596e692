package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/orchestrator"
)

func TestAPIAddr(t *testing.T) {
	host, err := os.Hostname()
	require.NoError(t, err)
	bound := func(s string) net.Addr {
		a, err := net.ResolveTCPAddr("tcp", s)
		require.NoError(t, err)
		return a
	}
	for _, tc := range []struct{ bound, advertise, want, err string }{
		{bound: "127.0.0.1:8000", want: "127.0.0.1:8000"},
		{bound: "0.0.0.0:8000", want: net.JoinHostPort(host, "8000")},
		{bound: "[::]:8001", want: net.JoinHostPort(host, "8001")},
		{bound: "0.0.0.0:8000", advertise: "head-a", want: "head-a:8000"},
		{bound: "0.0.0.0:8000", advertise: "head-a:0", want: "head-a:8000"},
		{bound: "0.0.0.0:8000", advertise: "lb.example:443", want: "lb.example:443"},
		{bound: "0.0.0.0:8000", advertise: "[fd00::1]", want: "[fd00::1]:8000"},
		{bound: "0.0.0.0:8000", advertise: "http://x/", err: `invalid --advertise "http://x/"`},
	} {
		got, err := apiAddr(bound(tc.bound), tc.advertise)
		if tc.err != "" {
			assert.ErrorContains(t, err, tc.err, "%+v", tc)
			continue
		}
		require.NoError(t, err, "%+v", tc)
		assert.Equal(t, tc.want, got, "%+v", tc)
	}
}

func TestDefaultHeadID(t *testing.T) {
	a, b := defaultHeadID(), defaultHeadID()
	require.NoError(t, membership.Head{ID: a, Addr: "h:1"}.Validate(), "usable as a key segment")
	assert.Regexp(t, regexp.MustCompile(`-\d+-[0-9a-f]{4}$`), a)
	host, _ := os.Hostname()
	assert.True(t, strings.HasPrefix(a, host), "%q starts with the hostname %q", a, host)
	// Two heads started alike rarely collide (1 in 65536 per pair).
	if a == b {
		b = defaultHeadID()
	}
	assert.NotEqual(t, a, b)
}

func TestHeadsTable(t *testing.T) {
	now := time.Date(2025, 1, 1, 0, 1, 0, 0, time.UTC)
	var out bytes.Buffer
	require.NoError(t, writeHeadsTable(&out, nil, now))
	assert.Equal(t, "\n(no heads)\n", out.String())

	out.Reset()
	require.NoError(t, writeHeadsTable(&out, []membership.Listed[membership.Head]{
		{Key: "/troupe/default/heads/a", Record: membership.Head{ID: "a", Addr: "10.0.0.1:8000", Version: "v1", StartedAt: now.Add(-time.Minute)}, TTL: 10 * time.Second, TTLLeft: 9 * time.Second},
		{Key: "/troupe/default/heads/b", Record: membership.Head{ID: "b", Addr: "10.0.0.2:8000"}, TTL: -1, TTLLeft: -1},
		{Key: "/troupe/default/heads/x", Invalid: errors.New("bad")},
	}, now))
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	require.Len(t, lines, 4, out.String())
	// LEASE TTL is the granted TTL, EXPIRES IN the time it has left.
	assert.Regexp(t, `^HEAD +API ADDR +VERSION +LEASE TTL +EXPIRES IN +AGE$`, lines[0])
	assert.Regexp(t, `^a +10\.0\.0\.1:8000 +v1 +10s +9s +1m0s$`, lines[1])
	assert.Regexp(t, `^b +10\.0\.0\.2:8000 +- +- +- +-$`, lines[2])
	assert.Equal(t, "invalid record at /troupe/default/heads/x: bad", lines[3])
}

func TestHeadShutdownFlags(t *testing.T) {
	t.Setenv("TROUPE_SHUTDOWN_DELAY", "3s")
	fs := newFlagSet("head")
	hf := addHeadFlags(fs)
	require.NoError(t, parseFlags(fs, []string{"--drain-timeout", "45s", "--head-id", "head-a"}))
	assert.Equal(t, 3*time.Second, hf.shutdownDelay)
	assert.Equal(t, 45*time.Second, hf.drainTimeout)
	assert.Equal(t, "head-a", hf.headID)
	assert.Equal(t, membership.DefaultTTL, hf.leaseTTL)
}

// TestHeadAutoscaleFlags: the --autoscale-* flags (or their environment
// variables) become the orchestrator's AutoscaleConfig, their defaults are
// the orchestrator's, and a value out of range stops `troupe head` before
// it dials etcd (the endpoint below is never listened on) with an error
// naming the flag.
func TestHeadAutoscaleFlags(t *testing.T) {
	fs := newFlagSet("head")
	hf := addHeadFlags(fs)
	require.NoError(t, parseFlags(fs, nil))
	cfg, err := hf.autoscale()
	require.NoError(t, err)
	assert.Equal(t, orchestrator.AutoscaleConfig{
		TargetUtilization: orchestrator.DefaultTargetUtilization,
		ScaleDownCooldown: orchestrator.DefaultScaleDownCooldown,
		Interval:          orchestrator.DefaultAutoscaleInterval,
	}, cfg)

	t.Setenv("TROUPE_AUTOSCALE_COOLDOWN", "90s")
	fs = newFlagSet("head")
	hf = addHeadFlags(fs)
	require.NoError(t, parseFlags(fs, []string{"--autoscale-target-utilization", "0.5", "--autoscale-interval", "250ms"}))
	cfg, err = hf.autoscale()
	require.NoError(t, err)
	assert.Equal(t, orchestrator.AutoscaleConfig{TargetUtilization: 0.5, ScaleDownCooldown: 90 * time.Second, Interval: 250 * time.Millisecond}, cfg)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, tc := range []struct{ args, want string }{
		{"--autoscale-target-utilization=0", "--autoscale-target-utilization 0: want a fraction in (0, 1]"},
		{"--autoscale-target-utilization=1.5", "--autoscale-target-utilization 1.5: want a fraction in (0, 1]"},
		{"--autoscale-target-utilization=NaN", "--autoscale-target-utilization NaN"},
		{"--autoscale-cooldown=0s", "--autoscale-cooldown 0s: want a positive duration"},
		{"--autoscale-interval=-1s", "--autoscale-interval -1s: want a positive duration"},
	} {
		err := runHead(ctx, []string{"--etcd-endpoints", "http://127.0.0.1:1", tc.args}, io.Discard)
		assert.ErrorContains(t, err, tc.want, tc.args)
	}
}

// TestHeadKeys: the API key comes from a file, the environment or (with a
// warning) argv; the admin key from a file or the environment only, and
// must differ from the API key.
func TestHeadKeys(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := dir + "/" + name
		require.NoError(t, os.WriteFile(p, []byte(content), 0o600))
		return p
	}
	apiFile, adminFile, empty := write("api", "infer-key\n"), write("admin", " admin-key \n"), write("empty", "\n")
	keys := func(args ...string) (string, string, string, error) {
		fs := newFlagSet("head")
		hf := addHeadFlags(fs)
		require.NoError(t, parseFlags(fs, args))
		hf.noteArgvSecrets(fs)
		var logs bytes.Buffer
		api, admin, err := hf.keys(slog.New(slog.NewTextHandler(&logs, nil)))
		return api, admin, logs.String(), err
	}

	api, admin, logs, err := keys("--api-key-file", apiFile, "--admin-api-key-file", adminFile)
	require.NoError(t, err)
	assert.Equal(t, []string{"infer-key", "admin-key"}, []string{api, admin})
	assert.Empty(t, logs)

	api, _, logs, err = keys("--api-key", "on-argv")
	require.NoError(t, err)
	assert.Equal(t, "on-argv", api)
	assert.Contains(t, logs, "visible to every user")

	t.Setenv("TROUPE_API_KEY", "from-env")
	t.Setenv("TROUPE_ADMIN_API_KEY", "admin-env")
	api, admin, logs, err = keys()
	require.NoError(t, err)
	assert.Equal(t, []string{"from-env", "admin-env"}, []string{api, admin})
	assert.Empty(t, logs, "the environment is not argv")

	_, _, _, err = keys("--api-key", "x", "--api-key-file", apiFile)
	assert.ErrorContains(t, err, "both given")
	_, _, _, err = keys("--admin-api-key-file", empty)
	assert.ErrorContains(t, err, "is empty")
	t.Setenv("TROUPE_ADMIN_API_KEY", "from-env")
	_, _, _, err = keys()
	assert.ErrorContains(t, err, "must differ")
}
