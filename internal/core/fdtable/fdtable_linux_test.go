package fdtable

import (
	"bufio"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fdSize is the size of this process's descriptor table, as the kernel
// reports it.
func fdSize(t *testing.T) int {
	t.Helper()
	f, err := os.Open("/proc/self/status")
	require.NoError(t, err)
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "FDSize:"); ok {
			n, err := strconv.Atoi(strings.TrimSpace(v))
			require.NoError(t, err)
			return n
		}
	}
	require.NoError(t, sc.Err())
	t.Fatal("no FDSize in /proc/self/status")
	return 0
}

func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(ents)
}

// TestReserveGrowsTheTable: after Reserve the table holds n descriptors
// at once; every descriptor open before is still open and none is left
// open by the call.
func TestReserveGrowsTheTable(t *testing.T) {
	var lim syscall.Rlimit
	require.NoError(t, syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim))
	n := max(8192, 2*fdSize(t)) // more than the table holds now
	if lim.Cur < uint64(n) {
		t.Skipf("RLIMIT_NOFILE %d is below %d", lim.Cur, n)
	}
	f, err := os.Open(os.DevNull)
	require.NoError(t, err)
	defer f.Close()
	before := openFDs(t)

	require.NoError(t, Reserve(n))
	assert.GreaterOrEqual(t, fdSize(t), n)
	assert.Equal(t, before, openFDs(t), "Reserve leaves no descriptor open")
	_, err = f.Stat()
	assert.NoError(t, err, "a descriptor open before is untouched")
}

// TestReserveStopsAtTheLimit: asking for more than RLIMIT_NOFILE reserves
// up to the limit instead of failing.
func TestReserveStopsAtTheLimit(t *testing.T) {
	var lim syscall.Rlimit
	require.NoError(t, syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim))
	if lim.Cur > 1<<20 {
		t.Skipf("RLIMIT_NOFILE %d: reserving up to it would take a large table", lim.Cur)
	}
	require.NoError(t, Reserve(int(lim.Cur)+1000))
	assert.GreaterOrEqual(t, fdSize(t), int(lim.Cur))
}
