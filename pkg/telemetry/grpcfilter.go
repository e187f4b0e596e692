package telemetry

import (
	"strings"

	"google.golang.org/grpc/stats"
)

// TraceRPC reports whether a gRPC call deserves a span: everything but
// health probes, which the head sends on every join and which would
// otherwise fill the trace store with one-span traces. Pass it to
// otelgrpc.WithFilter on both sides.
func TraceRPC(info *stats.RPCTagInfo) bool {
	m := info.FullMethodName
	return !strings.HasSuffix(m, "/Health") && !strings.HasPrefix(m, "/grpc.health.v1.")
}
