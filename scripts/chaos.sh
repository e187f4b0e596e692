#!/usr/bin/env bash
# The chaos suite (docs/reliability.md): every fault as separate processes
# on loopback under a steady load, with a table of what the clients saw.
# Minutes long, so not part of scripts/test.sh. Extra arguments go to
# `go test` (e.g. -run 'TestChaos/worker'); TROUPE_CHAOS_RUN=<substring>
# runs the scenarios whose name contains it; TROUPE_CHAOS_OUT=<file> also
# writes the table there.
set -euo pipefail
cd "$(dirname "$0")/.."
TROUPE_CHAOS=1 exec go test -count=1 -timeout 20m -run '^TestChaos$' -v "$@" ./test/e2e/
