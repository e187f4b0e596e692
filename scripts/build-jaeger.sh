#!/usr/bin/env bash
# Builds the Jaeger v2 all-in-one pinned by tools/jaeger/go.mod as a static
# binary at bin/jaeger (gitignored). The build is skipped while bin/jaeger is
# newer than tools/jaeger/go.sum, so repeated runs on one machine are free.
#
#   scripts/build-jaeger.sh            # build if missing or stale
#   FORCE=1 scripts/build-jaeger.sh    # rebuild anyway
#   JAEGER_BIN=/tmp/jaeger scripts/build-jaeger.sh   # another output path
#
# A cold build compiles Jaeger's whole dependency graph (the OpenTelemetry
# collector and every storage client): expect minutes; see docs/tracing.md.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

out="${JAEGER_BIN:-$root/bin/jaeger}"
sum="$root/tools/jaeger/go.sum"
pkg=github.com/jaegertracing/jaeger/cmd/jaeger

if [ "${FORCE:-0}" != 1 ] && [ -x "$out" ] && [ "$out" -nt "$sum" ]; then
  echo "build-jaeger: $out is up to date (newer than tools/jaeger/go.sum); FORCE=1 rebuilds"
  exit 0
fi

cd "$root/tools/jaeger"
v1=$(go list -m -f '{{.Version}}' github.com/jaegertracing/jaeger)
# Jaeger tags every release twice: v1.N.P (the Go module) is v2.(N-63).P (the
# product). The v2 version is only cosmetic: `jaeger version` prints it.
minor=$(echo "$v1" | cut -d. -f2)
patch=$(echo "$v1" | cut -d. -f3)
v2="v2.$((minor - 63)).$patch"

echo "build-jaeger: building $pkg@$v1 ($v2) -> $out (CGO_ENABLED=0)"
start=$(date +%s)
mkdir -p "$(dirname "$out")"
tmp="$out.tmp.$$"
trap 'rm -f "$tmp"' EXIT
ldflags="-s -w"
ldflags+=" -X github.com/jaegertracing/jaeger/internal/version.latestVersion=$v2"
ldflags+=" -X github.com/jaegertracing/jaeger/internal/version.commitSHA=$v1"
CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$tmp" "$pkg"
mv "$tmp" "$out"
trap - EXIT
end=$(date +%s)
echo "build-jaeger: done in $((end - start))s: $out"
