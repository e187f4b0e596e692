package main

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"runtime/debug"
	"strconv"
	"time"
)

// headGCPercent is the head's GOGC unless the environment sets one. The
// head's live heap is small (snapshots, series, in-flight requests) and its
// garbage is per request and per token, so collecting at 4× the live heap
// instead of 2× halves the GC work for a few more MB (docs/benchmarks.md).
const headGCPercent = 400

// headMemoryLimit is the head's soft memory limit (GOMEMLIMIT) when the
// environment sets none and the head's cgroup has no memory limit. At
// headGCPercent the heap grows to 5× the live heap between collections;
// that is cheap while the live heap is small, but with many streams in
// flight (each holds about 0.3 MiB live while its client does not read:
// windows between the stages, input logs kept for a retry) it multiplies:
// 200 unread audio streams took the head to 365 MiB of RSS over a 69 MiB
// live heap. The limit makes the collector run more often as the heap
// nears it, so the head's memory follows its live heap, not 5× it
// (docs/reliability.md, "Memory of streams nobody reads"). It is soft: a
// live heap above it is not refused, only collected harder (the runtime
// caps that at half the CPU).
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
// replica record the head knows (fleetLimit): about twice a replica's
// share of the head's RSS (51–55 KiB at 10,000: its connection, gRPC's
// goroutines and buffers, its record). A head whose live heap reaches a
// fixed limit collects without pause, at up to half its CPU: a head
// restarted against 10,000 replicas, its live heap past 512 MiB, spent a
// third of its CPU in the collector (docs/benchmarks.md).
const headLimitPerReplica = 128 << 10

// fleetLimit is the default soft limit of a head that knows n replicas.
func fleetLimit(n int) int64 {
	return headMemoryLimit + int64(n)*headLimitPerReplica
}

// fleetLimitInterval is how often a head on the default soft limit reads
// its fleet's size (followFleetLimit).
const fleetLimitInterval = time.Second

// setHeadGC applies headGCPercent when GOGC is not set and the soft memory
// limit (headSoftLimit) when GOMEMLIMIT is not: the operator's GOGC and
// GOMEMLIMIT (which the runtime reads itself) win. It reports whether the
// limit is the default one, which then follows the fleet's size
// (followFleetLimit).
func setHeadGC(log *slog.Logger) (followFleet bool) {
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

// followFleetLimit sets the default soft limit to fleetLimit of the
// records the head knows (known), read every fleetLimitInterval, until
// ctx ends: a container's limit or GOMEMLIMIT is the operator's, but
// without either, a fixed 512 MiB would hold a head of thousands of
// replicas at its live heap.
func followFleetLimit(ctx context.Context, known func() int, log *slog.Logger) {
	tick := time.NewTicker(fleetLimitInterval)
	defer tick.Stop()
	last := 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		if n := known(); n != last {
			last = n
			limit := fleetLimit(n)
			debug.SetMemoryLimit(limit)
			log.Debug("troupe head: soft memory limit follows the fleet", "replicas", n, "bytes", limit)
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
