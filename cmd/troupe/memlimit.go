package main

import (
	"bytes"
	"log/slog"
	"os"
	"runtime/debug"
	"strconv"
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

// setHeadGC applies headGCPercent when GOGC is not set and the soft memory
// limit (headSoftLimit) when GOMEMLIMIT is not: the operator's GOGC and
// GOMEMLIMIT (which the runtime reads itself) win.
func setHeadGC(log *slog.Logger) {
	if _, ok := os.LookupEnv("GOGC"); !ok {
		debug.SetGCPercent(headGCPercent)
	}
	if _, ok := os.LookupEnv("GOMEMLIMIT"); !ok {
		limit, source := headSoftLimit(cgroupMemoryLimit(cgroupMemoryFiles))
		debug.SetMemoryLimit(limit)
		log.Info("troupe head: soft memory limit", "bytes", limit, "from", source)
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
