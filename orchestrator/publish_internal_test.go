package orchestrator

import (
	"errors"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"

	"github.com/troupe-serving/troupe/internal/core/router"
)

// TestPublishCopiesOnlyTheChangedRecord: the view is every record the loop
// knows, sorted by key, each an immutable copy taken by publish. Publishing
// one key copies that record only: the others stay the very copies readers
// already hold, and a change the loop has not published is not visible.
func TestPublishCopiesOnlyTheChangedRecord(t *testing.T) {
	h, err := New(nil, Config{
		Pipeline: DefaultPipeline(),
		Metrics:  prometheus.NewRegistry(),
		Dial:     func(string) (*grpc.ClientConn, error) { return nil, errors.New("not dialled in this test") },
	})
	require.NoError(t, err)
	var keys []router.Key
	for st := range len(h.cfg.Pipeline.Stages) {
		for r := range uint32(20) {
			keys = append(keys, router.Key{Stage: st, Replica: r + 1})
		}
	}
	rng := rand.New(rand.NewPCG(1, 2))
	rng.Shuffle(len(keys), func(i, j int) { keys[i], keys[j] = keys[j], keys[i] })

	published := map[router.Key]*tracked{} // the copy readers got for each key
	for i, k := range keys {
		changed := h.fleet.changed()
		h.fleet.known[k] = &tracked{key: k, index: i}
		h.fleet.publish(k)
		select {
		case <-changed:
		default:
			t.Fatalf("publish of %v did not wake the waiters", k)
		}
		view := slices.Collect(h.fleet.view.Load().All())
		require.Len(t, view, i+1)
		require.True(t, slices.IsSortedFunc(view, func(a, b *tracked) int { return compareKeys(a.key, b.key) }), "view sorted by key after %v", k)
		for _, e := range view {
			assert.Equal(t, h.fleet.known[e.key].index, e.index)
			assert.NotSame(t, h.fleet.known[e.key], e, "the view holds copies, not the loop's records")
			if p, ok := published[e.key]; ok {
				assert.Same(t, p, e, "publishing %v copied %v again", k, e.key)
			}
			published[e.key] = e
		}
	}

	k := keys[7]
	h.fleet.known[k].index = 1000 // a change on the loop, not published yet
	got, ok := h.fleet.lookup(k)
	require.True(t, ok)
	assert.Equal(t, 7, got.index, "an unpublished change is not visible")
	h.fleet.publish(k)
	got, ok = h.fleet.lookup(k)
	require.True(t, ok)
	assert.Equal(t, 1000, got.index)
	assert.Equal(t, len(keys), h.fleet.view.Load().Len(), "republishing a key replaces its record")
	assert.Equal(t, len(keys), h.Known(), "Known counts the published records")

	before := h.fleet.view.Load()
	changed := h.fleet.changed()
	h.fleet.publish(router.Key{Stage: 0, Replica: 99}) // an event for a key the head never tracked
	assert.Same(t, before, h.fleet.view.Load(), "nothing to copy")
	select {
	case <-changed:
	default:
		t.Fatal("publish of an untracked key did not wake the waiters")
	}
	_, ok = h.fleet.lookup(router.Key{Stage: 0, Replica: 99})
	assert.False(t, ok)
}

// TestBatchPublishesAtFlush: within a batch, publish only stages records:
// readers see none of the batch until flush publishes it whole, with one
// wake-up; an input for a key the batch already changed (before) publishes
// the batch first, so it sees its own key's earlier change published.
func TestBatchPublishesAtFlush(t *testing.T) {
	h, err := New(nil, Config{
		Pipeline: DefaultPipeline(),
		Metrics:  prometheus.NewRegistry(),
		Dial:     func(string) (*grpc.ClientConn, error) { return nil, errors.New("not dialled in this test") },
	})
	require.NoError(t, err)
	keys := []router.Key{{Stage: 0, Replica: 3}, {Stage: 0, Replica: 1}, {Stage: 1, Replica: 2}}
	changed := h.fleet.changed()
	h.fleet.begin()
	for i, k := range keys {
		h.fleet.known[k] = &tracked{key: k, index: i}
		h.fleet.publish(k)
	}
	assert.Zero(t, h.fleet.view.Load().Len(), "nothing published within the batch")
	select {
	case <-changed:
		t.Fatal("waiters woken before the batch was published")
	default:
	}
	h.fleet.before(keys[2]) // the batch changed it: published first
	require.Equal(t, 3, h.fleet.view.Load().Len())
	<-changed
	assert.True(t, h.fleet.batch.batching, "a new batch started")
	h.fleet.known[keys[2]].index = 100
	h.fleet.publish(keys[2])
	got, _ := h.fleet.lookup(keys[2])
	assert.Equal(t, 2, got.index, "the new batch is not published yet")
	h.fleet.before(keys[0]) // not changed in this batch: nothing published
	got, _ = h.fleet.lookup(keys[2])
	assert.Equal(t, 2, got.index)
	h.fleet.flush()
	got, _ = h.fleet.lookup(keys[2])
	assert.Equal(t, 100, got.index)
	assert.False(t, h.fleet.batch.batching)
	view := slices.Collect(h.fleet.view.Load().All())
	assert.True(t, slices.IsSortedFunc(view, func(a, b *tracked) int { return compareKeys(a.key, b.key) }))
}
