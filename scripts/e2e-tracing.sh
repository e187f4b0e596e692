#!/usr/bin/env bash
# End-to-end tracing: builds Jaeger (cached in bin/jaeger), then runs
# test/tracing, which starts Jaeger, etcd, a head and one worker per stage as
# processes, sends one audio request and checks its trace in Jaeger. It
# also runs the Jaeger smoke test of internal/front/jaeger (both OTLP
# protocols and `troupe trace`).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
scripts/jaeger-smoke.sh
export TROUPE_JAEGER_BIN="$root/bin/jaeger"
export TROUPE_JAEGER_CONFIG="$root/tools/jaeger/config.yaml"
go test -count=1 -timeout 10m -v -run 'TestAudioRequestTraceInJaeger' ./test/tracing/ 2>&1 | tail -40
exit "${PIPESTATUS[0]}"
