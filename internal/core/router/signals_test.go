package router

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// frozenShare runs 1200 picks of p over 4 replicas, 20 in flight at a
// time, where replica 0's engine stopped reporting a minute ago (its last
// report said idle) and the others report what they run after every pick.
// It returns replica 0's share of the picks.
func frozenShare(p Policy) float64 {
	c := replicas(4)
	c[0].SetLoadAt(0, time.Now().Add(-time.Minute))
	var running []*Replica
	served := map[*Replica]int{}
	for i := range 1200 {
		text := strings.Repeat(fmt.Sprintf("prompt %d ", i%7), 40)
		d := p.Pick(&Request{Text: text}, c)
		d.Replica.Acquire()
		running = append(running, d.Replica)
		if len(running) > 20 {
			running[0].Release()
			running = running[1:]
		}
		served[d.Replica]++
		for _, r := range c[1:] {
			r.SetLoad(r.InFlight())
		}
	}
	return float64(served[c[0]]) / 1200
}

// A replica whose reports stopped is not ranked best on its last (idle)
// report: traffic does not pile onto it. With an age bound of an hour the
// same frozen report draws most of the traffic, which is what the bound
// prevents.
func TestStaleReportsDoNotAttractTraffic(t *testing.T) {
	for _, name := range []string{PolicyLeastLoaded, PolicyPowerOfTwo, PolicyPrefixAware} {
		t.Run(name, func(t *testing.T) {
			p, err := NewPolicy(name, PolicyOptions{})
			if err != nil {
				t.Fatal(err)
			}
			assert.LessOrEqual(t, frozenShare(p), 0.25, "the frozen replica takes no more than its share")

			blind, err := NewPolicy(name, PolicyOptions{SignalMaxAge: time.Hour})
			if err != nil {
				t.Fatal(err)
			}
			if name == PolicyPrefixAware {
				// Its score adds to a report the requests this head
				// started since (scoreSinceReport): all of them on a
				// report frozen before the first, so without the bound
				// this head still sees its own load there; the bound is
				// for the load it does not see (other heads').
				assert.LessOrEqual(t, frozenShare(blind), 0.3, "this head's own requests since the report count")
				return
			}
			assert.Greater(t, frozenShare(blind), 0.3, "without the bound the stale report attracts traffic")
		})
	}
}

func TestScorerCountsAStaleReportAsBusy(t *testing.T) {
	c := replicas(3)
	c[0].SetLoad(4)
	c[1].SetLoadAt(0, time.Now().Add(-time.Minute))
	sc := newScorer(c, time.Second)
	assert.True(t, sc.fresh(c[0]))
	assert.False(t, sc.fresh(c[1]))
	assert.True(t, sc.fresh(c[2]), "a replica that never reported has no report to age")
	assert.Equal(t, int64(5), sc.score(c[1]), "busiest fresh report plus one")
	c[1].Acquire()
	assert.Equal(t, int64(6), sc.score(c[1]), "plus what this head has in flight on it")
	c[1].Release()
	assert.Same(t, c[2], LeastLoaded{MaxAge: time.Second}.Pick(nil, c).Replica)
}

// prefix_aware's score adds to a fresh report only this head's requests
// started since it (still in flight): the report holds the earlier ones,
// which the plain score counts twice.
func TestScoreSinceReport(t *testing.T) {
	c := replicas(1)
	r := c[0]
	r.Acquire()
	r.Acquire()
	r.SetLoad(2) // the engine reports both
	sc := newScorer(c, time.Second)
	assert.Equal(t, int64(4), sc.score(r), "report plus everything in flight")
	assert.Equal(t, int64(2), sc.scoreSinceReport(r), "the report already holds them")
	r.Acquire()
	assert.Equal(t, int64(3), sc.scoreSinceReport(r), "plus the one started since")
	r.Release()
	r.Release()
	r.Release()
	assert.Equal(t, int64(2), sc.scoreSinceReport(r), "never more than in flight")

	// A report measured 2 s before it arrived (a scraped engine's) may
	// miss requests this head sent meanwhile: all in flight count.
	r.Acquire()
	r.SetLoadAt(2, time.Now().Add(-2*time.Second))
	sc = newScorer(c, 10*time.Second)
	assert.Equal(t, int64(3), sc.scoreSinceReport(r), "report plus everything in flight")
}

// A report dates the load by the engine's measurement (LoadAt) and the
// replica's sign of life by the report's arrival (HeardAt): an old
// measurement relayed now is stale for routing, but its worker answered.
func TestLoadAgeAndArrival(t *testing.T) {
	r := replicas(1)[0]
	measured := time.Now().Add(-time.Minute)
	r.SetLoadAt(3, measured)
	assert.Equal(t, measured.UnixNano(), r.LoadAt().UnixNano())
	assert.WithinDuration(t, time.Now(), r.HeardAt(), 5*time.Second)
	assert.False(t, newScorer([]*Replica{r}, time.Second).fresh(r))
}
