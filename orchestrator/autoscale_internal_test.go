package orchestrator

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// The published figure rises with the raw one at once and falls only once
// every raw figure of the last window is lower.
func TestHysteresisRisesAtOnceFallsAfterWindow(t *testing.T) {
	h := hysteresis{window: 10 * time.Second}
	t0 := time.Unix(1000, 0)
	assert.Equal(t, 1, h.observe(t0, 1))
	assert.Equal(t, 5, h.observe(t0.Add(time.Second), 5), "a rise is published at once")
	assert.Equal(t, 5, h.observe(t0.Add(2*time.Second), 2), "a fall waits")
	assert.Equal(t, 5, h.observe(t0.Add(10*time.Second), 2), "9s after the 5: still held")
	assert.Equal(t, 2, h.observe(t0.Add(11*time.Second), 2), "10s after the 5: the highest of the window")
	assert.Equal(t, 2, h.observe(t0.Add(12*time.Second), 1))
	assert.Equal(t, 1, h.observe(t0.Add(21*time.Second), 1))
}

// rawDesired is ceil(demand / (target × mean capacity)), at least 1, with
// the default capacity for replicas that report none.
func TestRawDesired(t *testing.T) {
	assert.Equal(t, 1, rawDesired(stageDemand{}, 0.7, 16))
	assert.Equal(t, 3, rawDesired(stageDemand{demand: 20, capacity: 20, replicas: 2}, 0.7, 16), "20 / (0.7×10)")
	assert.Equal(t, 2, rawDesired(stageDemand{demand: 20, capacity: 0, replicas: 0}, 0.7, 16), "20 / (0.7×16)")
	assert.Equal(t, 12, rawDesired(stageDemand{demand: 24, capacity: 2, replicas: 1}, 1, 16))
}
