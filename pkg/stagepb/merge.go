package stagepb

// MergeChunk appends src, the chunk that follows dst in a stream, to dst,
// so that dst says what the two said one after the other (the worker holds
// output this way; see GenerateRequest.hold_output_ms):
//
//   - output (text, token ids, codes, audio) is concatenated; the sample
//     rate, finish reason and timings of src win when set;
//   - stats: the per-request deltas are added (spec-decode positions
//     element by element, iteration_tokens appended), the engine snapshot
//     fields are src's when src has stats;
//   - KV events are merged into one report with src's seq: blocks src
//     removed are no longer stored and vice versa, and a src that cleared
//     the cache replaces what dst reported;
//   - output_ages_us are left to the caller: they are relative to the
//     moment the merged chunk is sent.
//
// dst must be owned by the caller; src is not changed and shares nothing
// with dst afterwards except immutable strings.
func MergeChunk(dst, src *GenerateChunk) {
	dst.Text += src.Text
	dst.TokenIds = append(dst.TokenIds, src.TokenIds...)
	dst.Codes = append(dst.Codes, src.Codes...)
	dst.AudioPcm16 = append(dst.AudioPcm16, src.AudioPcm16...)
	if src.SampleRate != 0 {
		dst.SampleRate = src.SampleRate
	}
	if src.FinishReason != FinishReason_FINISH_REASON_UNSPECIFIED {
		dst.FinishReason = src.FinishReason
	}
	if src.Timings != nil {
		dst.Timings = &Timings{QueueSeconds: src.Timings.QueueSeconds, PrefillSeconds: src.Timings.PrefillSeconds, DecodeSeconds: src.Timings.DecodeSeconds}
	}
	if src.Stats != nil {
		if dst.Stats == nil {
			dst.Stats = &EngineStats{}
		}
		mergeStats(dst.Stats, src.Stats)
	}
	if src.KvEvents != nil {
		if dst.KvEvents == nil {
			dst.KvEvents = &KvEvents{}
		}
		mergeKVEvents(dst.KvEvents, src.KvEvents)
	}
}

// HasOutput reports whether c carries output: text, token ids, codes or
// audio.
func HasOutput(c *GenerateChunk) bool {
	return c.GetText() != "" || len(c.GetCodes()) > 0 || len(c.GetAudioPcm16()) > 0 || len(c.GetTokenIds()) > 0
}

// OutputBytes is about what c's output takes: its bytes of text and
// audio, 4 per code or token id. Holders and queues of output bound
// themselves by it.
func OutputBytes(c *GenerateChunk) int {
	return len(c.GetText()) + len(c.GetAudioPcm16()) + 4*(len(c.GetCodes())+len(c.GetTokenIds()))
}

func mergeStats(d, s *EngineStats) {
	d.PromptTokens += s.PromptTokens
	d.GenerationTokens += s.GenerationTokens
	d.PrefixCacheQueries += s.PrefixCacheQueries
	d.PrefixCacheHits += s.PrefixCacheHits
	d.PromptTokensLocalCompute += s.PromptTokensLocalCompute
	d.PromptTokensLocalCacheHit += s.PromptTokensLocalCacheHit
	d.PromptTokensExternalKvTransfer += s.PromptTokensExternalKvTransfer
	d.PromptAudioTokens += s.PromptAudioTokens
	d.PromptImageTokens += s.PromptImageTokens
	d.PromptVideoTokens += s.PromptVideoTokens
	d.MmCacheQueries += s.MmCacheQueries
	d.MmCacheHits += s.MmCacheHits
	d.NumPreemptions += s.NumPreemptions
	d.SpecDecodeNumDrafts += s.SpecDecodeNumDrafts
	d.SpecDecodeNumDraftTokens += s.SpecDecodeNumDraftTokens
	d.SpecDecodeNumAcceptedTokens += s.SpecDecodeNumAcceptedTokens
	for i, v := range s.SpecDecodeNumAcceptedTokensPerPos {
		if i < len(d.SpecDecodeNumAcceptedTokensPerPos) {
			d.SpecDecodeNumAcceptedTokensPerPos[i] += v
		} else {
			d.SpecDecodeNumAcceptedTokensPerPos = append(d.SpecDecodeNumAcceptedTokensPerPos, v)
		}
	}
	d.IterationTokens = append(d.IterationTokens, s.IterationTokens...)
	d.NumRequestsRunning = s.NumRequestsRunning
	d.NumRequestsWaitingCapacity = s.NumRequestsWaitingCapacity
	d.NumRequestsWaitingDeferred = s.NumRequestsWaitingDeferred
	d.KvCacheUsagePerc = s.KvCacheUsagePerc
	d.GaugesAgeMs = s.GaugesAgeMs
}

func mergeKVEvents(d, s *KvEvents) {
	if s.Seq > d.Seq {
		d.Seq = s.Seq
	}
	if s.Cleared {
		d.Cleared = true
		d.Stored = append(d.Stored[:0], s.Stored...)
		d.Removed = append(d.Removed[:0], s.Removed...)
		return
	}
	d.Stored = append(without(d.Stored, s.Removed), s.Stored...)
	d.Removed = append(without(d.Removed, s.Stored), s.Removed...)
}

// without returns hashes less those in drop, reusing hashes' array.
func without(hashes, drop []uint64) []uint64 {
	if len(drop) == 0 || len(hashes) == 0 {
		return hashes
	}
	gone := make(map[uint64]struct{}, len(drop))
	for _, h := range drop {
		gone[h] = struct{}{}
	}
	kept := hashes[:0]
	for _, h := range hashes {
		if _, ok := gone[h]; !ok {
			kept = append(kept, h)
		}
	}
	return kept
}
