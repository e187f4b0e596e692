package orchestrator

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/tokenizers"
)

// GatheredMetric finds the child of family whose labels include labels,
// without creating it (as WithLabelValues would): nil when no such child
// exists. Exported for the external test package too.
func GatheredMetric(t *testing.T, g prometheus.Gatherer, family string, labels map[string]string) *dto.Metric {
	t.Helper()
	mfs, err := g.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != family {
			continue
		}
	metrics:
		for _, m := range mf.GetMetric() {
			n := 0
			for _, lp := range m.GetLabel() {
				if v, ok := labels[lp.GetName()]; ok {
					if v != lp.GetValue() {
						continue metrics
					}
					n++
				}
			}
			if n == len(labels) {
				return m
			}
		}
	}
	return nil
}

// GatheredValue reads the child GatheredMetric finds: ok is false when
// there is none. Counters, gauges and histograms (sample count) are read.
func GatheredValue(t *testing.T, g prometheus.Gatherer, family string, labels map[string]string) (float64, bool) {
	t.Helper()
	m := GatheredMetric(t, g, family, labels)
	switch {
	case m == nil:
		return 0, false
	case m.Counter != nil:
		return m.GetCounter().GetValue(), true
	case m.Gauge != nil:
		return m.GetGauge().GetValue(), true
	case m.Histogram != nil:
		return float64(m.GetHistogram().GetSampleCount()), true
	}
	return 0, true
}

// JoinTiming is when the steps of a replica's latest join happened, as
// the head stamped them (see joinTimes); zero fields were not reached.
type JoinTiming struct {
	Event, Answered, Attach, Bound, Routed time.Time
}

// JoinTimes returns the published join times of the replica under key.
func JoinTimes(h *Head, stage int, replica uint32) (JoinTiming, bool) {
	t, ok := h.fleet.lookup(router.Key{Stage: stage, Replica: replica})
	if !ok {
		return JoinTiming{}, false
	}
	jt := t.times
	return JoinTiming{Event: jt.event, Answered: jt.answered, Attach: jt.attach, Bound: jt.bound, Routed: jt.routed}, true
}

// Changed returns a channel that is closed by the head's next publish of
// its view (a join, an attach, a leave...).
func Changed(h *Head) <-chan struct{} { return h.fleet.changed() }

// PrefixHeld returns, by replica id, how many leading blocks of prompt
// (in the sim's scheme: its tokenizer, 16-token blocks) h's prefix index
// says each routed replica of stage holds. stage's policy is prefix_aware.
func PrefixHeld(h *Head, stage int, prompt string) map[uint32]int {
	p := h.router.Policy(stage).(*router.PrefixAware)
	hashes := stagepb.BlockHashes(tokenizers.Sim(prompt), 16)
	var keys []router.Key
	for rep := range h.router.Snapshot().Stage(stage).All() {
		keys = append(keys, rep.Key)
	}
	out := map[uint32]int{}
	for i, n := range p.Index().Match(hashes, keys) {
		out[keys[i].Replica] = n
	}
	return out
}
