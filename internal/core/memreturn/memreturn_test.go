package memreturn

import (
	"context"
	"runtime"
	"runtime/debug"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var sink [][]byte

// TestGivesBackAfterABurst: a burst of large allocations at GOGC=400
// leaves a heap far larger than its live part once it is garbage; Run
// gives it back within a few intervals of the burst's end.
func TestGivesBackAfterABurst(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(400))
	runtime.GC()
	debug.FreeOSMemory()
	base := ReadHeap()

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	done := make(chan int, 1)
	go func() {
		done <- Run(ctx, Config{Interval: 20 * time.Millisecond, MinSpare: 32 << 20, QuietRate: 32 << 20, MinGap: time.Millisecond})
	}()

	// The burst: 128 MiB kept, then dropped.
	for range 128 {
		sink = append(sink, make([]byte, 1<<20))
	}
	runtime.GC()
	sink = nil
	burst := ReadHeap()
	require.Greater(t, burst.Held, base.Held+100<<20, "the burst holds its 128 MiB")

	require.Eventually(t, func() bool { return ReadHeap().Held < base.Held+16<<20 }, 30*time.Second, 10*time.Millisecond,
		"the spare heap is given back once the process is quiet")
	cancel()
	assert.Positive(t, <-done)
}

// TestDue: the heap is given back only after two quiet intervals, when
// it holds MinSpare over the floor, once per quiet spell and not within
// MinGap; a process allocating QuietRate or more is not quiet.
func TestDue(t *testing.T) {
	c := Config{MinSpare: 100, QuietRate: 10}.withDefaults()
	for _, tc := range []struct {
		name          string
		held          uint64
		quietFor      int
		armed, recent bool
		want          bool
	}{
		{"quiet and grown", 700, 2, true, false, true},
		{"quiet for one interval only", 700, 1, true, false, false},
		{"grown by less than MinSpare", 599, 2, true, false, false},
		{"grown by MinSpare exactly", 600, 2, true, false, true},
		{"gave back in this quiet spell", 700, 5, false, false, false},
		{"gave back within MinGap", 700, 2, true, true, false},
	} {
		assert.Equal(t, tc.want, c.due(Heap{Held: tc.held}, tc.quietFor, 500, tc.armed, tc.recent), tc.name)
	}
	prev := Heap{Allocs: 1000}
	assert.True(t, c.quiet(prev, Heap{Allocs: 1005}, time.Second))
	assert.False(t, c.quiet(prev, Heap{Allocs: 1015}, time.Second), "15 B/s is busy at 10 B/s")
	assert.True(t, c.quiet(prev, Heap{Allocs: 1015}, 2*time.Second), "15 B in 2 s is quiet")
}
