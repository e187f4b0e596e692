package orchestrator

import (
	"errors"
	"fmt"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// bareHead is a head whose loop state tests drive by hand (no etcd, no
// dialling).
func bareHead(t testing.TB) *Head {
	t.Helper()
	h, err := New(nil, Config{
		Pipeline: DefaultPipeline(),
		Metrics:  prometheus.NewRegistry(),
		Dial:     func(string) (*grpc.ClientConn, error) { return nil, errors.New("not dialled in this test") },
	})
	require.NoError(t, err)
	return h
}

// route makes the loop's record of key routed, with roles io and the
// worker's instance id, and publishes it, as attach does.
func (h *Head) routeForTest(key router.Key, io stageIO, instance string) {
	t := h.fleet.known[key]
	if t == nil {
		t = &tracked{key: key, index: len(h.fleet.known)}
		h.fleet.known[key] = t
	}
	t.member = membership.Member{Stage: h.cfg.Pipeline.StageNames()[key.Stage], ReplicaID: key.Replica}
	t.io, t.instance, t.routed, t.detached = io, instance, true, false
	h.fleet.publish(key)
}

var (
	textIO  = stageIO{in: stagepb.RoleText, out: stagepb.RoleText}
	codesIO = stageIO{in: stagepb.RoleText, out: stagepb.RoleCodes}
)

// TestJoinChecksFollowRoutedRecords: the join checks read indexes of the
// routed records, kept by publish; a record that leaves (unrouted) frees
// its instance id and, as the last of its stage, the stage's roles.
func TestJoinChecksFollowRoutedRecords(t *testing.T) {
	h := bareHead(t)
	a, b := router.Key{Stage: 0, Replica: 1}, router.Key{Stage: 0, Replica: 2}
	h.routeForTest(a, textIO, "proc-1")

	joining := &tracked{key: b, instance: "proc-1", member: membership.Member{Addr: "10.0.0.9:7000"}}
	health := &stagepb.HealthResponse{InstanceId: "proc-1", ReplicaId: 2}
	assert.Contains(t, h.fleet.checkIdentity(joining, health), "already serves thinker/1", "one process, one routed record")
	assert.Contains(t, h.fleet.checkRoles(b, codesIO), "stage thinker serves text → text, but this replica is text → codes")
	assert.Empty(t, h.fleet.checkRoles(b, textIO))

	// a leaves: unrouted (detach does this, then publishes).
	h.fleet.known[a].routed, h.fleet.known[a].detached = false, true
	h.fleet.publish(a)
	assert.Empty(t, h.fleet.checkIdentity(joining, health), "the instance is free once its record left")
	assert.Empty(t, h.fleet.checkRoles(b, codesIO), "no routed replica of the stage: the next one sets its roles")

	// A record re-routed under the same key keeps its own instance.
	h.routeForTest(a, textIO, "proc-1")
	h.routeForTest(b, textIO, "proc-2")
	h.fleet.known[b].routed = false
	h.fleet.publish(b)
	assert.Contains(t, h.fleet.checkIdentity(joining, health), "already serves thinker/1", "b's leave does not free a's instance")
}

// BenchmarkJoinChecks is the loop's role and identity checks of one join
// on a head that routes n replicas (capacity figure: the loop alone).
func BenchmarkJoinChecks(b *testing.B) {
	for _, n := range []int{100, 1000, 10000} {
		b.Run(fmt.Sprintf("routed=%d", n), func(b *testing.B) {
			h := bareHead(b)
			for i := range n {
				h.routeForTest(router.Key{Stage: 0, Replica: uint32(i + 1)}, textIO, fmt.Sprint("proc-", i))
			}
			key := router.Key{Stage: 0, Replica: uint32(n + 1)}
			joining := &tracked{key: key, instance: "new-proc"}
			health := &stagepb.HealthResponse{InstanceId: "new-proc", ReplicaId: key.Replica}
			b.ResetTimer()
			for range b.N {
				if h.fleet.checkRoles(key, textIO) != "" || h.fleet.checkIdentity(joining, health) != "" {
					b.Fatal("refused")
				}
			}
		})
	}
}
