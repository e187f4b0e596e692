package sim

import (
	"encoding/binary"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/tokenizers"
)

func textRequest(text string, sp *stagepb.SamplingParams) *stagepb.GenerateRequest {
	return &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Text{Text: text}, Sampling: sp}
}

func codesRequest(c []uint32) *stagepb.GenerateRequest {
	return &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Codes{Codes: &stagepb.Codes{Codes: c}}}
}

func TestTokenize(t *testing.T) {
	assert.Equal(t, []uint32{tokenizers.SimBOS}, tokenizers.Sim(""))
	assert.Equal(t, []uint32{tokenizers.SimBOS, tokenizers.SimWordID("hello"), tokenizers.SimWordID("world")}, tokenizers.Sim("  hello\tworld\n"))
	assert.NotEqual(t, tokenizers.SimWordID("hello"), tokenizers.SimWordID("world"))
	for _, w := range vocabulary {
		id := tokenizers.SimWordID(w)
		assert.True(t, id > tokenizers.SimBOS && id < tokenizers.SimVocabSize, "id %d of %q out of range", id, w)
	}
}

func TestExpectedTextIsPure(t *testing.T) {
	a, n, f := ExpectedText("tell me a story", 7, 0)
	b, m, g := ExpectedText("tell me a story", 7, 0)
	assert.Equal(t, a, b)
	assert.Equal(t, n, m)
	assert.Equal(t, f, g)

	// Seeds and prompts change the output.
	distinct := map[string]bool{}
	for seed := range int64(8) {
		text, _, _ := ExpectedText("tell me a story", seed, 0)
		distinct[text] = true
	}
	assert.Greater(t, len(distinct), 4, "seeds should change the text")
	other, _, _ := ExpectedText("tell me a joke", 7, 0)
	assert.NotEqual(t, a, other)

	// Temperature does not matter.
	x, err := Expect(stagepb.RoleText, textRequest("tell me a story", &stagepb.SamplingParams{Seed: proto.Int64(7), Temperature: proto.Float32(1.7)}))
	require.NoError(t, err)
	assert.Equal(t, a, x.Text)

	// No seed means seed 0.
	zero, _, _ := ExpectedText("tell me a story", 0, 0)
	y, err := Expect(stagepb.RoleText, textRequest("tell me a story", nil))
	require.NoError(t, err)
	assert.Equal(t, zero, y.Text)
}

func TestExpectedTextLengths(t *testing.T) {
	for seed := range int64(50) {
		text, n, finish := ExpectedText("why is the sky blue", seed, 0)
		// Natural stop: 4..35 tokens, each one vocabulary word.
		require.Equal(t, stagepb.FinishReason_FINISH_REASON_STOP, finish)
		require.GreaterOrEqual(t, n, 4)
		require.LessOrEqual(t, n, 35)
		words := strings.Fields(text)
		require.Len(t, words, n)
		for _, w := range words {
			require.Contains(t, vocabulary[:], w)
		}

		// max_tokens below the natural length cuts it: finish length.
		short, m, f := ExpectedText("why is the sky blue", seed, 3)
		require.Equal(t, 3, m)
		require.Equal(t, stagepb.FinishReason_FINISH_REASON_LENGTH, f)
		require.Equal(t, strings.Join(words[:3], " "), short)

		// max_tokens equal to the natural length: EOS wins.
		_, m, f = ExpectedText("why is the sky blue", seed, n)
		require.Equal(t, n, m)
		require.Equal(t, stagepb.FinishReason_FINISH_REASON_STOP, f)

		// ignore_eos runs to max_tokens and extends the same text.
		out, err := Expect(stagepb.RoleText, textRequest("why is the sky blue", &stagepb.SamplingParams{Seed: proto.Int64(seed), MaxTokens: 50, IgnoreEos: true}))
		require.NoError(t, err)
		require.Equal(t, 50, out.GenerationTokens)
		require.Len(t, out.TokenIDs, 50)
		require.Equal(t, stagepb.FinishReason_FINISH_REASON_LENGTH, out.Finish)
		require.True(t, strings.HasPrefix(out.Text, text+" "), "ignore_eos output must extend the natural one")
	}
}

func TestStopStrings(t *testing.T) {
	full, err := Expect(stagepb.RoleText, textRequest("a long answer", &stagepb.SamplingParams{MaxTokens: 40, IgnoreEos: true}))
	require.NoError(t, err)
	words := strings.Fields(full.Text)
	// A stop string spanning two words, first found at its first occurrence.
	stop := words[5] + " " + words[6]
	at := strings.Index(full.Text, stop)
	out, err := Expect(stagepb.RoleText, textRequest("a long answer", &stagepb.SamplingParams{MaxTokens: 40, IgnoreEos: true, Stop: []string{"never there", stop}}))
	require.NoError(t, err)
	assert.Equal(t, full.Text[:at], out.Text)
	assert.Equal(t, stagepb.FinishReason_FINISH_REASON_STOP, out.Finish)
	// The token that completed the stop string is counted.
	completed := len(strings.Fields(full.Text[:at+len(stop)]))
	assert.Equal(t, completed, out.GenerationTokens)
	assert.Equal(t, full.TokenIDs[:completed], out.TokenIDs)

	// A stop string that never occurs changes nothing; empty ones are ignored.
	same, err := Expect(stagepb.RoleText, textRequest("a long answer", &stagepb.SamplingParams{MaxTokens: 40, IgnoreEos: true, Stop: []string{"", "zzz"}}))
	require.NoError(t, err)
	assert.Equal(t, full, same)
}

func TestExpectedCodes(t *testing.T) {
	codesA, f := ExpectedCodes("hello there world", 3, 0)
	codesB, _ := ExpectedCodes("hello there world", 3, 0)
	assert.Equal(t, codesA, codesB)
	assert.Equal(t, stagepb.FinishReason_FINISH_REASON_STOP, f)
	assert.Len(t, codesA, 2*len(tokenizers.Sim("hello there world")))
	for _, c := range codesA {
		assert.Less(t, c, CodebookSize)
	}
	short, f := ExpectedCodes("hello there world", 3, 5)
	assert.Equal(t, codesA[:5], short)
	assert.Equal(t, stagepb.FinishReason_FINISH_REASON_LENGTH, f)
	other, _ := ExpectedCodes("hello there world", 4, 0)
	assert.NotEqual(t, codesA, other)

	out, err := Expect(stagepb.RoleCodes, textRequest("hello there world", &stagepb.SamplingParams{Seed: proto.Int64(3)}))
	require.NoError(t, err)
	assert.Equal(t, codesA, out.Codes)
}

func TestExpectedAudioIsTones(t *testing.T) {
	codes := []uint32{0, 12, 24, 7, 1023}
	pcm := ExpectedAudio(codes)
	require.Len(t, pcm, len(codes)*SamplesPerCode*2)
	assert.Equal(t, pcm, ExpectedAudio(codes))
	for i, c := range codes {
		frame := pcm[i*SamplesPerCode*2 : (i+1)*SamplesPerCode*2]
		samples := make([]int16, SamplesPerCode)
		peak := 0.0
		for j := range samples {
			samples[j] = int16(binary.LittleEndian.Uint16(frame[2*j:]))
			peak = math.Max(peak, math.Abs(float64(samples[j])))
		}
		// A real sine at CodeFrequency: count zero crossings over the frame.
		crossings := 0
		for j := 1; j < len(samples); j++ {
			if (samples[j-1] < 0) != (samples[j] < 0) {
				crossings++
			}
		}
		want := 2 * CodeFrequency(c) * float64(SamplesPerCode) / SampleRate
		assert.InDelta(t, want, float64(crossings), 3, "code %d", c)
		assert.InDelta(t, 0.25*32767, peak, 400, "code %d amplitude", c)
	}
	assert.Equal(t, CodeFrequency(12), 2*CodeFrequency(0))

	out, err := Expect(stagepb.RoleAudio, codesRequest(codes))
	require.NoError(t, err)
	assert.Equal(t, pcm, out.Audio)
	assert.Equal(t, len(codes), out.GenerationTokens)
	assert.Equal(t, stagepb.FinishReason_FINISH_REASON_STOP, out.Finish)
}

func TestExpectRejectsWrongInput(t *testing.T) {
	cases := []struct {
		role string
		req  *stagepb.GenerateRequest
		msg  string
	}{
		{stagepb.RoleAudio, textRequest("hi", nil), "role audio takes codes input, got text"},
		{stagepb.RoleText, codesRequest([]uint32{1}), "role text takes text, chat or token_ids input, got codes"},
		{stagepb.RoleCodes, codesRequest([]uint32{1}), "role codes takes text, chat or token_ids input, got codes"},
		{stagepb.RoleAudio, codesRequest(nil), "empty codes"},
		{stagepb.RoleAudio, codesRequest([]uint32{CodebookSize}), "out of range"},
		{stagepb.RoleText, &stagepb.GenerateRequest{}, "no input"},
		{stagepb.RoleText, &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_TokenIds{TokenIds: &stagepb.TokenIds{}}}, "empty token_ids"},
	}
	for _, c := range cases {
		_, err := Expect(c.role, c.req)
		require.Error(t, err)
		assert.Equal(t, codes.InvalidArgument, status.Code(err))
		assert.Contains(t, err.Error(), c.msg)
	}
	// Token ids are a prompt like the text they tokenize to.
	ids := tokenizers.Sim("one two three")
	a, err := Expect(stagepb.RoleText, &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_TokenIds{TokenIds: &stagepb.TokenIds{Ids: ids}}})
	require.NoError(t, err)
	b, err := Expect(stagepb.RoleText, textRequest("one two three", nil))
	require.NoError(t, err)
	assert.Equal(t, b, a)
}

func TestRoles(t *testing.T) {
	assert.Equal(t, stagepb.RoleText, RoleForStage("thinker"))
	assert.Equal(t, stagepb.RoleCodes, RoleForStage("talker"))
	assert.Equal(t, stagepb.RoleAudio, RoleForStage("vocoder"))
	assert.Equal(t, stagepb.RoleText, RoleForStage("summarizer"))
	r, err := stagepb.ParseRole("audio")
	require.NoError(t, err)
	assert.Equal(t, stagepb.RoleAudio, r)
	_, err = stagepb.ParseRole("video")
	assert.ErrorContains(t, err, `unknown role "video"`)
}

func TestAcceptanceFallsWithPosition(t *testing.T) {
	const k = 4
	perPos := make([]int, k)
	for pos := range 2000 {
		a := acceptedDrafts(12345, 0, pos, k)
		require.LessOrEqual(t, a, k)
		for p := range a {
			perPos[p]++
		}
	}
	assert.True(t, slices.IsSortedFunc(perPos, func(a, b int) int { return b - a }), "per-position acceptance must not rise: %v", perPos)
	assert.InDelta(t, 1500, perPos[0], 150, "position 0 accepted about 3/4 of the time")
}
