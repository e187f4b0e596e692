#!/usr/bin/env bash
# Fails when the committed pkg/stagepb differs from a fresh generation.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/gen-proto.sh
if ! git diff --quiet --exit-code -- pkg/stagepb; then
  echo "pkg/stagepb is stale: run scripts/gen-proto.sh and commit the result" >&2
  git --no-pager diff --stat -- pkg/stagepb >&2
  exit 1
fi
