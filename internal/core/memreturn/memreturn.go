// Package memreturn gives a quiet process's spare heap back to the
// operating system.
//
// The head runs at GOGC=400: its heap grows to five times the live heap
// between collections, and a burst of large requests (16 MiB bodies, a few
// hundred streams nobody reads) raises the heap goal with it. Once the
// burst is over nothing allocates, so no collection comes to lower the goal
// (the runtime forces one only every two minutes) and the scavenger keeps
// what lies under it: the process stays at its peak resident set long
// after its requests have ended. Run watches for that state, a heap grown
// well past the least it held after a give-back while the process
// allocates little (the live heap as of the last collection cannot tell:
// that collection ran during the burst), and then collects and returns
// the spare pages at once (debug.FreeOSMemory), once per quiet spell: the
// resident set falls back to near its idle size within a few seconds of
// the load's end (docs/reliability.md, "What a hostile client costs").
package memreturn

import (
	"context"
	"log/slog"
	"runtime/debug"
	"runtime/metrics"
	"time"
)

// Defaults of Config.
const (
	DefaultInterval  = time.Second
	DefaultMinSpare  = 64 << 20
	DefaultQuietRate = 16 << 20
	DefaultMinGap    = 10 * time.Second
)

// Config says when the heap is given back. The zero value uses the
// defaults.
type Config struct {
	// Interval is how often the heap is looked at.
	Interval time.Duration
	// MinSpare is the least growth worth giving back: of the heap held
	// (Heap.Held) over the least it held right after a give-back (or
	// when Run started).
	MinSpare uint64
	// QuietRate is the allocation rate, in bytes a second over the last
	// interval, under which the process counts as quiet: a busy process
	// collects on its own, and giving back what it is about to reuse would
	// cost it page faults.
	QuietRate uint64
	// MinGap is the least time between two give-backs.
	MinGap time.Duration
	// Logger, when set, logs each give-back at debug level.
	Logger *slog.Logger
}

func (c Config) withDefaults() Config {
	if c.Interval <= 0 {
		c.Interval = DefaultInterval
	}
	if c.MinSpare == 0 {
		c.MinSpare = DefaultMinSpare
	}
	if c.QuietRate == 0 {
		c.QuietRate = DefaultQuietRate
	}
	if c.MinGap <= 0 {
		c.MinGap = DefaultMinGap
	}
	return c
}

// Heap is what Run reads of the heap, in bytes.
type Heap struct {
	// Allocs is every byte ever allocated on the heap.
	Allocs uint64
	// Held is the heap the process holds from the OS: its objects (live
	// or not yet collected), free pages not yet returned and unused span
	// space.
	Held uint64
}

var heapMetrics = []string{
	"/gc/heap/allocs:bytes",
	"/memory/classes/heap/objects:bytes",
	"/memory/classes/heap/free:bytes",
	"/memory/classes/heap/unused:bytes",
}

// ReadHeap reads the heap's figures.
func ReadHeap() Heap {
	samples := make([]metrics.Sample, len(heapMetrics))
	for i, name := range heapMetrics {
		samples[i].Name = name
	}
	metrics.Read(samples)
	v := func(i int) uint64 {
		if samples[i].Value.Kind() == metrics.KindUint64 {
			return samples[i].Value.Uint64()
		}
		return 0
	}
	return Heap{Allocs: v(0), Held: v(1) + v(2) + v(3)}
}

// quiet reports whether the process allocated less than QuietRate
// between prev and h, elapsed apart.
func (c Config) quiet(prev, h Heap, elapsed time.Duration) bool {
	return float64(h.Allocs-prev.Allocs) < float64(c.QuietRate)*elapsed.Seconds()
}

// due reports whether to give back now: the process has been quiet for
// two intervals in a row (quietFor), the heap it holds is at least
// MinSpare over floor, it has not given back since it was last busy
// (armed) and not within MinGap (recent).
func (c Config) due(h Heap, quietFor int, floor uint64, armed, recent bool) bool {
	return quietFor >= 2 && armed && !recent && h.Held >= floor+c.MinSpare
}

// Run gives the spare heap back whenever the process has been quiet for
// two intervals and holds at least MinSpare more than the least it held
// after a give-back: once per quiet spell, at most once every MinGap,
// until ctx ends. It reports how many times it gave back.
func Run(ctx context.Context, cfg Config) int {
	cfg = cfg.withDefaults()
	tick := time.NewTicker(cfg.Interval)
	defer tick.Stop()
	last := ReadHeap()
	lastAt, floor := time.Now(), last.Held
	var gaveAt time.Time
	gave, quietFor, armed := 0, 0, true
	for {
		select {
		case <-ctx.Done():
			return gave
		case <-tick.C:
		}
		now, h := time.Now(), ReadHeap()
		if cfg.quiet(last, h, now.Sub(lastAt)) {
			quietFor++
		} else {
			quietFor, armed = 0, true
		}
		last, lastAt = h, now
		if !cfg.due(h, quietFor, floor, armed, !gaveAt.IsZero() && now.Sub(gaveAt) < cfg.MinGap) {
			continue
		}
		debug.FreeOSMemory()
		gaveAt, last, gave, armed = time.Now(), ReadHeap(), gave+1, false
		floor = min(floor, last.Held)
		if cfg.Logger != nil {
			cfg.Logger.Debug("memreturn: gave the spare heap back", "held_before_bytes", h.Held, "held_after_bytes", last.Held)
		}
	}
}
