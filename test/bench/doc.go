// Package bench measures the head's throughput and latency percentiles on
// an in-process cluster (orchestratortest: real embedded etcd, real gRPC on
// loopback, sim workers), through Head.Execute and through the real HTTP
// API, and compares the routing policies on a multi-turn chat workload
// (ChatWorkload, BenchmarkRouting). docs/benchmarks.md has the numbers and
// how to reproduce them.
package bench
