package stagepb_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

func TestMergeChunkSaysWhatBothSaid(t *testing.T) {
	a := &stagepb.GenerateChunk{
		Text: "hello", TokenIds: []uint32{1, 2}, Codes: []uint32{7}, AudioPcm16: []byte{1, 0}, SampleRate: 16000,
		Stats: &stagepb.EngineStats{
			PromptTokens: 5, GenerationTokens: 2, PrefixCacheQueries: 5, PrefixCacheHits: 3,
			PromptTokensLocalCompute: 2, PromptTokensLocalCacheHit: 3, NumPreemptions: 1,
			SpecDecodeNumDrafts: 1, SpecDecodeNumDraftTokens: 2, SpecDecodeNumAcceptedTokens: 1,
			SpecDecodeNumAcceptedTokensPerPos: []uint64{1},
			PromptAudioTokens:                 2, PromptImageTokens: 1, PromptVideoTokens: 4,
			IterationTokens:    []uint32{5},
			NumRequestsRunning: 3, NumRequestsWaitingCapacity: 1, KvCacheUsagePerc: 0.5, GaugesAgeMs: 900,
		},
		KvEvents: &stagepb.KvEvents{Seq: 4, Stored: []uint64{10, 11}, Removed: []uint64{9}},
	}
	b := &stagepb.GenerateChunk{
		Text: " world", TokenIds: []uint32{3}, Codes: []uint32{8, 9}, AudioPcm16: []byte{2, 0}, SampleRate: 16000,
		FinishReason: stagepb.FinishReason_FINISH_REASON_LENGTH,
		Timings:      &stagepb.Timings{QueueSeconds: 1, PrefillSeconds: 2, DecodeSeconds: 3},
		Stats: &stagepb.EngineStats{
			GenerationTokens: 1, SpecDecodeNumAcceptedTokensPerPos: []uint64{2, 1}, PromptAudioTokens: 1,
			IterationTokens: []uint32{1}, NumRequestsRunning: 1, KvCacheUsagePerc: 0.25, GaugesAgeMs: 7,
		},
		KvEvents: &stagepb.KvEvents{Seq: 5, Stored: []uint64{9, 12}, Removed: []uint64{10}},
	}
	bCopy := proto.Clone(b).(*stagepb.GenerateChunk)
	dst := &stagepb.GenerateChunk{}
	stagepb.MergeChunk(dst, a)
	stagepb.MergeChunk(dst, b)

	want := &stagepb.GenerateChunk{
		Text: "hello world", TokenIds: []uint32{1, 2, 3}, Codes: []uint32{7, 8, 9}, AudioPcm16: []byte{1, 0, 2, 0}, SampleRate: 16000,
		FinishReason: stagepb.FinishReason_FINISH_REASON_LENGTH,
		Timings:      &stagepb.Timings{QueueSeconds: 1, PrefillSeconds: 2, DecodeSeconds: 3},
		Stats: &stagepb.EngineStats{
			PromptTokens: 5, GenerationTokens: 3, PrefixCacheQueries: 5, PrefixCacheHits: 3,
			PromptTokensLocalCompute: 2, PromptTokensLocalCacheHit: 3, NumPreemptions: 1,
			SpecDecodeNumDrafts: 1, SpecDecodeNumDraftTokens: 2, SpecDecodeNumAcceptedTokens: 1,
			SpecDecodeNumAcceptedTokensPerPos: []uint64{3, 1},
			IterationTokens:                   []uint32{5, 1},
			PromptAudioTokens:                 3, PromptImageTokens: 1, PromptVideoTokens: 4,
			// the engine's snapshot is the later one, whole
			NumRequestsRunning: 1, KvCacheUsagePerc: 0.25, GaugesAgeMs: 7,
		},
		// 10 was stored, then evicted; 9 was evicted, then stored again
		KvEvents: &stagepb.KvEvents{Seq: 5, Stored: []uint64{11, 9, 12}, Removed: []uint64{10}},
	}
	assert.True(t, proto.Equal(want, dst), "got %v", dst)
	assert.True(t, proto.Equal(bCopy, b), "src is not changed")

	// dst owns its slices: changing it leaves both sources alone.
	dst.TokenIds[0], dst.Stats.SpecDecodeNumAcceptedTokensPerPos[0], dst.KvEvents.Stored[0] = 99, 99, 99
	assert.Equal(t, uint32(1), a.TokenIds[0])
	assert.Equal(t, uint64(1), a.Stats.SpecDecodeNumAcceptedTokensPerPos[0])
	assert.Equal(t, uint64(10), a.KvEvents.Stored[0])
}

func TestMergeChunkClearedCacheReplacesEarlierEvents(t *testing.T) {
	dst := &stagepb.GenerateChunk{}
	stagepb.MergeChunk(dst, &stagepb.GenerateChunk{KvEvents: &stagepb.KvEvents{Seq: 1, Stored: []uint64{1, 2}, Removed: []uint64{3}}})
	stagepb.MergeChunk(dst, &stagepb.GenerateChunk{KvEvents: &stagepb.KvEvents{Seq: 2, Cleared: true, Stored: []uint64{4}}})
	require.NotNil(t, dst.KvEvents)
	assert.True(t, proto.Equal(&stagepb.KvEvents{Seq: 2, Cleared: true, Stored: []uint64{4}}, dst.KvEvents), "got %v", dst.KvEvents)
	assert.Nil(t, dst.Stats, "no stats in, none out")
}

func TestHasOutput(t *testing.T) {
	assert.False(t, stagepb.HasOutput(&stagepb.GenerateChunk{Stats: &stagepb.EngineStats{PromptTokens: 1}}))
	assert.False(t, stagepb.HasOutput(nil))
	for _, c := range []*stagepb.GenerateChunk{{Text: "a"}, {TokenIds: []uint32{1}}, {Codes: []uint32{1}}, {AudioPcm16: []byte{0, 0}}} {
		assert.True(t, stagepb.HasOutput(c), "%v", c)
	}
}

// TestMergeChunkAddsEveryCounter: every singular uint64 field of
// EngineStats is a per-request delta, so merging adds it; a field added to
// the proto and forgotten in mergeStats fails here (mm_cache_* were).
func TestMergeChunkAddsEveryCounter(t *testing.T) {
	a, b := &stagepb.EngineStats{}, &stagepb.EngineStats{}
	fields := a.ProtoReflect().Descriptor().Fields()
	var counters []protoreflect.FieldDescriptor
	for i := range fields.Len() {
		fd := fields.Get(i)
		if fd.Kind() == protoreflect.Uint64Kind && fd.Cardinality() != protoreflect.Repeated {
			counters = append(counters, fd)
			a.ProtoReflect().Set(fd, protoreflect.ValueOfUint64(1))
			b.ProtoReflect().Set(fd, protoreflect.ValueOfUint64(2))
		}
	}
	require.NotEmpty(t, counters)
	dst := &stagepb.GenerateChunk{}
	stagepb.MergeChunk(dst, &stagepb.GenerateChunk{Stats: a})
	stagepb.MergeChunk(dst, &stagepb.GenerateChunk{Stats: b})
	for _, fd := range counters {
		assert.Equal(t, uint64(3), dst.GetStats().ProtoReflect().Get(fd).Uint(), "%s is added", fd.Name())
	}
}
