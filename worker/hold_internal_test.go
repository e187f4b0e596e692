package worker

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// Held output is sent once it reaches maxHeldBytes, whatever the hold:
// a merged chunk stays far below the gRPC message limit.
func TestHeldOutputIsBoundedInSize(t *testing.T) {
	var sent []*stagepb.GenerateChunk
	emit, finish := newOutputHolder(&stagepb.GenerateRequest{HoldOutputMs: 1000}, func(c *stagepb.GenerateChunk) error {
		sent = append(sent, c)
		return nil
	})
	audio := make([]byte, maxHeldBytes*2/5)
	for range 5 {
		require.NoError(t, emit(&stagepb.GenerateChunk{AudioPcm16: audio, SampleRate: 24000}))
	}
	require.NoError(t, emit(&stagepb.GenerateChunk{FinishReason: stagepb.FinishReason_FINISH_REASON_STOP}))
	require.NoError(t, finish())

	require.Len(t, sent, 2, "three pieces reach the bound, the last two go with the final chunk")
	total, dated := 0, 0
	for _, c := range sent {
		assert.LessOrEqual(t, len(c.GetAudioPcm16()), maxHeldBytes+len(audio))
		total += len(c.GetAudioPcm16())
		dated += len(c.GetOutputAgesUs())
	}
	assert.Equal(t, 5*len(audio), total, "nothing lost")
	assert.Equal(t, 5, dated, "every output dated")
	assert.Equal(t, stagepb.FinishReason_FINISH_REASON_STOP, sent[1].GetFinishReason())
}

// A failed send is returned by the next emit, and finish reports it; the
// engine stops instead of feeding a dead stream.
func TestHeldOutputSendFailureStopsTheEngine(t *testing.T) {
	boom := assert.AnError
	emit, finish := newOutputHolder(&stagepb.GenerateRequest{HoldOutputMs: 1000}, func(*stagepb.GenerateChunk) error { return boom })
	require.NoError(t, emit(&stagepb.GenerateChunk{Text: "a"}), "held, not sent yet")
	require.ErrorIs(t, emit(&stagepb.GenerateChunk{Text: "b", FinishReason: stagepb.FinishReason_FINISH_REASON_STOP}), boom)
	require.ErrorIs(t, emit(&stagepb.GenerateChunk{Text: "c"}), boom)
	require.ErrorIs(t, finish(), boom)
}
