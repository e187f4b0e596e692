#!/usr/bin/env bash
# The one test command (README): installs what the tests need, lints, checks
# generated code, then runs every test, the core packages under -race.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

# protoc checks the generated code; espeak-ng is the espeak speech engine,
# which its tests run for real.
missing=()
command -v protoc >/dev/null 2>&1 || missing+=(protobuf-compiler)
command -v espeak-ng >/dev/null 2>&1 || missing+=(espeak-ng)
if [ ${#missing[@]} -gt 0 ]; then
  step "installing ${missing[*]} (Debian)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

step "gofmt"
unformatted=$(gofmt -l $(git ls-files '*.go'))
if [ -n "$unformatted" ]; then
  echo "gofmt reports:"; echo "$unformatted"; exit 1
fi

step "go vet"
go vet ./...

step "staticcheck"
go tool staticcheck ./...

step "generated code is current"
scripts/check-proto.sh

step "go test -race (all packages)"
go test -race -count=1 -timeout 15m ./...

step "end-to-end tracing through a real Jaeger"
scripts/e2e-tracing.sh

step "end-to-end across containers (docker-compose)"
scripts/e2e-compose.sh

echo
echo "scripts/test.sh: all checks passed"
