package main

import (
	"os"
	"path/filepath"
	"testing"

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
