// Package registry gives every stage replica the head has ever seen an engine
// index.
//
// An engine index is the head's name for one (stage, replica) pair. It is
// stable for the key forever (a replica that leaves and rejoins keeps it),
// unique across all stages, and dense from 0 in first-attach order. Other
// per-replica tables of the head (the Prometheus children of package stats,
// the router) are arrays indexed by it.
//
// Concurrency: a Registry is written only by the head's event loop goroutine
// (Attach, AttachAt) and is not safe for concurrent use. Other goroutines read
// an immutable *Snapshot taken by the loop and published, for example through
// an atomic.Pointer.
package registry

import (
	"errors"
	"fmt"
	"strconv"
)

// MaxIndex is the largest engine index the head hands out. Per-index tables
// (package stats) are sized for it; Attach fails once it is reached.
const MaxIndex = 1<<20 - 1

// ErrConflict is returned (wrapped) when a key or an index is already bound
// to something else. Nothing is overwritten.
var ErrConflict = errors.New("registry: conflict")

// Key names one replica: the stage's index in the pipeline and the replica
// id the worker registered under.
type Key struct {
	Stage   int
	Replica uint32
}

// String renders the key as "stage/replica", e.g. "0/3".
func (k Key) String() string {
	return strconv.Itoa(k.Stage) + "/" + strconv.FormatUint(uint64(k.Replica), 10)
}

func (k Key) validate() error {
	if k.Stage < 0 {
		return fmt.Errorf("registry: negative stage index %d in key %s", k.Stage, k)
	}
	return nil
}

// slot is one index of the table; bound is false for holes left by AttachAt.
type slot struct {
	key   Key
	bound bool
}

// Registry maps keys to engine indices and back. The zero value is not
// usable; call New. See the package comment for who may call what.
type Registry struct {
	byKey map[Key]int
	slots []slot // index -> key; len(slots) is the next index Attach hands out
	n     int    // number of bound slots
}

// New returns an empty registry: a head with no replicas.
func New() *Registry {
	return &Registry{byKey: make(map[Key]int)}
}

// Attach returns the engine index of k, giving it the next index if k has
// never been attached. It is idempotent: a key that rejoins keeps its index.
// It fails only for an invalid key or when MaxIndex is exhausted.
func (r *Registry) Attach(k Key) (int, error) {
	if err := k.validate(); err != nil {
		return -1, err
	}
	if idx, ok := r.byKey[k]; ok {
		return idx, nil
	}
	idx := len(r.slots)
	if idx > MaxIndex {
		return -1, fmt.Errorf("registry: cannot attach %s: all %d engine indices are in use", k, MaxIndex+1)
	}
	r.slots = append(r.slots, slot{key: k, bound: true})
	r.byKey[k] = idx
	r.n++
	return idx, nil
}

// AttachAt binds k to a chosen index, for rebuilding a registry from a record
// of earlier assignments. Binding a key again to its own index is a no-op.
// Reusing an index for a different key, or moving a key to another index, is
// rejected with an error wrapping ErrConflict; nothing is overwritten.
//
// Indices skipped over stay free: AttachAt may fill them later, while Attach
// always continues after the highest index bound so far.
func (r *Registry) AttachAt(k Key, index int) error {
	if err := k.validate(); err != nil {
		return err
	}
	if index < 0 || index > MaxIndex {
		return fmt.Errorf("registry: engine index %d out of range 0..%d", index, MaxIndex)
	}
	if have, ok := r.byKey[k]; ok {
		if have == index {
			return nil
		}
		return fmt.Errorf("%w: replica %s already has engine index %d, not %d", ErrConflict, k, have, index)
	}
	if index < len(r.slots) && r.slots[index].bound {
		return fmt.Errorf("%w: engine index %d already belongs to replica %s, not %s", ErrConflict, index, r.slots[index].key, k)
	}
	for len(r.slots) <= index {
		r.slots = append(r.slots, slot{})
	}
	r.slots[index] = slot{key: k, bound: true}
	r.byKey[k] = index
	r.n++
	return nil
}

// Lookup returns the engine index of k, if it was ever attached.
func (r *Registry) Lookup(k Key) (int, bool) {
	idx, ok := r.byKey[k]
	return idx, ok
}

// Key returns the key bound to an engine index. Out-of-range indices and
// holes report false.
func (r *Registry) Key(index int) (Key, bool) {
	if index < 0 || index >= len(r.slots) || !r.slots[index].bound {
		return Key{}, false
	}
	return r.slots[index].key, true
}

// Len is the number of keys attached.
func (r *Registry) Len() int { return r.n }

// Snapshot returns an immutable copy that any goroutine may read. It costs
// O(number of indices); take one per membership change, not per request.
func (r *Registry) Snapshot() *Snapshot {
	s := &Snapshot{
		byKey: make(map[Key]int, len(r.byKey)),
		slots: make([]slot, len(r.slots)),
		n:     r.n,
	}
	for k, v := range r.byKey {
		s.byKey[k] = v
	}
	copy(s.slots, r.slots)
	return s
}

// Snapshot is a read-only view of a Registry at one moment. It is safe for
// concurrent use and never changes.
type Snapshot struct {
	byKey map[Key]int
	slots []slot
	n     int
}

// Lookup returns the engine index of k at the time of the snapshot.
func (s *Snapshot) Lookup(k Key) (int, bool) {
	idx, ok := s.byKey[k]
	return idx, ok
}

// Key returns the key bound to an engine index at the time of the snapshot.
func (s *Snapshot) Key(index int) (Key, bool) {
	if index < 0 || index >= len(s.slots) || !s.slots[index].bound {
		return Key{}, false
	}
	return s.slots[index].key, true
}

// Len is the number of keys attached at the time of the snapshot.
func (s *Snapshot) Len() int { return s.n }
