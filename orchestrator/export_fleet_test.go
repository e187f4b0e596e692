package orchestrator

import "github.com/troupe-serving/troupe/internal/core/router"

// ReplicaRef is a replica as the router holds it.
type ReplicaRef = router.Replica

// ReplicasRef are a stage's replicas as the router holds them.
type ReplicasRef = router.Replicas

// RoutedReplicas returns the replicas the head's router holds for stage
// (its published snapshot, O(1)): the fleet simulation's view of what the
// head routes to.
func RoutedReplicas(h *Head, stage int) *ReplicasRef {
	return h.router.Snapshot().Stage(stage)
}
