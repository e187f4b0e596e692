package worker

import (
	"strings"
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

// segments counts the segments of units words (or to a sentence end) the
// next stage's segmenter can cut from text before the input ends.
func segments(text string, units int) int {
	n := 0
	for cut := textCut(text, units); cut > 0; cut = textCut(text, units) {
		text, n = text[cut:], n+1
	}
	return n
}

// With output_words_per_chunk the worker gathers text, yet never holds
// text the next stage could start a segment on: after every token, the
// text sent makes as many segments as all the text made so far. And it
// sends far fewer messages than tokens.
func TestHeldTextIsSentAsTheNextStageCanSegmentIt(t *testing.T) {
	const units = 4
	words := []string{"the", "quick", "brown", "fox", "jumps.", "over", "the", "lazy", "dog;", "and", "then", "it", "runs", "far", "far", "away", "into", "the", "night!", "end"}
	var sent strings.Builder
	messages := 0
	emit, finish := newOutputHolder(&stagepb.GenerateRequest{OutputWordsPerChunk: units}, func(c *stagepb.GenerateChunk) error {
		sent.WriteString(c.GetText())
		messages++
		return nil
	})
	var made strings.Builder
	tokens := 0
	for i, w := range words {
		// Two tokens a word: the word, then the space before the next.
		for _, tok := range []string{w, " "} {
			if i == len(words)-1 && tok == " " {
				break
			}
			require.NoError(t, emit(&stagepb.GenerateChunk{Text: tok}))
			made.WriteString(tok)
			tokens++
			assert.Equal(t, segments(made.String(), units), segments(sent.String(), units),
				"after %q: the next stage could cut a segment of held text", made.String())
		}
	}
	require.NoError(t, emit(&stagepb.GenerateChunk{FinishReason: stagepb.FinishReason_FINISH_REASON_STOP}))
	require.NoError(t, finish())
	assert.Equal(t, made.String(), sent.String(), "nothing lost")
	assert.Less(t, messages, tokens/3, "gathered: %d messages for %d tokens", messages, tokens)
}
