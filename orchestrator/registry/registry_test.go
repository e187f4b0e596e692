package registry

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"
)

func TestZeroInitial(t *testing.T) {
	r := New()
	require.Equal(t, 0, r.Len())
	_, ok := r.Lookup(Key{Stage: 0, Replica: 0})
	require.False(t, ok)
	_, ok = r.Key(0)
	require.False(t, ok)
	_, ok = r.Key(-1)
	require.False(t, ok)

	// The first join of a head that started empty gets index 0.
	idx, err := r.Attach(Key{Stage: 2, Replica: 7})
	require.NoError(t, err)
	require.Equal(t, 0, idx)
}

func TestAttachIdempotentAndDense(t *testing.T) {
	r := New()
	keys := []Key{{0, 0}, {1, 5}, {0, 3}, {2, 0}, {1, 0}}
	for want, k := range keys {
		got, err := r.Attach(k)
		require.NoError(t, err)
		require.Equal(t, want, got, "index of %s", k)
	}
	// Rejoin in another order keeps every index.
	for i := len(keys) - 1; i >= 0; i-- {
		got, err := r.Attach(keys[i])
		require.NoError(t, err)
		require.Equal(t, i, got)
	}
	require.Equal(t, len(keys), r.Len())
	for i, k := range keys {
		got, ok := r.Key(i)
		require.True(t, ok)
		require.Equal(t, k, got)
		idx, ok := r.Lookup(k)
		require.True(t, ok)
		require.Equal(t, i, idx)
	}
}

func TestSparseReplicaIDsAcrossStages(t *testing.T) {
	r := New()
	a, err := r.Attach(Key{Stage: 0, Replica: 1 << 31})
	require.NoError(t, err)
	b, err := r.Attach(Key{Stage: 1, Replica: 1 << 31})
	require.NoError(t, err)
	c, err := r.Attach(Key{Stage: 0, Replica: 42})
	require.NoError(t, err)
	require.Equal(t, []int{0, 1, 2}, []int{a, b, c}, "indices are global across stages, not per stage")
}

func TestAttachAtConflicts(t *testing.T) {
	r := New()
	require.NoError(t, r.AttachAt(Key{0, 1}, 3))
	require.NoError(t, r.AttachAt(Key{0, 1}, 3), "same key, same index is a no-op")

	err := r.AttachAt(Key{1, 1}, 3)
	require.ErrorIs(t, err, ErrConflict, "index 3 reused for another key")
	k, ok := r.Key(3)
	require.True(t, ok)
	require.Equal(t, Key{0, 1}, k, "nothing overwritten")
	_, ok = r.Lookup(Key{1, 1})
	require.False(t, ok)

	err = r.AttachAt(Key{0, 1}, 4)
	require.ErrorIs(t, err, ErrConflict, "key moved to another index")
	_, ok = r.Key(4)
	require.False(t, ok)

	// Holes below 3 are free for AttachAt; Attach continues after 3.
	_, ok = r.Key(0)
	require.False(t, ok)
	idx, err := r.Attach(Key{2, 0})
	require.NoError(t, err)
	require.Equal(t, 4, idx)
	require.NoError(t, r.AttachAt(Key{2, 9}, 0))
	idx, ok = r.Lookup(Key{2, 9})
	require.True(t, ok)
	require.Equal(t, 0, idx)
	require.Equal(t, 3, r.Len())

	// Attach of a key placed by AttachAt returns that index.
	idx, err = r.Attach(Key{0, 1})
	require.NoError(t, err)
	require.Equal(t, 3, idx)
}

func TestInvalidInput(t *testing.T) {
	r := New()
	_, err := r.Attach(Key{Stage: -1})
	require.Error(t, err)
	require.Error(t, r.AttachAt(Key{Stage: -1}, 0))
	require.Error(t, r.AttachAt(Key{}, -1))
	require.Error(t, r.AttachAt(Key{}, MaxIndex+1))
	require.Equal(t, 0, r.Len())
}

func TestExhausted(t *testing.T) {
	r := New()
	require.NoError(t, r.AttachAt(Key{0, 0}, MaxIndex))
	_, err := r.Attach(Key{0, 1})
	require.Error(t, err)
	require.False(t, errors.Is(err, ErrConflict))
	idx, err := r.Attach(Key{0, 0})
	require.NoError(t, err, "an attached key still resolves when the table is full")
	require.Equal(t, MaxIndex, idx)
}

func TestSnapshotIsImmutable(t *testing.T) {
	r := New()
	_, err := r.Attach(Key{0, 0})
	require.NoError(t, err)
	s := r.Snapshot()
	_, err = r.Attach(Key{0, 1})
	require.NoError(t, err)
	require.NoError(t, r.AttachAt(Key{1, 0}, 5))

	require.Equal(t, 1, s.Len())
	_, ok := s.Lookup(Key{0, 1})
	require.False(t, ok)
	_, ok = s.Key(1)
	require.False(t, ok)
	k, ok := s.Key(0)
	require.True(t, ok)
	require.Equal(t, Key{0, 0}, k)

	s2 := r.Snapshot()
	require.Equal(t, 3, s2.Len())
	idx, ok := s2.Lookup(Key{1, 0})
	require.True(t, ok)
	require.Equal(t, 5, idx)
}

// TestAttachProperty checks, over random sequences of attaches, that an index
// never changes for its key, indices are dense in first-attach order, and the
// two directions agree.
func TestAttachProperty(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		r := New()
		first := map[Key]int{}
		var order []Key
		keyGen := rapid.Custom(func(t *rapid.T) Key {
			return Key{Stage: rapid.IntRange(0, 3).Draw(t, "stage"), Replica: rapid.Uint32Range(0, 6).Draw(t, "replica")}
		})
		for _, k := range rapid.SliceOf(keyGen).Draw(t, "keys") {
			idx, err := r.Attach(k)
			if err != nil {
				t.Fatalf("attach %s: %v", k, err)
			}
			if want, ok := first[k]; ok {
				if idx != want {
					t.Fatalf("%s moved from %d to %d", k, want, idx)
				}
				continue
			}
			if idx != len(order) {
				t.Fatalf("%s got %d, want dense %d", k, idx, len(order))
			}
			first[k] = idx
			order = append(order, k)
		}
		if r.Len() != len(order) {
			t.Fatalf("len %d, want %d", r.Len(), len(order))
		}
		for i, k := range order {
			got, ok := r.Key(i)
			if !ok || got != k {
				t.Fatalf("Key(%d) = %v,%v want %s", i, got, ok, k)
			}
		}
	})
}
