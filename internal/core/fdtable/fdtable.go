// Package fdtable grows the process's file descriptor table ahead of need.
//
// Linux grows a process's descriptor table by doubling it (to 256, 512,
// 1024... descriptors). In a multithreaded process each growth waits for
// an RCU grace period (synchronize_rcu in expand_fdtable): 7-14 ms on the
// benchmark machine, during which the thread that opens the descriptor (a
// dial, an accept) is blocked, any other thread that opens one waits for
// it, and the Go scheduler may run with one P fewer until sysmon takes the
// blocked thread's P back. A head opens a descriptor per replica
// connection and per API client, so the join (or the request) at each new
// high-water mark paid it: the slowest join of docs/benchmarks.md's join
// benchmark, every time, at the 256th descriptor. Reserve pays it once,
// at start. The table never shrinks.
package fdtable

// DefaultReserve is what the head reserves: 4096 descriptors, a 32 KiB
// table, enough for thousands of replicas and clients.
const DefaultReserve = 4096
