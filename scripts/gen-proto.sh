#!/usr/bin/env bash
# Regenerates pkg/stagepb from stage.proto with the generators pinned in go.mod.
# Needs protoc (Debian: protobuf-compiler).
set -euo pipefail
cd "$(dirname "$0")/.."
bindir=$(mktemp -d)
trap 'rm -rf "$bindir"' EXIT
go build -o "$bindir/protoc-gen-go" google.golang.org/protobuf/cmd/protoc-gen-go
go build -o "$bindir/protoc-gen-go-grpc" google.golang.org/grpc/cmd/protoc-gen-go-grpc
PATH="$bindir:$PATH" protoc -I pkg/stagepb \
  --go_out=pkg/stagepb --go_opt=paths=source_relative \
  --go-grpc_out=pkg/stagepb --go-grpc_opt=paths=source_relative \
  pkg/stagepb/stage.proto
