package telemetry

import (
	"strings"

	"google.golang.org/grpc/stats"
)

// TraceRPC reports whether a gRPC call deserves a span: everything but
// health probes, which the head sends on every join and which would
// otherwise fill the trace store with one-span traces, and Multiplex
// streams, which carry many requests for as long as a connection lasts
// (one span would hold every request's phases). Pass it to
// otelgrpc.WithFilter on both sides.
func TraceRPC(info *stats.RPCTagInfo) bool {
	m := info.FullMethodName
	return !strings.HasSuffix(m, "/Health") && !strings.HasSuffix(m, "/Multiplex") && !strings.HasPrefix(m, "/grpc.health.v1.")
}
