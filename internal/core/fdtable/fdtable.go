// Package fdtable grows the process's file descriptor table ahead of need.
//
// Linux grows a process's descriptor table by doubling it (to 256, 512,
// 1024... descriptors). In a multithreaded process each growth waits for
// an RCU grace period (synchronize_rcu in expand_fdtable), milliseconds in
// which the thread that opens the descriptor (a dial, an accept) and any
// other that opens one are blocked. A head opens a descriptor per replica
// connection and per API client, so the join or request at each new
// high-water mark would pay that wait; Reserve pays it once, at start. The
// table never shrinks.
package fdtable

// DefaultReserve is what the head reserves: 4096 descriptors, a 32 KiB
// table, enough for thousands of replicas and clients.
const DefaultReserve = 4096
