#!/usr/bin/env bash
# Fails when the committed generated code (Go and Python) differs from a
# fresh generation (the packages' hand-written files are not its concern).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/gen-proto.sh
generated=('pkg/stagepb/*.pb.go' 'pkg/oippb/*.pb.go' 'worker/python/troupe_engine/_oip/*.py')
if ! git diff --quiet --exit-code -- "${generated[@]}" || [ -n "$(git ls-files --others --exclude-standard -- "${generated[@]}")" ]; then
  echo "generated code is stale or not committed: run scripts/gen-proto.sh and commit the result" >&2
  git --no-pager diff --stat -- "${generated[@]}" >&2
  git ls-files --others --exclude-standard -- "${generated[@]}" >&2
  exit 1
fi
