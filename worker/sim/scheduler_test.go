package sim

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/tokenizers"
)

// driver steps a scheduler by hand, so scheduling decisions can be checked
// one step at a time.
type driver struct {
	t      *testing.T
	sc     *scheduler
	now    time.Time
	chunks map[*seq][]*stagepb.GenerateChunk
}

func newDriver(t *testing.T, cfg Config) *driver {
	return &driver{t: t, sc: newScheduler(cfg.withDefaults()), now: time.Unix(1000, 0), chunks: map[*seq][]*stagepb.GenerateChunk{}}
}

func (d *driver) add(text string, sp *stagepb.SamplingParams) *seq {
	d.t.Helper()
	req := textRequest(text, sp)
	prompt, ctxLen, err := promptOf(d.sc.cfg.Role, req)
	require.NoError(d.t, err)
	p := paramsOf(sp)
	s := newSeq(text, d.sc.cfg.Role, prompt, buildPlan(d.sc.cfg.Role, prompt, ctxLen, p), p.seed)
	d.sc.add(s, d.now)
	return s
}

func (d *driver) schedule() *batch {
	d.now = d.now.Add(time.Millisecond)
	return d.sc.schedule(d.now)
}

func (d *driver) complete(b *batch) {
	d.now = d.now.Add(time.Millisecond)
	for _, o := range d.sc.complete(b, d.now) {
		d.chunks[o.seq] = append(d.chunks[o.seq], o.chunk)
	}
}

func (d *driver) step() Snapshot {
	d.complete(d.schedule())
	return d.sc.snapshot()
}

// runAll steps until every request finished, calling check after each step.
func (d *driver) runAll(check func(Snapshot)) {
	d.t.Helper()
	for i := 0; d.sc.busy(); i++ {
		require.Less(d.t, i, 10000, "scheduler made no progress")
		b := d.schedule()
		if check != nil {
			check(d.sc.snapshot())
		}
		d.complete(b)
	}
}

// sums adds up the per-request counters of a request's chunks.
func sums(chunks []*stagepb.GenerateChunk) *stagepb.EngineStats {
	t := &stagepb.EngineStats{}
	for _, c := range chunks {
		s := c.GetStats()
		t.PromptTokens += s.GetPromptTokens()
		t.GenerationTokens += s.GetGenerationTokens()
		t.PrefixCacheQueries += s.GetPrefixCacheQueries()
		t.PrefixCacheHits += s.GetPrefixCacheHits()
		t.PromptTokensLocalCompute += s.GetPromptTokensLocalCompute()
		t.PromptTokensLocalCacheHit += s.GetPromptTokensLocalCacheHit()
		t.PromptAudioTokens += s.GetPromptAudioTokens()
		t.PromptImageTokens += s.GetPromptImageTokens()
		t.PromptVideoTokens += s.GetPromptVideoTokens()
		t.MmCacheQueries += s.GetMmCacheQueries()
		t.MmCacheHits += s.GetMmCacheHits()
		t.NumPreemptions += s.GetNumPreemptions()
		t.SpecDecodeNumDrafts += s.GetSpecDecodeNumDrafts()
		t.SpecDecodeNumDraftTokens += s.GetSpecDecodeNumDraftTokens()
		t.SpecDecodeNumAcceptedTokens += s.GetSpecDecodeNumAcceptedTokens()
		for p, v := range s.GetSpecDecodeNumAcceptedTokensPerPos() {
			for len(t.SpecDecodeNumAcceptedTokensPerPos) <= p {
				t.SpecDecodeNumAcceptedTokensPerPos = append(t.SpecDecodeNumAcceptedTokensPerPos, 0)
			}
			t.SpecDecodeNumAcceptedTokensPerPos[p] += v
		}
		t.IterationTokens = append(t.IterationTokens, s.GetIterationTokens()...)
	}
	return t
}

func text(chunks []*stagepb.GenerateChunk) string {
	var b strings.Builder
	for _, c := range chunks {
		b.WriteString(c.GetText())
	}
	return b.String()
}

func TestPreemptionWhenKVPoolIsFull(t *testing.T) {
	// 8 blocks of 4 tokens; each request grows to 4+20 tokens = 6 blocks.
	d := newDriver(t, Config{NumKVBlocks: 8, BlockSize: 4})
	sp := &stagepb.SamplingParams{MaxTokens: 20, IgnoreEos: true}
	a := d.add("one two three", sp)
	b := d.add("four five six", sp)
	sawBothRunning, sawCapacityWait := false, false
	d.runAll(func(s Snapshot) {
		assert.LessOrEqual(t, s.KVBlocksUsed, 8)
		if s.Running == 2 {
			sawBothRunning = true
		}
		if s.Running == 1 && s.WaitingCapacity == 1 {
			sawCapacityWait = true
		}
	})
	assert.True(t, sawBothRunning)
	assert.True(t, sawCapacityWait, "the preempted request must wait for KV capacity")

	snap := d.sc.snapshot()
	assert.Equal(t, uint64(1), snap.Preemptions)
	assert.Equal(t, 0, snap.KVBlocksUsed)
	assert.Equal(t, uint64(2), snap.Finished[stagepb.FinishReason_FINISH_REASON_LENGTH])

	// The last admitted request is the one preempted, and it says so.
	assert.Equal(t, uint64(0), sums(d.chunks[a]).NumPreemptions)
	sb := sums(d.chunks[b])
	assert.Equal(t, uint64(1), sb.NumPreemptions)
	// Prompt tokens are counted once; the cache was queried on both admissions.
	assert.Equal(t, uint64(4), sb.PromptTokens)
	assert.Greater(t, sb.PrefixCacheQueries, uint64(4))
	// Preemption does not change the output.
	for _, s := range []*seq{a, b} {
		want, err := Expect(stagepb.RoleText, textRequest(s.id, sp))
		require.NoError(t, err)
		assert.Equal(t, want.Text, text(d.chunks[s]))
		assert.Equal(t, uint64(20), sums(d.chunks[s]).GenerationTokens)
	}
}

func TestWaitsForKVCapacity(t *testing.T) {
	d := newDriver(t, Config{NumKVBlocks: 6, BlockSize: 4})
	long := d.add(strings.Repeat("word ", 16), &stagepb.SamplingParams{MaxTokens: 4, IgnoreEos: true}) // 17 tokens: 5 blocks
	short := d.add("one two three four five six seven", &stagepb.SamplingParams{MaxTokens: 2, IgnoreEos: true})
	s := d.step()
	assert.Equal(t, 1, s.Running)
	assert.Equal(t, 1, s.WaitingCapacity, "seats are free but KV blocks are not")
	assert.Equal(t, 5, s.KVBlocksUsed)
	assert.InDelta(t, 5.0/6, s.KVCacheUsage(), 1e-9)
	d.runAll(nil)
	assert.Len(t, d.chunks[long], 4)
	assert.Len(t, d.chunks[short], 2)
	assert.Equal(t, uint64(0), d.sc.totals.Preemptions)
}

func TestMaxNumSeqsQueues(t *testing.T) {
	d := newDriver(t, Config{MaxNumSeqs: 1})
	for i := range 3 {
		d.add("hello", &stagepb.SamplingParams{Seed: proto.Int64(int64(i))})
	}
	s := d.step()
	assert.Equal(t, 1, s.Running)
	assert.Equal(t, 2, s.WaitingCapacity)
	d.runAll(func(s Snapshot) { assert.LessOrEqual(t, s.Running, 1) })
	assert.Equal(t, uint64(3), d.sc.totals.Finished[stagepb.FinishReason_FINISH_REASON_STOP])
}

func TestIdenticalPromptIsDeferredThenHitsCache(t *testing.T) {
	d := newDriver(t, Config{BlockSize: 4})
	prompt := strings.Repeat("alpha beta gamma delta ", 5) // 21 tokens: 5 full blocks
	a := d.add(prompt, &stagepb.SamplingParams{Seed: proto.Int64(1)})
	b := d.add(prompt, &stagepb.SamplingParams{Seed: proto.Int64(2)}) // KV does not depend on the seed
	batch := d.schedule()
	s := d.sc.snapshot()
	assert.Equal(t, 1, s.Running)
	assert.Equal(t, 1, s.WaitingDeferred, "b's blocks are being computed by a")
	assert.Equal(t, 0, s.WaitingCapacity)
	d.complete(batch)
	d.runAll(nil)

	sa, sb := sums(d.chunks[a]), sums(d.chunks[b])
	assert.Equal(t, uint64(21), sa.PromptTokens)
	assert.Equal(t, uint64(21), sa.PromptTokensLocalCompute)
	assert.Equal(t, uint64(0), sa.PrefixCacheHits)
	assert.Equal(t, uint64(21), sb.PromptTokens)
	assert.Equal(t, uint64(20), sb.PromptTokensLocalCacheHit, "the last token is always computed")
	assert.Equal(t, uint64(1), sb.PromptTokensLocalCompute)
	assert.Equal(t, uint64(21), sb.PrefixCacheQueries)
	assert.Equal(t, uint64(20), sb.PrefixCacheHits)
	// a's first step computed 21 tokens; b's first step only 1.
	assert.Equal(t, uint32(21), d.chunks[a][0].GetStats().GetIterationTokens()[0])
}

func TestChunkedPrefill(t *testing.T) {
	d := newDriver(t, Config{BlockSize: 4, MaxNumBatchedTokens: 8})
	s := d.add(strings.Repeat("w ", 19), &stagepb.SamplingParams{MaxTokens: 3, IgnoreEos: true}) // 20 tokens
	d.runAll(nil)
	chunks := d.chunks[s]
	require.Len(t, chunks, 3)
	// 20 prompt tokens in chunks of 8, 8, 4 (the last step samples the first token),
	// then two decode steps; all reported on the first chunk that followed them.
	assert.Equal(t, []uint32{8, 8, 4}, chunks[0].GetStats().GetIterationTokens())
	assert.Equal(t, []uint32{1}, chunks[1].GetStats().GetIterationTokens())
	assert.Equal(t, []uint32{1}, chunks[2].GetStats().GetIterationTokens())
}

func TestSpecDecodeCounts(t *testing.T) {
	const k = 3
	d := newDriver(t, Config{NumSpeculativeTokens: k})
	sp := &stagepb.SamplingParams{MaxTokens: 60, IgnoreEos: true}
	s := d.add("speculate about this", sp)
	d.runAll(nil)
	st := sums(d.chunks[s])
	require.Len(t, st.SpecDecodeNumAcceptedTokensPerPos, k)
	assert.Positive(t, st.SpecDecodeNumDrafts)
	assert.Equal(t, k*st.SpecDecodeNumDrafts, st.SpecDecodeNumDraftTokens)
	var perPos uint64
	for p, v := range st.SpecDecodeNumAcceptedTokensPerPos {
		perPos += v
		if p > 0 {
			assert.LessOrEqual(t, v, st.SpecDecodeNumAcceptedTokensPerPos[p-1])
		}
	}
	assert.Equal(t, st.SpecDecodeNumAcceptedTokens, perPos)
	assert.Positive(t, st.SpecDecodeNumAcceptedTokens)
	// The prefill yields one token; each decode step one plus its accepted drafts.
	assert.Equal(t, uint64(60), st.GenerationTokens)
	assert.Equal(t, st.GenerationTokens, 1+st.SpecDecodeNumDrafts+st.SpecDecodeNumAcceptedTokens)
	assert.Less(t, len(d.chunks[s]), 60, "accepted drafts make fewer steps")
	want, err := Expect(stagepb.RoleText, textRequest("speculate about this", sp))
	require.NoError(t, err)
	assert.Equal(t, want.Text, text(d.chunks[s]), "speculation must not change the output")
}

func TestSleepLevel2ClearsPrefixCache(t *testing.T) {
	d := newDriver(t, Config{BlockSize: 4})
	prompt := strings.Repeat("x y ", 6)
	d.add(prompt, nil)
	d.runAll(nil)
	assert.Positive(t, d.sc.snapshot().KVBlocksCached)
	d.sc.pool.reset()
	assert.Equal(t, 0, d.sc.snapshot().KVBlocksCached)
	again := d.add(prompt, nil)
	d.runAll(nil)
	assert.Equal(t, uint64(0), sums(d.chunks[again]).PrefixCacheHits)
}

func TestAbortFreesBlocks(t *testing.T) {
	d := newDriver(t, Config{BlockSize: 4, MaxNumSeqs: 1})
	a := d.add("one two three four five six seven eight", &stagepb.SamplingParams{MaxTokens: 30, IgnoreEos: true})
	b := d.add("nine ten", nil)
	d.step()
	require.Positive(t, d.sc.snapshot().KVBlocksUsed)
	d.sc.abort(b) // waiting
	d.sc.abort(a) // running
	d.sc.abort(a) // twice is harmless
	s := d.sc.snapshot()
	assert.Equal(t, 0, s.KVBlocksUsed)
	assert.Equal(t, 0, s.Running+s.WaitingCapacity+s.WaitingDeferred)
	assert.Equal(t, uint64(2), s.Finished[stagepb.FinishReason_FINISH_REASON_ABORT])
	assert.Empty(t, d.sc.inProgress)
}

func TestPrefixCachingDisabled(t *testing.T) {
	d := newDriver(t, Config{BlockSize: 4, DisablePrefixCaching: true})
	prompt := strings.Repeat("alpha beta gamma delta ", 5)
	a := d.add(prompt, nil)
	b := d.add(prompt, nil)
	s := d.step()
	assert.Equal(t, 2, s.Running, "nothing is deferred without a prefix cache")
	d.runAll(nil)
	for _, q := range []*seq{a, b} {
		st := sums(d.chunks[q])
		assert.Equal(t, uint64(0), st.PrefixCacheQueries)
		assert.Equal(t, uint64(0), st.PrefixCacheHits)
		assert.Equal(t, uint64(21), st.PromptTokensLocalCompute)
	}
	assert.Equal(t, 0, d.sc.snapshot().KVBlocksCached)
}

// replayKVEvents applies every KvEvents the driver's chunks carried, in seq
// order, as the head does, and returns the set of blocks they say are cached.
func replayKVEvents(t *testing.T, d *driver) map[uint64]bool {
	t.Helper()
	var evs []*stagepb.KvEvents
	for _, chunks := range d.chunks {
		for _, c := range chunks {
			if ev := c.GetKvEvents(); ev != nil {
				evs = append(evs, ev)
			}
		}
	}
	slices.SortFunc(evs, func(a, b *stagepb.KvEvents) int { return cmp.Compare(a.GetSeq(), b.GetSeq()) })
	held := map[uint64]bool{}
	for i, ev := range evs {
		require.Equal(t, uint64(i+1), ev.GetSeq(), "seq counts reports from 1 without gaps")
		if ev.GetCleared() {
			clear(held)
		}
		for _, h := range ev.GetRemoved() {
			delete(held, h)
		}
		for _, h := range ev.GetStored() {
			held[h] = true
		}
		for _, h := range ev.GetStored() {
			assert.NotContains(t, ev.GetRemoved(), h, "stored and removed are disjoint")
		}
	}
	return held
}

func TestKVEventsMirrorThePrefixCache(t *testing.T) {
	// A pool far too small for the prompts, so blocks are evicted and
	// re-stored while the events are collected.
	d := newDriver(t, Config{BlockSize: 4, NumKVBlocks: 24, MaxNumSeqs: 3})
	var prompts []string
	for i := range 12 {
		prompts = append(prompts, strings.Repeat("shared prefix words ", 3)+strings.Repeat(fmt.Sprintf("user%d ", i%5), 4+i%3))
	}
	for round := range 3 {
		for i, p := range prompts {
			d.add(p, &stagepb.SamplingParams{MaxTokens: uint32(3 + (i+round)%4), IgnoreEos: true})
		}
		d.runAll(nil)
	}
	evicted := 0
	for _, chunks := range d.chunks {
		for _, c := range chunks {
			evicted += len(c.GetKvEvents().GetRemoved())
		}
	}
	require.Positive(t, evicted, "the workload must evict for the test to mean anything")
	cached := map[uint64]bool{}
	for h := range d.sc.pool.cached {
		cached[h] = true
	}
	require.NotEmpty(t, cached)
	assert.Equal(t, cached, replayKVEvents(t, d), "the reports, replayed in seq order, name exactly the cached blocks")

	// The blocks are named by the protocol's hash over the sim's tokens,
	// which is what the head computes from the prompt.
	want := stagepb.BlockHashes(tokenizers.Sim(prompts[0]), 4)
	require.NotEmpty(t, want)
	d.add(prompts[0], nil)
	d.runAll(nil)
	held := replayKVEvents(t, d)
	for _, h := range want {
		assert.True(t, held[h], "every full prompt block is reported stored")
	}

	d.sc.pool.reset()
	s := d.add(prompts[1], &stagepb.SamplingParams{MaxTokens: 1})
	d.runAll(nil)
	ev := d.chunks[s][0].GetKvEvents()
	require.NotNil(t, ev)
	assert.True(t, ev.GetCleared(), "a reset is reported before what was stored after it")
}

func TestKVEventsOffWithoutPrefixCaching(t *testing.T) {
	d := newDriver(t, Config{BlockSize: 4, DisablePrefixCaching: true})
	d.add(strings.Repeat("alpha beta gamma delta ", 5), nil)
	d.runAll(nil)
	assert.Empty(t, replayKVEvents(t, d))
	e := newEngine(t, Config{DisablePrefixCaching: true})
	assert.False(t, e.Health().GetCacheConfig().GetKvEvents())
	assert.True(t, newEngine(t, Config{}).Health().GetCacheConfig().GetKvEvents())
}
