// Package sortedseq provides Seq, an immutable sequence of values in key
// order stored in chunks, so that a change copies the chunks it touches
// and the chunk index, not the sequence: the head's views of a stage
// (the router's snapshot, the API's list of records) change by one
// replica at a time, and at 10,000 replicas a copy of the whole sequence
// per join would be most of a lone join's cost on the head's loop.
//
// A Seq is safe for concurrent reads; With returns a new Seq and never
// changes the one it is called on, so readers of an older Seq keep a
// consistent view while a single writer builds the next.
package sortedseq

import (
	"iter"
	"slices"
	"sort"
)

// maxChunk bounds a chunk; a chunk that grows past it splits in halves,
// and one that falls under minChunk is merged with a neighbour. A lone
// change then copies at most maxChunk values and the index of about
// N/minChunk chunks.
const (
	maxChunk = 512
	minChunk = maxChunk / 4
)

// Seq is an immutable sequence of values sorted by their keys (keyOf,
// compare), keys distinct. The zero value is not usable: see New.
type Seq[K, V any] struct {
	keyOf   func(V) K
	compare func(a, b K) int
	chunks  [][]V // non-empty, each sorted, in order
	ends    []int // ends[i]: how many values chunks[:i+1] hold
}

// New returns an empty Seq ordered by compare over keyOf.
func New[K, V any](keyOf func(V) K, compare func(a, b K) int) *Seq[K, V] {
	return &Seq[K, V]{keyOf: keyOf, compare: compare}
}

// FromSorted returns a Seq of values, which must be sorted by key with
// distinct keys; values is not retained.
func FromSorted[K, V any](values []V, keyOf func(V) K, compare func(a, b K) int) *Seq[K, V] {
	s := New(keyOf, compare)
	for len(values) > 0 {
		n := min(len(values), maxChunk/2)
		s.chunks = append(s.chunks, slices.Clone(values[:n]))
		values = values[n:]
	}
	s.index()
	return s
}

// index recomputes ends from chunks.
func (s *Seq[K, V]) index() {
	s.ends = make([]int, len(s.chunks))
	total := 0
	for i, c := range s.chunks {
		total += len(c)
		s.ends[i] = total
	}
}

// Len is the number of values.
func (s *Seq[K, V]) Len() int {
	if len(s.ends) == 0 {
		return 0
	}
	return s.ends[len(s.ends)-1]
}

// At is the i-th value in key order; i must be in [0, Len()). It starts
// from the chunk the average chunk size points at and steps from there
// (chunks hold minChunk to maxChunk values, so a few steps at most): a
// large stage's pick draws dozens of replicas by index.
func (s *Seq[K, V]) At(i int) V {
	ends := s.ends
	c := i * len(ends) / ends[len(ends)-1]
	for ends[c] <= i {
		c++
	}
	for c > 0 && ends[c-1] > i {
		c--
	}
	if c > 0 {
		i -= ends[c-1]
	}
	return s.chunks[c][i]
}

// All yields the values in key order.
func (s *Seq[K, V]) All() iter.Seq[V] {
	return func(yield func(V) bool) {
		for _, c := range s.chunks {
			for _, v := range c {
				if !yield(v) {
					return
				}
			}
		}
	}
}

// Contiguous returns the values as one slice, without a copy, when they
// are stored in one chunk (up to a few hundred values); ok is false
// otherwise. The slice must not be modified.
func (s *Seq[K, V]) Contiguous() (values []V, ok bool) {
	switch len(s.chunks) {
	case 0:
		return nil, true
	case 1:
		return s.chunks[0], true
	}
	return nil, false
}

// Find returns the value under key k.
func (s *Seq[K, V]) Find(k K) (v V, ok bool) {
	c := s.chunkOf(k)
	if c == len(s.chunks) {
		return v, false
	}
	if i, found := s.search(s.chunks[c], k); found {
		return s.chunks[c][i], true
	}
	return v, false
}

// chunkOf is the first chunk whose last key is at or above k (len(chunks)
// when k is above every key).
func (s *Seq[K, V]) chunkOf(k K) int {
	return sort.Search(len(s.chunks), func(j int) bool {
		c := s.chunks[j]
		return s.compare(s.keyOf(c[len(c)-1]), k) >= 0
	})
}

// search is the position of k in chunk c, and whether it is there.
func (s *Seq[K, V]) search(c []V, k K) (int, bool) {
	return slices.BinarySearchFunc(c, k, func(v V, k K) int { return s.compare(s.keyOf(v), k) })
}

// Change is one change of With: Delete removes the value under Key (if
// any); otherwise Value, whose key is Key, is inserted or replaces the
// value under Key.
type Change[K, V any] struct {
	Key    K
	Value  V
	Delete bool
}

// With returns s with changes applied. changes must be sorted by key,
// keys distinct. It copies the chunks that changes touch (merged with
// their changes in one pass each), and the chunk index; the other chunks
// are shared with s. replaced, when not nil, is called with each value a
// change replaces or deletes.
func (s *Seq[K, V]) With(changes []Change[K, V], replaced func(V)) *Seq[K, V] {
	next := &Seq[K, V]{keyOf: s.keyOf, compare: s.compare}
	if len(changes) == 0 {
		next.chunks, next.ends = s.chunks, s.ends
		return next
	}
	chunks := make([][]V, 0, len(s.chunks)+1)
	touched := make([]bool, 0, len(s.chunks)+1)
	c := 0
	for len(changes) > 0 {
		// The changes that go to chunk c: those up to its last key (all
		// that are left, for the last chunk or an empty sequence).
		target := s.chunkOf(changes[0].Key)
		if target == len(s.chunks) && target > 0 {
			target-- // above every key: into the last chunk
		}
		for ; c < target; c++ {
			chunks, touched = append(chunks, s.chunks[c]), append(touched, false)
		}
		n := len(changes)
		var old []V
		if c < len(s.chunks) {
			old = s.chunks[c]
			if c < len(s.chunks)-1 {
				last := s.keyOf(old[len(old)-1])
				n = sort.Search(len(changes), func(j int) bool { return s.compare(changes[j].Key, last) > 0 })
			}
			c++
		}
		merged := s.merge(old, changes[:n], replaced)
		changes = changes[n:]
		if len(merged) > 0 {
			chunks, touched = append(chunks, merged), append(touched, true)
		}
	}
	for ; c < len(s.chunks); c++ {
		chunks, touched = append(chunks, s.chunks[c]), append(touched, false)
	}
	next.chunks = rebalance(chunks, touched)
	next.index()
	return next
}

// merge is chunk old with changes applied, in a new slice.
func (s *Seq[K, V]) merge(old []V, changes []Change[K, V], replaced func(V)) []V {
	out := make([]V, 0, len(old)+len(changes))
	i := 0
	for _, ch := range changes {
		j, found := s.search(old[i:], ch.Key)
		out = append(out, old[i:i+j]...)
		i += j
		if found {
			if replaced != nil {
				replaced(old[i])
			}
			i++
		}
		if !ch.Delete {
			out = append(out, ch.Value)
		}
	}
	return append(out, old[i:]...)
}

// rebalance splits the touched chunks above maxChunk and merges those
// under minChunk with a neighbour, copying only touched chunks and their
// merged neighbours.
func rebalance[V any](chunks [][]V, touched []bool) [][]V {
	out := make([][]V, 0, len(chunks))
	for i, c := range chunks {
		if !touched[i] {
			out = append(out, c)
			continue
		}
		for len(c) > maxChunk {
			out = append(out, c[:len(c)/2:len(c)/2])
			c = c[len(c)/2:]
		}
		if len(c) < minChunk && len(out) > 0 && len(out[len(out)-1])+len(c) <= maxChunk {
			prev := out[len(out)-1]
			out[len(out)-1] = append(slices.Clip(slices.Clone(prev)), c...)
			continue
		}
		out = append(out, c)
	}
	return out
}
