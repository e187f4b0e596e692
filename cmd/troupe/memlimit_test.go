package main

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"runtime/debug"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestCgroupMemoryLimit(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte(body), 0o600))
		return p
	}
	v2Max := write("v2-max", "max\n")
	v2 := write("v2", "4294967296\n")
	v1Unlimited := write("v1-unlimited", "9223372036854771712\n")
	v1 := write("v1", "268435456\n")
	missing := filepath.Join(dir, "missing")

	require.Equal(t, int64(4<<30), cgroupMemoryLimit([]string{v2, v1}), "v2 first")
	require.Equal(t, int64(256<<20), cgroupMemoryLimit([]string{v2Max, v1}), "v2 says max: v1's")
	require.Zero(t, cgroupMemoryLimit([]string{v2Max, v1Unlimited}), "no limit anywhere")
	require.Zero(t, cgroupMemoryLimit([]string{missing, write("junk", "lots")}))
}

func TestHeadSoftLimit(t *testing.T) {
	limit, source := headSoftLimit(0)
	require.Equal(t, int64(headMemoryLimit), limit)
	require.Equal(t, "default", source)

	limit, source = headSoftLimit(4 << 30)
	require.Equal(t, int64(3<<30), limit, "three quarters of a 4 GiB container")
	require.Equal(t, "cgroup", source)

	limit, _ = headSoftLimit(256 << 20)
	require.Equal(t, int64(192<<20), limit, "below the default in a small container")
}

// TestFollowFleetLimit: on the default soft limit, the head's limit follows
// the records it knows, up and down, so a head of 10,000 replicas (a live
// heap of ~300 MiB, an RSS of ~550 MiB) is not held to 512 MiB.
func TestFollowFleetLimit(t *testing.T) {
	prev := debug.SetMemoryLimit(-1)
	defer debug.SetMemoryLimit(prev)
	require.Greater(t, fleetLimit(10_000), int64(1500<<20), "room for 10,000 replicas' ~550 MiB of RSS, and garbage")
	require.Equal(t, int64(headMemoryLimit), fleetLimit(0))

	var known atomic.Int64
	known.Store(10_000)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		followFleetLimit(ctx, func() int { return int(known.Load()) }, slog.New(slog.DiscardHandler))
	}()
	defer func() { cancel(); <-done }()

	waitLimit := func(want int64) {
		t.Helper()
		wctx, wcancel := context.WithTimeout(ctx, 10*fleetLimitInterval)
		defer wcancel()
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for debug.SetMemoryLimit(-1) != want {
			select {
			case <-wctx.Done():
				t.Fatalf("soft limit %d, want %d", debug.SetMemoryLimit(-1), want)
			case <-tick.C:
			}
		}
	}
	waitLimit(fleetLimit(10_000))
	known.Store(100)
	waitLimit(fleetLimit(100))
}
