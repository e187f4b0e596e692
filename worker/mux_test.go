package worker_test

import (
	"errors"
	"io"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/sim"
)

// A worker serves Generate calls over Multiplex and says so in Health. A
// drained worker refuses new calls on the stream, lets the running one
// finish, then ends the stream itself (cleanly: the head learns the
// stream is over, and the worker need not wait for a grace period).
func TestMultiplexCallsFinishAndTheStreamEndsWhenTheWorkerStops(t *testing.T) {
	g := newGated(newSim(t, sim.Config{}))
	r := start(t, worker.Config{Stage: "thinker", Engine: g})
	r.waitRegistered(t)
	cli := dial(t, r.Advertise())
	h, err := cli.Health(testCtx(t), &stagepb.HealthRequest{})
	require.NoError(t, err)
	assert.True(t, h.GetMultiplex())

	mux, err := cli.Multiplex(testCtx(t))
	require.NoError(t, err)
	start := func(id uint64, text string) {
		req := textReq(text, &stagepb.SamplingParams{MaxTokens: 5, IgnoreEos: true})
		require.NoError(t, mux.Send(&stagepb.MuxFrame{Id: id, Request: req}))
	}
	start(1, "in flight")
	g.waitHeld(t)

	stopped := make(chan error, 1)
	go func() { stopped <- r.stop(t) }()
	r.requireDraining(t, cli)
	start(2, "too late")

	ends := map[uint64]*stagepb.MuxEnd{}
	var text string
	for ends[2] == nil { // the refusal comes while call 1 is held
		f, err := mux.Recv()
		require.NoError(t, err)
		if f.GetEnd() != nil {
			ends[f.GetId()] = f.GetEnd()
		}
	}
	assert.EqualValues(t, codes.Unavailable, ends[2].GetCode(), "a draining worker takes no new call: %v", ends[2])

	close(g.gate)
	for {
		f, err := mux.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err, "the worker ends the stream cleanly")
		switch {
		case f.GetEnd() != nil:
			ends[f.GetId()] = f.GetEnd()
		case f.GetId() == 1:
			text += f.GetChunk().GetText()
		}
	}
	require.NotNil(t, ends[1], "call 1 ended before the stream")
	assert.EqualValues(t, codes.OK, ends[1].GetCode())
	assert.NotEmpty(t, text)
	assert.NoError(t, <-stopped)
}
