#!/usr/bin/env bash
# The one test command (README): installs what the tests need, lints, checks
# generated code, then runs every test, the core packages under -race.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

# Debian packages the checks need, installed only when missing: protoc and
# gRPC's Python generator (generated code), Python's gRPC (Python engines), espeak-ng (the espeak speech engine, which its tests run
# for real), promtool with the prometheus binary (rules, metrics lint, the
# compose profile monitoring's image), and haproxy (the compose profile ha's
# balancer image).
missing=()
command -v protoc >/dev/null 2>&1 || missing+=(protobuf-compiler)
command -v grpc_python_plugin >/dev/null 2>&1 || missing+=(protobuf-compiler-grpc)
# Debian's Python with gRPC, protobuf and numpy: the Python engine package
# (worker/python) and its example pipeline, run for real by the tests.
/usr/bin/python3 -c 'import grpc, google.protobuf, numpy' >/dev/null 2>&1 || missing+=(python3-grpcio python3-protobuf python3-numpy)
command -v espeak-ng >/dev/null 2>&1 || missing+=(espeak-ng)
{ command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; } || missing+=(prometheus)
[ -x /usr/sbin/haproxy ] || command -v haproxy >/dev/null 2>&1 || missing+=(haproxy)
if [ "${#missing[@]}" -gt 0 ]; then
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

step "Prometheus configuration, rules and rule unit tests (promtool)"
promtool check config deploy/prometheus/prometheus.yml
promtool check rules deploy/prometheus/rules.yml
promtool test rules deploy/prometheus/rules_test.yml

step "HAProxy configuration of the compose profile ha (haproxy -c)"
haproxy="$(command -v haproxy || echo /usr/sbin/haproxy)"
"$haproxy" -c -q -f deploy/haproxy/haproxy.cfg

step "go test -race (all packages)"
# The log is kept so that a failure ends this script with the failing
# tests' own lines (CI shows only the tail, and a package's logs can bury
# them), not with whatever the last test happened to log.
gotest_log="$(mktemp)"
if ! go test -race -count=1 -timeout 15m ./... 2>&1 | tee "$gotest_log"; then
  echo "=== failing tests (the lines around each --- FAIL and panic):" >&2
  grep -n -B3 -A25 -E -- '^\s*--- FAIL|^panic:|^FAIL\s|goleak|DATA RACE' "$gotest_log" | grep -v '"level":"' | tail -200 >&2
  exit 1
fi
rm -f "$gotest_log"

# The Helm chart's test is its own module (Helm's and Kubernetes' libraries
# stay out of troupe's): it renders deploy/helm/troupe with Helm's library
# for each values file, strict-decodes every object into the Kubernetes API
# types, checks their references, and runs `helm lint`'s checks in process.
step "Helm chart (deploy/helm)"
staticcheck="$(go tool -n staticcheck)" # the main module's staticcheck, run in the chart's module
(cd deploy/helm && go vet ./... && "$staticcheck" ./... && go test -count=1 ./...)

# Each fuzz target for a bounded number of inputs, about 10 s each on an
# idle 2-core machine (go test -fuzz takes one target per run); their seed
# inputs (f.Add; no corpus is checked in) already ran as plain tests above.
# An input that fails is written to the package's testdata/fuzz/; commit it
# and it runs as a plain test too.
# Counts, not durations: Go 1.26's fuzz coordinator can fail a target with
# "context deadline exceeded" when a -fuzztime duration ends while a worker
# is busy (golang/go#75804, fixed in Go 1.27), which a loaded machine makes
# likely. FUZZTIME (any -fuzztime value) overrides every target's budget.
for target in \
  "FuzzParseChat ./internal/front/httpapi 40000x" \
  "FuzzParseCompletion ./internal/front/httpapi 30000x" \
  "FuzzContentParts ./internal/front/httpapi 30000x" \
  "FuzzTranscriptionForm ./internal/front/httpapi 30000x" \
  "FuzzAdminPath ./internal/front/httpapi 10000x" \
  "FuzzEncodeWAV ./internal/front/httpapi 30000x" \
  "FuzzReadWAV ./internal/front/httpapi 30000x" \
  "FuzzDecodeMember ./membership 200000x" \
  "FuzzParsePipeline ./orchestrator 40000x" \
  "FuzzSimMatchesReference ./pkg/tokenizers 60000x"; do
  set -- $target
  budget=${FUZZTIME:-$3}
  step "fuzz $1 ($budget)"
  go test -run '^$' -fuzz "^$1\$" -fuzztime "$budget" "$2"
done

step "end-to-end tracing through a real Jaeger"
scripts/e2e-tracing.sh

step "end-to-end across containers (docker-compose)"
scripts/e2e-compose.sh

echo
echo "scripts/test.sh: all checks passed"
