#!/usr/bin/env bash
# Regenerates the generated code of the project's two protocols with the
# generators pinned in go.mod (Go) and Debian's grpc_python_plugin (Python):
#   pkg/stagepb      troupe's stage protocol (Go);
#   pkg/oippb        the Open Inference Protocol (Go);
#   worker/python/troupe_engine/_oip  the same protocol for Python engines.
# Needs protoc and grpc_python_plugin (Debian: protobuf-compiler,
# protobuf-compiler-grpc).
set -euo pipefail
cd "$(dirname "$0")/.."
bindir=$(mktemp -d)
trap 'rm -rf "$bindir"' EXIT
go build -o "$bindir/protoc-gen-go" google.golang.org/protobuf/cmd/protoc-gen-go
go build -o "$bindir/protoc-gen-go-grpc" google.golang.org/grpc/cmd/protoc-gen-go-grpc
for pkg in stagepb oippb; do
  PATH="$bindir:$PATH" protoc -I "pkg/$pkg" \
    --go_out="pkg/$pkg" --go_opt=paths=source_relative \
    --go-grpc_out="pkg/$pkg" --go-grpc_opt=paths=source_relative \
    "pkg/$pkg"/*.proto
done
py=worker/python/troupe_engine/_oip
mkdir -p "$py"
protoc -I pkg/oippb --python_out="$py" \
  --plugin=protoc-gen-grpc_python="$(command -v grpc_python_plugin)" \
  --grpc_python_out="$py" pkg/oippb/grpc_service.proto
# The generated service module imports its messages as a top-level module;
# inside a package the import must be relative.
sed -i 's/^import grpc_service_pb2 as/from . import grpc_service_pb2 as/' "$py/grpc_service_pb2_grpc.py"
