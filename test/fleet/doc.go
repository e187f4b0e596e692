// Package fleet simulates a fleet of up to ten thousand replicas of one
// stage against real processes: a `troupe etcd`, one to five `troupe head`
// processes, and replica processes (this package's test binary re-executed
// in a child mode), so that no process holds more than about 5,000
// descriptors. BenchmarkFleetProcs times the join storm, a head restart, a
// leave storm and a frozen replica process, and measures the heads' memory
// and etcd's load; docs/benchmarks.md has the figures and the command.
package fleet
