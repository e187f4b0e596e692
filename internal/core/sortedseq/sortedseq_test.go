package sortedseq

import (
	"cmp"
	"math/rand/v2"
	"slices"
	"testing"
)

type item struct{ key, val int }

func keyOf(it item) int { return it.key }

// check compares s with the model (sorted by key, keys distinct) through
// every read, and checks the chunks' invariants.
func check(t *testing.T, step int, s *Seq[int, item], model []item) {
	t.Helper()
	if s.Len() != len(model) {
		t.Fatalf("step %d: Len %d, model %d", step, s.Len(), len(model))
	}
	if got := slices.Collect(s.All()); !slices.Equal(got, model) && len(model) > 0 {
		t.Fatalf("step %d: All differs from the model", step)
	}
	for i, want := range model {
		if got := s.At(i); got != want {
			t.Fatalf("step %d: At(%d) = %v, want %v", step, i, got, want)
		}
		if got, ok := s.Find(want.key); !ok || got != want {
			t.Fatalf("step %d: Find(%d) = %v %v, want %v", step, want.key, got, ok, want)
		}
	}
	if _, ok := s.Find(-1); ok {
		t.Fatalf("step %d: found a key never inserted", step)
	}
	for i, c := range s.chunks {
		if len(c) == 0 || len(c) > maxChunk {
			t.Fatalf("step %d: chunk %d holds %d values", step, i, len(c))
		}
	}
	if vals, ok := s.Contiguous(); ok != (len(s.chunks) <= 1) || (ok && !slices.Equal(vals, model) && len(model) > 0) {
		t.Fatalf("step %d: Contiguous %v with %d chunks", step, ok, len(s.chunks))
	}
}

// apply is the model of With.
func apply(model []item, changes []Change[int, item]) []item {
	for _, ch := range changes {
		i, found := slices.BinarySearchFunc(model, ch.Key, func(it item, k int) int { return cmp.Compare(it.key, k) })
		switch {
		case ch.Delete && found:
			model = slices.Delete(model, i, i+1)
		case !ch.Delete && found:
			model[i] = ch.Value
		case !ch.Delete:
			model = slices.Insert(model, i, ch.Value)
		}
	}
	return model
}

// TestSeqMatchesASortedSlice applies random batches of inserts,
// replacements and deletes, from lone changes to thousands at once, and
// compares every read with a sorted slice after each; older Seqs must not
// change.
func TestSeqMatchesASortedSlice(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 9))
	s := New(keyOf, cmp.Compare[int])
	var model []item
	type kept struct {
		s     *Seq[int, item]
		model []item
	}
	var old []kept
	maxChunks := 0
	for step := range 400 {
		keys := 3000
		n := 1 + rng.IntN(8)
		if rng.IntN(10) == 0 {
			n = rng.IntN(2000)
		}
		byKey := map[int]Change[int, item]{}
		for range n {
			k := rng.IntN(keys)
			// Grow while small, then mostly churn.
			del := rng.IntN(3) == 0 && len(model) > 500
			if step > 300 {
				del = rng.IntN(4) > 0 // shrink: small chunks merge
			}
			byKey[k] = Change[int, item]{Key: k, Value: item{k, step}, Delete: del}
		}
		changes := make([]Change[int, item], 0, len(byKey))
		for _, ch := range byKey {
			changes = append(changes, ch)
		}
		slices.SortFunc(changes, func(a, b Change[int, item]) int { return cmp.Compare(a.Key, b.Key) })
		var replaced []int
		s = s.With(changes, func(it item) { replaced = append(replaced, it.key) })
		var wantReplaced []int
		for _, ch := range changes {
			if _, ok := slices.BinarySearchFunc(model, ch.Key, func(it item, k int) int { return cmp.Compare(it.key, k) }); ok {
				wantReplaced = append(wantReplaced, ch.Key)
			}
		}
		if !slices.Equal(replaced, wantReplaced) {
			t.Fatalf("step %d: replaced %v, want %v", step, replaced, wantReplaced)
		}
		model = apply(slices.Clone(model), changes)
		check(t, step, s, model)
		maxChunks = max(maxChunks, len(s.chunks))
		if step%50 == 0 {
			old = append(old, kept{s, slices.Clone(model)})
		}
	}
	for i, k := range old {
		check(t, -i, k.s, k.model)
	}
	if maxChunks < 4 {
		t.Fatalf("the sequence never grew past %d chunks: splits untested", maxChunks)
	}
}

func TestFromSorted(t *testing.T) {
	var model []item
	for k := range 2000 {
		model = append(model, item{2 * k, k})
	}
	s := FromSorted(model, keyOf, cmp.Compare[int])
	check(t, 0, s, model)
	s = s.With([]Change[int, item]{{Key: 1, Value: item{1, 1}}}, nil)
	check(t, 1, s, apply(slices.Clone(model), []Change[int, item]{{Key: 1, Value: item{1, 1}}}))
	if e := New(keyOf, cmp.Compare[int]); e.Len() != 0 || e.With(nil, nil).Len() != 0 {
		t.Fatal("an empty Seq has no value")
	}
}
