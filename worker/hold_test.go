package worker_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/sim"
)

// concat is what a stream's chunks say one after the other.
func concat(chunks []*stagepb.GenerateChunk) sim.Output {
	var got sim.Output
	for _, ch := range chunks {
		got.Text += ch.GetText()
		got.TokenIDs = append(got.TokenIDs, ch.GetTokenIds()...)
		got.Codes = append(got.Codes, ch.GetCodes()...)
		got.Audio = append(got.Audio, ch.GetAudioPcm16()...)
		got.GenerationTokens += int(ch.GetStats().GetGenerationTokens())
	}
	got.Finish = chunks[len(chunks)-1].GetFinishReason()
	return got
}

// A request that asks for held output gets the same answer in fewer
// messages, each output dated by its age; the final chunk is among them.
func TestHeldOutputIsMergedAndDated(t *testing.T) {
	for _, c := range []struct {
		stage string
		req   *stagepb.GenerateRequest
	}{
		{"thinker", textReq("hold this answer for me", &stagepb.SamplingParams{Seed: proto.Int64(3), MaxTokens: 24, IgnoreEos: true})},
		{"talker", textReq("say this out loud please", nil)},
		{"vocoder", &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Codes{Codes: &stagepb.Codes{Codes: []uint32{5, 6, 7, 8, 9, 10}}}}},
	} {
		t.Run(c.stage, func(t *testing.T) {
			role := sim.RoleForStage(c.stage)
			r := start(t, worker.Config{Stage: c.stage, Engine: newSim(t, sim.Config{Role: role})})
			r.waitRegistered(t)
			cli := dial(t, r.Advertise())

			stream, err := cli.Generate(testCtx(t), c.req)
			require.NoError(t, err)
			plain, err := recvAll(stream)
			require.NoError(t, err)

			held := proto.Clone(c.req).(*stagepb.GenerateRequest)
			held.HoldOutputMs = 1000 // longer than the whole answer takes at zero delay
			stream, err = cli.Generate(testCtx(t), held)
			require.NoError(t, err)
			merged, err := recvAll(stream)
			require.NoError(t, err)

			want, err := sim.Expect(role, c.req)
			require.NoError(t, err)
			assert.Equal(t, want, concat(plain))
			assert.Equal(t, want, concat(merged))
			require.Greater(t, len(plain), 2, "the plain stream must have several outputs for the test to mean anything")
			assert.Less(t, len(merged), len(plain), "held output comes in fewer messages")
			assert.NotNil(t, merged[len(merged)-1].GetTimings())

			outputs := 0
			for _, ch := range plain {
				if stagepb.HasOutput(ch) {
					outputs++
				}
				assert.Empty(t, ch.GetOutputAgesUs(), "output that is not held carries no ages")
			}
			dated := 0
			for _, ch := range merged {
				ages := ch.GetOutputAgesUs()
				dated += len(ages)
				for i := 1; i < len(ages); i++ {
					assert.LessOrEqual(t, ages[i], ages[i-1], "outputs are in order, so the later is younger")
				}
			}
			assert.Equal(t, outputs, dated, "every output is dated once")
		})
	}
}

// Held output is sent within the hold even while the engine is still
// working: the flush does not wait for the next output or the end.
func TestHeldOutputIsSentWithinTheHold(t *testing.T) {
	g := newGated(newSim(t, sim.Config{Role: stagepb.RoleText}))
	r := start(t, worker.Config{Stage: "thinker", Engine: g})
	r.waitRegistered(t)
	cli := dial(t, r.Advertise())
	req := textReq("wait for the gate", &stagepb.SamplingParams{MaxTokens: 8, IgnoreEos: true})
	req.HoldOutputMs = 20
	ctx := testCtx(t)
	stream, err := cli.Generate(ctx, req)
	require.NoError(t, err)
	g.waitHeld(t) // the engine made its first output and now waits

	first, err := stream.Recv() // arrives although the engine is blocked
	require.NoError(t, err)
	require.True(t, stagepb.HasOutput(first))
	require.Len(t, first.GetOutputAgesUs(), 1)
	assert.GreaterOrEqual(t, time.Duration(first.GetOutputAgesUs()[0])*time.Microsecond, 20*time.Millisecond,
		"sent by the timer, a hold after the output was made")
	assert.Equal(t, stagepb.FinishReason_FINISH_REASON_UNSPECIFIED, first.GetFinishReason())

	close(g.gate)
	rest, err := recvAll(stream)
	require.NoError(t, err)
	want, err := sim.Expect(stagepb.RoleText, req)
	require.NoError(t, err)
	assert.Equal(t, want, concat(append([]*stagepb.GenerateChunk{first}, rest...)))
}

// A talker whose codes go to a vocoder that runs segments of 10 codes
// sends them 10 or more at a time: the vocoder could not start on fewer.
// The answer is the same, every output dated once.
func TestCodesAreSentPerNextSegment(t *testing.T) {
	r := start(t, worker.Config{Stage: "talker", Engine: newSim(t, sim.Config{Role: stagepb.RoleCodes})})
	r.waitRegistered(t)
	cli := dial(t, r.Advertise())
	req := textReq("a sentence long enough to make many codes for the vocoder to speak", nil)
	req.OutputCodesPerChunk = stagepb.DefaultSegmentCodes
	stream, err := cli.Generate(testCtx(t), req)
	require.NoError(t, err)
	chunks, err := recvAll(stream)
	require.NoError(t, err)

	want, err := sim.Expect(stagepb.RoleCodes, req)
	require.NoError(t, err)
	require.Greater(t, len(want.Codes), 2*stagepb.DefaultSegmentCodes, "enough codes for several segments")
	assert.Equal(t, want, concat(chunks))
	outputs := 0
	for i, ch := range chunks {
		if i < len(chunks)-1 {
			assert.GreaterOrEqual(t, len(ch.GetCodes()), stagepb.DefaultSegmentCodes, "chunk %d holds a whole segment", i)
		}
		outputs += len(ch.GetOutputAgesUs())
	}
	assert.Less(t, len(chunks), len(want.Codes)/stagepb.DefaultSegmentCodes+2)
	assert.Positive(t, outputs)
}
