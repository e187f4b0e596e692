#!/usr/bin/env bash
# Head throughput and latency benchmark (docs/benchmarks.md): an in-process
# cluster (embedded etcd, real gRPC on loopback, sim workers), driven through
# Head.Execute and through the HTTP API at concurrency 1, 8 and 32.
#
#   scripts/bench.sh                 # both groups below
#   ZERO_N=500x DELAY_N=32x scripts/bench.sh
#
# ZERO_N: requests per run of the zero-delay scenarios (1 and 3 stages).
# DELAY_N: requests per run of the 3-stage scenario with a realistic pace
#   (5ms decode steps, prefill 5000 tok/s); each takes about half a second,
#   so keep it small.
set -euo pipefail
cd "$(dirname "$0")/.."

ZERO_N=${ZERO_N:-2000x}
DELAY_N=${DELAY_N:-64x}

go test -run '^$' -bench 'BenchmarkHead/^(1stage|3stage)$' -benchtime "$ZERO_N" ./test/bench
go test -run '^$' -bench 'BenchmarkHead/^3stage-delay$' -benchtime "$DELAY_N" ./test/bench
