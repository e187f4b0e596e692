package worker_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
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

// TestSubscribeRoutedBlocks: every worker, whatever its engine (here one
// that does not report its cache), publishes the head-side blocks heads
// send with their requests to its routed subscribers: a snapshot of the
// recent ones, then one report per request, seq after seq; a later
// subscriber's snapshot holds them; a sleep at level 2 clears them.
func TestSubscribeRoutedBlocks(t *testing.T) {
	r := start(t, worker.Config{Stage: "thinker", Engine: newSim(t, sim.Config{DisablePrefixCaching: true})})
	r.waitRegistered(t)
	ctx := testCtx(t)
	cli := dial(t, r.Advertise())
	h, err := cli.Health(ctx, &stagepb.HealthRequest{})
	require.NoError(t, err)
	assert.True(t, h.GetRoutedSubscription())
	assert.False(t, h.GetCacheSubscription())

	sub, err := cli.SubscribeCache(ctx, &stagepb.SubscribeCacheRequest{Routed: true})
	require.NoError(t, err)
	snap, err := sub.Recv()
	require.NoError(t, err)
	assert.True(t, snap.GetSnapshot())
	assert.True(t, snap.GetRouted())
	assert.False(t, snap.GetCleared(), "a routed snapshot adds to what a head guessed")
	assert.Empty(t, snap.GetStored())

	seq := snap.GetSeq()
	for _, blocks := range [][]uint64{{11, 12, 13}, {21, 22}} {
		req := textReq("hello there", nil)
		req.RoutedBlocks = blocks
		stream, err := cli.Generate(ctx, req)
		require.NoError(t, err)
		_, err = recvAll(stream)
		require.NoError(t, err)
		ev, err := sub.Recv()
		require.NoError(t, err)
		assert.Equal(t, seq+1, ev.GetSeq(), "seq numbers follow on without a gap")
		seq = ev.GetSeq()
		assert.True(t, ev.GetRouted())
		assert.False(t, ev.GetSnapshot())
		assert.Equal(t, blocks, ev.GetStored())
	}
	// A request without blocks publishes nothing: the next report is the
	// clear below.
	stream, err := cli.Generate(ctx, textReq("no blocks", nil))
	require.NoError(t, err)
	_, err = recvAll(stream)
	require.NoError(t, err)

	late, err := cli.SubscribeCache(ctx, &stagepb.SubscribeCacheRequest{Routed: true})
	require.NoError(t, err)
	snap2, err := late.Recv()
	require.NoError(t, err)
	assert.True(t, snap2.GetSnapshot())
	assert.Equal(t, seq, snap2.GetSeq())
	assert.Equal(t, []uint64{11, 12, 13, 21, 22}, snap2.GetStored(), "the history, oldest first")

	_, err = cli.Sleep(ctx, &stagepb.SleepRequest{Level: 2})
	require.NoError(t, err)
	for _, s := range []grpc.ServerStreamingClient[stagepb.KvEvents]{sub, late} {
		ev, err := s.Recv()
		require.NoError(t, err)
		assert.Equal(t, seq+1, ev.GetSeq())
		assert.True(t, ev.GetCleared(), "the cache is gone: so are the blocks routed here")
		assert.Empty(t, ev.GetStored())
	}
}
