package main

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"runtime/debug"
	"runtime/metrics"
	"strconv"
	"time"
)

// headGCPercent is the head's GOGC unless the environment sets one. The
// head's live heap is small (snapshots, series, in-flight requests) and its
// garbage is per request and per token, so collecting at 4× the live heap
// instead of 2× halves the GC work for a few more MB (docs/architecture.md,
// "The per-request hot path").
const headGCPercent = 400

// headMemoryLimit is the head's soft memory limit (GOMEMLIMIT) when the
// environment sets none and the head's cgroup has no memory limit. At
// headGCPercent the heap grows to 5× the live heap between collections:
// cheap while the live heap is small, not when many streams in flight hold
// memory while their clients do not read (windows between the stages, input
// logs kept for a retry). Near the limit the collector runs more often, so
// the head's memory follows its live heap, not 5× it (docs/reliability.md,
// "What a hostile client costs"). It is soft: a live heap above it is
// not refused, only collected harder (the runtime caps that at half the
// CPU).
const headMemoryLimit = 512 << 20

// cgroupMemoryShare is the part of a cgroup's memory limit the head takes
// as its soft limit: the rest is for what the Go heap does not count
// (stacks, the runtime's own memory, page cache charged to the cgroup), so
// the collector works harder before the kernel's OOM killer acts.
const cgroupMemoryShare = 0.75

// cgroupMemoryFiles are where a container sees its own memory limit:
// cgroup v2's memory.max, then cgroup v1's memory.limit_in_bytes.
var cgroupMemoryFiles = []string{
	"/sys/fs/cgroup/memory.max",
	"/sys/fs/cgroup/memory/memory.limit_in_bytes",
}

// headLimitPerReplica is what the default soft limit grows by for each
// replica record the head knows: about 60% of a replica's live memory on
// the head (its connection, gRPC's goroutines and stacks, its record), so a
// head of 10,000 has about 1.5× its live memory from the moment it lists
// them. A larger allowance buys a cheaper restart with more RSS a replica
// (docs/benchmarks.md, "The head's memory per replica").
const headLimitPerReplica = 32 << 10

// liveHeadroom is the least the default soft limit lies above the head's
// live memory (live heap and goroutine stacks as of the last collection):
// past ~20,000 replicas the per-replica allowance falls behind the live
// memory, and a limit at the live memory collects without pause.
const liveHeadroom = 1.25

// softLimit is the default soft limit of a head that knows n replica
// records and has live bytes of live memory.
func softLimit(n int, live uint64) int64 {
	return max(headMemoryLimit+int64(n)*headLimitPerReplica, int64(float64(live)*liveHeadroom))
}

// limitInterval is how often a head on the default soft limit reads its
// fleet's size and its live memory (followLimit).
const limitInterval = time.Second

// liveMemory is the live heap as of the last collection plus the stacks
// in use: what the collector cannot free.
func liveMemory() uint64 {
	samples := []metrics.Sample{{Name: "/gc/heap/live:bytes"}, {Name: "/memory/classes/heap/stacks:bytes"}}
	metrics.Read(samples)
	var sum uint64
	for _, s := range samples {
		if s.Value.Kind() == metrics.KindUint64 {
			sum += s.Value.Uint64()
		}
	}
	return sum
}

// setHeadGC applies headGCPercent when GOGC is not set and the soft memory
// limit (headSoftLimit) when GOMEMLIMIT is not: the operator's GOGC and
// GOMEMLIMIT (which the runtime reads itself) win. It reports whether the
// limit is the default one, which then follows the fleet (followLimit).
func setHeadGC(log *slog.Logger) (follow bool) {
	if _, ok := os.LookupEnv("GOGC"); !ok {
		debug.SetGCPercent(headGCPercent)
	}
	if _, ok := os.LookupEnv("GOMEMLIMIT"); !ok {
		limit, source := headSoftLimit(cgroupMemoryLimit(cgroupMemoryFiles))
		debug.SetMemoryLimit(limit)
		log.Info("troupe head: soft memory limit", "bytes", limit, "from", source)
		return source == "default"
	}
	return false
}

// followLimit sets the default soft limit to softLimit of the records
// the head knows (known) and its live memory (live), every limitInterval,
// until ctx ends: a container's limit or GOMEMLIMIT is the operator's, but
// without either, a fixed 512 MiB would hold a head of thousands of
// replicas at its live memory, and no limit would let it grow to 5× it
// (GOGC=400). Changes under 1/16 are not applied.
func followLimit(ctx context.Context, known func() int, live func() uint64, log *slog.Logger) {
	tick := time.NewTicker(limitInterval)
	defer tick.Stop()
	last := int64(headMemoryLimit)
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		limit := softLimit(known(), live())
		if d := limit - last; d > last/16 || -d > last/16 {
			last = limit
			debug.SetMemoryLimit(limit)
			log.Debug("troupe head: soft memory limit follows the fleet", "bytes", limit)
		}
	}
}

// headSoftLimit is the soft memory limit for a head whose cgroup allows
// cgroupLimit bytes (0: no limit): cgroupMemoryShare of it, so a head in a
// 4 GiB container serving a large fleet is not held to 512 MiB, and one in
// a 256 MiB container collects before it is killed; headMemoryLimit
// without a cgroup limit. source names which, for the log.
func headSoftLimit(cgroupLimit int64) (limit int64, source string) {
	if cgroupLimit <= 0 {
		return headMemoryLimit, "default"
	}
	return int64(float64(cgroupLimit) * cgroupMemoryShare), "cgroup"
}

// cgroupMemoryLimit reads the first of files that names a memory limit, in
// bytes; 0 when none does ("max", the kernel's "no limit" figure of cgroup
// v1, a missing or unreadable file).
func cgroupMemoryLimit(files []string) int64 {
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		v, err := strconv.ParseInt(string(bytes.TrimSpace(b)), 10, 64)
		// cgroup v1 writes its page-rounded int64 max when unlimited.
		if err != nil || v <= 0 || v >= 1<<62 {
			continue
		}
		return v
	}
	return 0
}
