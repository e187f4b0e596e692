package router

import (
	"cmp"
	"fmt"
	"slices"
	"testing"
)

// mapSnapshot is a map by key beside the sorted stages, both copied whole
// and the stage re-sorted on every join: BenchmarkSnapshotJoin's baseline.
type mapSnapshot struct {
	stages [][]*Replica
	byKey  map[Key]*Replica
}

func (s *mapSnapshot) with(rep *Replica) *mapSnapshot {
	next := &mapSnapshot{stages: slices.Clone(s.stages), byKey: make(map[Key]*Replica, len(s.byKey)+1)}
	for k, v := range s.byKey {
		next.byKey[k] = v
	}
	next.byKey[rep.Key] = rep
	st := slices.DeleteFunc(slices.Clone(s.stages[rep.Key.Stage]), func(x *Replica) bool { return x.Key == rep.Key })
	st = append(st, rep)
	slices.SortFunc(st, func(a, b *Replica) int { return cmp.Compare(a.Key.Replica, b.Key.Replica) })
	next.stages[rep.Key.Stage] = st
	return next
}

// BenchmarkSnapshotJoin is a join storm on the router alone: N replicas
// added one by one, each publishing a new snapshot, as the head's loop
// does (in a random id order, as registrations arrive). "map" is the
// baseline (mapSnapshot: map copy and sort per join), "sorted" the
// Snapshot (a copy of the chunk changed and the chunk index); both run in
// the same process, so compare their ratio. ns/op is the whole storm.
//
//	go test -run '^$' -bench SnapshotJoin ./internal/core/router/
func BenchmarkSnapshotJoin(b *testing.B) {
	for _, n := range []int{100, 1000, 10000} {
		reps := make([]*Replica, n)
		for i, id := range randomIDs(n) {
			reps[i] = &Replica{Key: Key{Stage: 0, Replica: id}}
		}
		b.Run(fmt.Sprintf("map/N=%d", n), func(b *testing.B) {
			for b.Loop() {
				s := &mapSnapshot{stages: make([][]*Replica, 1), byKey: map[Key]*Replica{}}
				for _, rep := range reps {
					s = s.with(rep)
				}
			}
		})
		b.Run(fmt.Sprintf("sorted/N=%d", n), func(b *testing.B) {
			for b.Loop() {
				s := &Snapshot{stages: []*Replicas{noReplicas}, inputs: make([]stageInputs, 1)}
				for _, rep := range reps {
					s = s.with(rep)
				}
			}
		})
	}
}

// randomIDs is 1..n in a fixed pseudo-random order.
func randomIDs(n int) []uint32 {
	ids := make([]uint32, n)
	x := uint32(2463534242)
	for i := range ids {
		ids[i] = uint32(i + 1)
	}
	for i := n - 1; i > 0; i-- {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		j := int(x % uint32(i+1))
		ids[i], ids[j] = ids[j], ids[i]
	}
	return ids
}

// BenchmarkSnapshotLoneJoin is one join and one leave in a stage of N
// replicas, each published on its own (a lone change, no batch): the
// snapshot writer's cost of a replica that joins or leaves a large, quiet
// fleet.
func BenchmarkSnapshotLoneJoin(b *testing.B) {
	for _, n := range []int{1000, 10000, 100000} {
		reps := make([]*Replica, n)
		for i := range reps {
			reps[i] = &Replica{Key: Key{Stage: 0, Replica: uint32(2 * i)}}
		}
		s := newSnapshot([][]*Replica{reps})
		b.Run(fmt.Sprintf("N=%d", n), func(b *testing.B) {
			i := 0
			for b.Loop() {
				rep := &Replica{Key: Key{Stage: 0, Replica: uint32(2*(i%n) + 1)}}
				i++
				joined := s.with(rep)
				if joined.without(rep.Key) == joined {
					b.Fatal("the leave changed nothing")
				}
			}
		})
	}
}
