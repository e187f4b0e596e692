package worker_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/sim"
)

// TestSubscribeCache: a subscriber gets the engine's snapshot, then every
// report its chunks carry, seq after seq; a later subscriber's snapshot
// holds the blocks reported so far. Health declares the capability.
func TestSubscribeCache(t *testing.T) {
	r := start(t, worker.Config{Stage: "thinker", Engine: newSim(t, sim.Config{})})
	r.waitRegistered(t)
	ctx := testCtx(t)
	cli := dial(t, r.Advertise())
	h, err := cli.Health(ctx, &stagepb.HealthRequest{})
	require.NoError(t, err)
	assert.True(t, h.GetCacheSubscription())

	sub, err := cli.SubscribeCache(ctx, &stagepb.SubscribeCacheRequest{})
	require.NoError(t, err)
	snap, err := sub.Recv()
	require.NoError(t, err)
	assert.True(t, snap.GetSnapshot())
	assert.True(t, snap.GetCleared())
	assert.Empty(t, snap.GetStored(), "a fresh engine holds nothing")

	stream, err := cli.Generate(ctx, textReq(strings.Repeat("the quick brown fox jumps over the lazy dog ", 20), nil))
	require.NoError(t, err)
	chunks, err := recvAll(stream)
	require.NoError(t, err)
	held := map[uint64]bool{}
	var onChunks []*stagepb.KvEvents
	for _, c := range chunks {
		if ev := c.GetKvEvents(); ev != nil {
			onChunks = append(onChunks, ev)
		}
	}
	require.NotEmpty(t, onChunks, "the prompt fills blocks, so the engine reports them")
	seq := snap.GetSeq()
	for _, want := range onChunks {
		ev, err := sub.Recv()
		require.NoError(t, err)
		assert.Equal(t, seq+1, ev.GetSeq(), "seq numbers follow on without a gap")
		seq = ev.GetSeq()
		assert.Equal(t, want.GetStored(), ev.GetStored())
		assert.Equal(t, want.GetRemoved(), ev.GetRemoved())
		for _, b := range ev.GetStored() {
			held[b] = true
		}
		for _, b := range ev.GetRemoved() {
			delete(held, b)
		}
	}
	require.NotEmpty(t, held)

	late, err := cli.SubscribeCache(ctx, &stagepb.SubscribeCacheRequest{})
	require.NoError(t, err)
	snap2, err := late.Recv()
	require.NoError(t, err)
	assert.True(t, snap2.GetSnapshot())
	assert.Equal(t, seq, snap2.GetSeq())
	got := map[uint64]bool{}
	for _, b := range snap2.GetStored() {
		got[b] = true
	}
	assert.Equal(t, held, got, "the snapshot holds what the reports said")
}

// TestSubscribeCacheUnimplemented: an engine that does not report its
// cache does not serve the subscription, and Health says so.
func TestSubscribeCacheUnimplemented(t *testing.T) {
	r := start(t, worker.Config{Stage: "thinker", Engine: newSim(t, sim.Config{DisablePrefixCaching: true})})
	r.waitRegistered(t)
	ctx := testCtx(t)
	cli := dial(t, r.Advertise())
	h, err := cli.Health(ctx, &stagepb.HealthRequest{})
	require.NoError(t, err)
	assert.False(t, h.GetCacheSubscription())
	sub, err := cli.SubscribeCache(ctx, &stagepb.SubscribeCacheRequest{})
	require.NoError(t, err)
	_, err = sub.Recv()
	assert.Equal(t, codes.Unimplemented, status.Code(err))
}
