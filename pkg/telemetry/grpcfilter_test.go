package telemetry

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"google.golang.org/grpc/stats"
)

func TestTraceRPC(t *testing.T) {
	for m, want := range map[string]bool{
		"/troupe.stage.v1.StageService/Generate": true,
		"/troupe.stage.v1.StageService/Sleep":    true,
		"/troupe.stage.v1.StageService/Health":   false,
		"/grpc.health.v1.Health/Check":           false,
		"/grpc.health.v1.Health/Watch":           false,
	} {
		assert.Equal(t, want, TraceRPC(&stats.RPCTagInfo{FullMethodName: m}), m)
	}
}
