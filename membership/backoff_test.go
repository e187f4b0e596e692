package membership_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/troupe-serving/troupe/membership"
)

// TestBackoffSchedule holds the retry schedule: steps double from the
// initial delay up to the cap, each delay in [step/2, step].
func TestBackoffSchedule(t *testing.T) {
	step := 100 * time.Millisecond
	seen := map[time.Duration]bool{}
	for i, d := range membership.NextBackoffs(100*time.Millisecond, time.Second, 200) {
		assert.GreaterOrEqual(t, d, step/2, "delay %d", i)
		assert.LessOrEqual(t, d, step, "delay %d", i)
		step = min(2*step, time.Second)
		seen[d] = true
	}
	assert.Greater(t, len(seen), 100, "delays are jittered")
}
