package router

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// everyTakesByScan is what Snapshot's counts answer, by reading every
// replica of the stage.
func everyTakesByScan(s *Snapshot, stage int, kind string, byURL bool) (audio, part bool) {
	reps := s.Stage(stage)
	audio, part = reps.Len() > 0, true
	for rep := range reps.All() {
		audio = audio && rep.Engine.InputRole == stagepb.RoleAudio
		part = part && slices.Contains(rep.Engine.InputParts, kind) && (!byURL || rep.Engine.InputPartURLs)
	}
	return audio, part
}

// TestSnapshotInputCountsMatchAScan changes snapshots at random (joins,
// replacements under a key, leaves; one at a time and in batches) and
// checks after each change that the counts answer as a scan of the
// stage does.
func TestSnapshotInputCountsMatchAScan(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	kinds := []string{stagepb.PartImage, stagepb.PartAudio, "video"}
	engine := func() EngineInfo {
		e := EngineInfo{InputRole: stagepb.RoleText}
		if rng.IntN(10) > 0 {
			e.InputRole = stagepb.RoleAudio
		}
		for _, k := range kinds {
			if rng.IntN(10) > 0 {
				e.InputParts = append(e.InputParts, k)
				if rng.IntN(5) == 0 {
					e.InputParts = append(e.InputParts, k) // listed twice
				}
			}
		}
		e.InputPartURLs = rng.IntN(10) > 0
		return e
	}
	replica := func(stage int) *Replica {
		return &Replica{Key: Key{Stage: stage, Replica: uint32(rng.IntN(8))}, Engine: engine()}
	}
	s := newSnapshot(make([][]*Replica, 2))
	var yes, no [2]int // answers of the scan, audio and part: both kinds must occur
	for step := range 3000 {
		stage := rng.IntN(2)
		switch op := rng.IntN(10); {
		case op < 5:
			s = s.with(replica(stage))
		case op < 8:
			s = s.without(Key{Stage: stage, Replica: uint32(rng.IntN(8))})
		default:
			changes := map[Key]*Replica{}
			for range 1 + rng.IntN(20) {
				rep := replica(rng.IntN(2))
				if rng.IntN(3) == 0 {
					changes[rep.Key] = nil
				} else {
					changes[rep.Key] = rep
				}
			}
			s = s.withAll(changes)
		}
		for st := range 2 {
			for _, kind := range kinds {
				for _, byURL := range []bool{false, true} {
					audio, part := everyTakesByScan(s, st, kind, byURL)
					for i, v := range []bool{audio, part} {
						if v {
							yes[i]++
						} else {
							no[i]++
						}
					}
					name := fmt.Sprintf("step %d stage %d (%d replicas) kind %s byURL %v", step, st, s.Stage(st).Len(), kind, byURL)
					if got := s.EveryReplicaTakesAudio(st); got != audio {
						t.Fatalf("%s: EveryReplicaTakesAudio %v, scan %v", name, got, audio)
					}
					if got := s.EveryReplicaTakesPart(st, kind, byURL); got != part {
						t.Fatalf("%s: EveryReplicaTakesPart %v, scan %v", name, got, part)
					}
				}
			}
		}
	}
	for i := range yes {
		if yes[i] < 1000 || no[i] < 1000 {
			t.Fatalf("the changes did not exercise both answers: yes %v, no %v", yes, no)
		}
	}
	// Out of range stages: no replica.
	if s.EveryReplicaTakesAudio(5) || !s.EveryReplicaTakesPart(-1, stagepb.PartImage, false) {
		t.Fatal("a stage that does not exist has no replica")
	}
}

// BenchmarkEveryReplicaTakes is a request's check that stage 0 takes its
// input (a transcription's audio, a chat's image) at each stage size: the
// snapshot's counts against a scan of every replica (the "scan" rows: the
// baseline, in the same run).
func BenchmarkEveryReplicaTakes(b *testing.B) {
	for _, n := range []int{10, 1000, 10000} {
		reps := make([]*Replica, n)
		for i := range reps {
			reps[i] = &Replica{Key: Key{Replica: uint32(i)}, Engine: EngineInfo{InputRole: stagepb.RoleAudio, InputParts: []string{stagepb.PartAudio, stagepb.PartImage}}}
		}
		s := newSnapshot([][]*Replica{reps})
		b.Run(fmt.Sprintf("counts/N=%d", n), func(b *testing.B) {
			for b.Loop() {
				if !s.EveryReplicaTakesAudio(0) || !s.EveryReplicaTakesPart(0, stagepb.PartImage, false) {
					b.Fatal("every replica takes both")
				}
			}
		})
		b.Run(fmt.Sprintf("scan/N=%d", n), func(b *testing.B) {
			for b.Loop() {
				if audio, part := everyTakesByScan(s, 0, stagepb.PartImage, false); !audio || !part {
					b.Fatal("every replica takes both")
				}
			}
		})
	}
}
