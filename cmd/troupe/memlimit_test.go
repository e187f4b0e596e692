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

// TestFollowLimit: on the default soft limit, the head's limit grows with
// the records it knows, and stays at least a quarter above its live
// memory, up and down; small changes are not applied.
func TestFollowLimit(t *testing.T) {
	prev := debug.SetMemoryLimit(-1)
	defer debug.SetMemoryLimit(prev)
	require.Equal(t, int64(headMemoryLimit), softLimit(0, 0))
	atTenThousand := int64(512<<20 + 10_000*32<<10) // 824.5 MiB
	require.Equal(t, atTenThousand, softLimit(10_000, 560<<20), "10,000 replicas: ~1.5× their live memory")
	require.Equal(t, int64(1500<<20), softLimit(20_000, 1200<<20), "past the allowance, a quarter above the live memory")
	require.Positive(t, liveMemory(), "this process has a live heap and stacks")

	var known atomic.Int64
	var live atomic.Uint64
	known.Store(10_000)
	live.Store(560 << 20)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		followLimit(ctx, func() int { return int(known.Load()) }, live.Load, slog.New(slog.DiscardHandler))
	}()
	defer func() { cancel(); <-done }()

	waitLimit := func(want int64) {
		t.Helper()
		wctx, wcancel := context.WithTimeout(ctx, 10*limitInterval)
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
	waitLimit(atTenThousand)
	live.Store(2 << 30)
	waitLimit(2560 << 20)
	known.Store(100)
	live.Store(100 << 20)
	waitLimit(softLimit(100, 0))
}
