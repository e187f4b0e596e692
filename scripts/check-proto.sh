#!/usr/bin/env bash
# Fails when the committed generated code of pkg/stagepb differs from a
# fresh generation (the package's hand-written files are not its concern).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/gen-proto.sh
if ! git diff --quiet --exit-code -- 'pkg/stagepb/*.pb.go'; then
  echo "pkg/stagepb is stale: run scripts/gen-proto.sh and commit the result" >&2
  git --no-pager diff --stat -- 'pkg/stagepb/*.pb.go' >&2
  exit 1
fi
