package orchestrator

import (
	"context"
	"math"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/troupe-serving/troupe/internal/core/router"
)

// Defaults of AutoscaleConfig.
const (
	DefaultTargetUtilization = 0.7
	DefaultScaleDownCooldown = 5 * time.Minute
	DefaultAutoscaleInterval = time.Second
	// DefaultReplicaCapacity is the capacity of a replica whose engine
	// reports no max_num_seqs (an upstream engine, for example).
	DefaultReplicaCapacity = 16
)

// AutoscaleConfig configures troupe_stage_desired_replicas, the replica
// count the head recommends per stage (docs/deploy.md, "Autoscaling").
// Zero fields take the defaults.
type AutoscaleConfig struct {
	// TargetUtilization is the share of a replica's capacity the
	// recommendation aims to use, in (0, 1]; default 0.7.
	TargetUtilization float64
	// ScaleDownCooldown is how long the raw recommendation must stay below
	// the published one before the published one falls: the published
	// figure is the highest raw figure of the last ScaleDownCooldown, so a
	// rise is published at once and a fall only after the window. Default
	// 5m.
	ScaleDownCooldown time.Duration
	// Interval is how often the recommendation is computed; default 1s.
	Interval time.Duration
	// DefaultCapacity is the capacity of a replica that reports no
	// max_num_seqs; default DefaultReplicaCapacity.
	DefaultCapacity int
}

func (c AutoscaleConfig) withDefaults() AutoscaleConfig {
	if c.TargetUtilization <= 0 || c.TargetUtilization > 1 {
		c.TargetUtilization = DefaultTargetUtilization
	}
	if c.ScaleDownCooldown <= 0 {
		c.ScaleDownCooldown = DefaultScaleDownCooldown
	}
	if c.Interval <= 0 {
		c.Interval = DefaultAutoscaleInterval
	}
	if c.DefaultCapacity <= 0 {
		c.DefaultCapacity = DefaultReplicaCapacity
	}
	return c
}

// stageDemand is what the head measures of one stage at one instant.
type stageDemand struct {
	demand   int64 // requests in flight or queued on the stage's replicas
	capacity int64 // the sum of the counted replicas' capacities
	replicas int   // replicas counted
}

// rawDesired is the recommendation of one instant, before hysteresis:
// ceil(demand / (target × mean capacity)), at least 1.
func rawDesired(d stageDemand, target float64, defaultCapacity int) int {
	per := float64(defaultCapacity)
	if d.replicas > 0 && d.capacity > 0 {
		per = float64(d.capacity) / float64(d.replicas)
	}
	n := int(math.Ceil(float64(d.demand) / (target * per)))
	return max(n, 1)
}

// sample is one raw recommendation and when it was made.
type sample struct {
	at time.Time
	n  int
}

// hysteresis publishes the highest raw recommendation of the last window:
// a rise at once, a fall only once every sample of the window is lower.
type hysteresis struct {
	window  time.Duration
	samples []sample // in time order, only those within window
}

// observe adds the raw recommendation n made at now and returns the figure
// to publish.
func (h *hysteresis) observe(now time.Time, n int) int {
	cut := 0
	for cut < len(h.samples) && now.Sub(h.samples[cut].at) >= h.window {
		cut++
	}
	h.samples = append(h.samples[cut:], sample{at: now, n: n})
	out := 0
	for _, s := range h.samples {
		out = max(out, s.n)
	}
	return out
}

// measureDemand sums, per stage, the demand on the replicas the head
// routes to (neither detached nor refused) and their capacities
// (max_num_seqs as each one's Health reported, defaultCapacity when none).
// A replica's demand is its engine's latest report of running + waiting
// requests while the head has an attempt on it and the report is younger
// than maxAge (the report rides on that attempt's chunks, so it is
// current, and the engine counts every head's requests); otherwise the
// head's own attempts in flight on it. The report comes first because an
// attempt on a streamed stage is open for the whole request, most of it
// waiting for input: every stage of a pipeline has the same attempts in
// flight, and only the engine knows which of them it is working on or
// queueing. A report from before the replica went idle is not counted.
func measureDemand(stages int, snap *router.Snapshot, view *recordView, now time.Time, maxAge time.Duration, defaultCapacity int) []stageDemand {
	out := make([]stageDemand, stages)
	for t := range view.All() {
		if t.detached || !t.routed || t.key.Stage < 0 || t.key.Stage >= stages {
			continue
		}
		rep, ok := snap.Lookup(t.key)
		if !ok {
			continue
		}
		d := rep.InFlight()
		if at := rep.LoadAt(); d > 0 && !at.IsZero() && now.Sub(at) <= maxAge {
			d = rep.Load()
		}
		c := int64(t.capacity)
		if c <= 0 {
			c = int64(defaultCapacity)
		}
		s := &out[t.key.Stage]
		s.demand += d
		s.capacity += c
		s.replicas++
	}
	return out
}

// newDesiredReplicas makes troupe_stage_desired_replicas with a child per
// stage, at 1 until the first computation.
func (f *fleet) newDesiredReplicas() *prometheus.GaugeVec {
	v := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "troupe_stage_desired_replicas",
		Help: "Replicas the head recommends for a stage: ceil(demand / (target utilisation × mean replica capacity)), at least 1, where demand is the requests running or waiting on the stage's replicas; the highest figure of the last scale-down cooldown, so it rises at once and falls only after the cooldown.",
	}, []string{"stage", "stage_name"})
	f.m.desired = make([]prometheus.Gauge, len(f.cfg.Pipeline.Stages))
	for i, st := range f.cfg.Pipeline.Stages {
		f.m.desired[i] = v.WithLabelValues(strconv.Itoa(i), st.Name)
		f.m.desired[i].Set(1)
	}
	return v
}

// runAutoscale computes troupe_stage_desired_replicas every
// Autoscale.Interval until ctx ends. Run owns it; it reads only the
// published view and router snapshot, and is the only writer of the
// gauges and of its hysteresis state.
func (f *fleet) runAutoscale(ctx context.Context) {
	cfg := f.cfg.Autoscale
	maxAge := f.cfg.SignalMaxAge
	if maxAge <= 0 {
		maxAge = router.DefaultSignalMaxAge
	}
	hyst := make([]hysteresis, len(f.m.desired))
	for i := range hyst {
		hyst[i].window = cfg.ScaleDownCooldown
	}
	tick := time.NewTicker(cfg.Interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-tick.C:
			demand := measureDemand(len(f.m.desired), f.router.Snapshot(), f.view.Load(), now, maxAge, cfg.DefaultCapacity)
			for i, d := range demand {
				n := hyst[i].observe(now, rawDesired(d, cfg.TargetUtilization, cfg.DefaultCapacity))
				f.m.desired[i].Set(float64(n))
			}
		}
	}
}
