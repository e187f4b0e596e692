#!/usr/bin/env bash
# Tracing smoke test against a real Jaeger v2: builds bin/jaeger if needed
# (scripts/build-jaeger.sh) and a troupe binary, then runs TestJaegerSmoke,
# which starts Jaeger with tools/jaeger/config.yaml on free loopback ports,
# sends a troupe-shaped trace over OTLP gRPC and OTLP HTTP, reads it back
# through /api/v3/traces/{id} and through `troupe trace`, and stops Jaeger.
# Every wait inside is bounded; the whole run is capped at 10 minutes of
# test time. Exit status 0 means traces made the round trip.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

"$root/scripts/build-jaeger.sh"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "jaeger-smoke: building troupe"
go build -o "$work/troupe" ./cmd/troupe

echo "jaeger-smoke: running TestJaegerSmoke"
TROUPE_JAEGER_BIN="$root/bin/jaeger" \
TROUPE_JAEGER_CONFIG="$root/tools/jaeger/config.yaml" \
TROUPE_BIN="$work/troupe" \
  go test -count=1 -timeout 10m -run '^TestJaegerSmoke$' -v ./internal/front/jaeger/
