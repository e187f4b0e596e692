package sim

import (
	"slices"
	"time"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

type seqState uint8

const (
	stateWaiting seqState = iota
	stateRunning
	stateDone
)

type waitReason uint8

const (
	waitCapacity waitReason = iota // no free sequence slot, token budget or KV blocks
	waitDeferred                   // its next prefix block is being computed by another request
)

// seq is one request inside the scheduler. Every field is owned by the
// scheduler goroutine, except box, which is how outputs leave it.
type seq struct {
	id        string
	role      string
	key       uint64 // promptKey of the prompt
	seed      int64
	plan      plan
	promptLen int
	tokens    []uint32 // the prompt, then the output ids as they come out
	emitted   int      // output tokens produced so far

	numComputed  int     // tokens of tokens whose KV is computed
	blocks       []int32 // KV blocks held, in sequence order
	hashes       []uint64
	numCommitted int // leading blocks known to be in the prefix cache
	registeredTo int // blocks [numCommitted, registeredTo) are announced in scheduler.inProgress

	state    seqState
	reason   waitReason
	admitted bool // scheduled at least once: prompt tokens are counted

	arrival, firstScheduled, firstToken time.Time

	media []mediaItem // media parts to encode; nil once encoded

	delta *stagepb.EngineStats // counters since the last chunk
	box   *mailbox
}

func newSeq(id string, role string, prompt []uint32, pl plan, seed int64) *seq {
	return &seq{
		id: id, role: role, key: promptKey(prompt), seed: seed, plan: pl,
		promptLen: len(prompt), tokens: slices.Clip(append([]uint32(nil), prompt...)),
		delta: &stagepb.EngineStats{}, box: newMailbox(),
	}
}

// step is one request's share of an engine step.
type step struct {
	seq    *seq
	tokens int  // tokens of the sequence computed (prefill chunk, or the last sampled token)
	drafts int  // speculative draft tokens verified with it
	decode bool // the request is past its prefill
}

// batch is what one engine step computes.
type batch struct {
	steps                       []step
	prefillTokens, decodeTokens int
	encodeBytes                 int // media bytes the encoder computes in this step
}

// Snapshot is the state of an engine, published after every change.
type Snapshot struct {
	SleepState         stagepb.SleepState
	Running            int
	WaitingCapacity    int
	WaitingDeferred    int
	KVBlocksUsed       int // blocks held by requests
	KVBlocksCached     int // blocks holding a reusable prefix (held or free)
	KVBlocksTotal      int
	Steps              uint64 // engine steps that computed something
	Preemptions        uint64
	PrefixCacheQueries uint64    // tokens looked up, as vLLM counts them
	PrefixCacheHits    uint64    // tokens found
	MMCacheQueries     uint64    // media parts looked up in the encoder cache
	MMCacheHits        uint64    // media parts found there
	Finished           [5]uint64 // requests finished, indexed by stagepb.FinishReason
	Closed             bool
}

// KVCacheUsage is the fraction of KV blocks held by requests (0..1).
func (s Snapshot) KVCacheUsage() float64 {
	if s.KVBlocksTotal == 0 {
		return 0
	}
	return float64(s.KVBlocksUsed) / float64(s.KVBlocksTotal)
}

// scheduler is a continuous-batching scheduler in the style of vLLM v1:
// running requests first (decode, or their next prefill chunk), preempting
// the most recently admitted one when KV blocks run out; then waiting
// requests in arrival order while sequence slots, token budget and blocks
// last. It holds no goroutine and no clock: the Engine loop drives it.
type scheduler struct {
	cfg        Config
	pool       *blockPool
	running    []*seq // admission order; the last one is preempted first
	waiting    []*seq // arrival order; preempted requests go to the front
	inProgress map[uint64]int
	encoder    *encoderCache
	// pendingIter holds the token counts of steps not yet reported: each
	// step is reported once, on the next chunk any request emits.
	pendingIter []uint32
	totals      Snapshot
}

func newScheduler(cfg Config) *scheduler {
	return &scheduler{cfg: cfg, pool: newBlockPool(cfg.NumKVBlocks), inProgress: map[uint64]int{},
		encoder: newEncoderCache(cfg.EncoderCacheEntries)}
}

func (sc *scheduler) busy() bool    { return len(sc.running)+len(sc.waiting) > 0 }
func (sc *scheduler) inFlight() int { return len(sc.running) + len(sc.waiting) }
func (sc *scheduler) blocksFor(n int) int {
	return (n + sc.cfg.BlockSize - 1) / sc.cfg.BlockSize
}

// add queues a new request.
func (sc *scheduler) add(s *seq, now time.Time) {
	s.arrival = now
	s.state, s.reason = stateWaiting, waitCapacity
	sc.waiting = append(sc.waiting, s)
}

// abort removes a request wherever it is and frees its blocks. A request
// that already finished is left alone.
func (sc *scheduler) abort(s *seq) {
	switch s.state {
	case stateRunning:
		sc.running = slices.DeleteFunc(sc.running, func(o *seq) bool { return o == s })
	case stateWaiting:
		sc.waiting = slices.DeleteFunc(sc.waiting, func(o *seq) bool { return o == s })
	default:
		return
	}
	sc.release(s)
	s.state = stateDone
	sc.totals.Finished[stagepb.FinishReason_FINISH_REASON_ABORT]++
}

// failAll ends every request with err (engine shutdown).
func (sc *scheduler) failAll(err error) {
	for _, s := range slices.Concat(sc.running, sc.waiting) {
		sc.release(s)
		s.state = stateDone
		s.box.fail(err)
	}
	sc.running, sc.waiting = nil, nil
}

// ensureHashes extends the chained block hashes to every full block.
func (sc *scheduler) ensureHashes(s *seq) {
	bs := sc.cfg.BlockSize
	for j := len(s.hashes); (j+1)*bs <= len(s.tokens); j++ {
		var parent uint64
		if j > 0 {
			parent = s.hashes[j-1]
		}
		s.hashes = append(s.hashes, chainHash(parent, s.tokens[j*bs:(j+1)*bs]))
	}
}

// release frees a request's blocks and withdraws its in-progress announcements.
func (sc *scheduler) release(s *seq) {
	sc.pool.release(s.blocks)
	s.blocks = nil
	for j := s.numCommitted; j < s.registeredTo; j++ {
		h := s.hashes[j]
		if sc.inProgress[h]--; sc.inProgress[h] <= 0 {
			delete(sc.inProgress, h)
		}
	}
	s.registeredTo = 0
	s.numComputed, s.numCommitted = 0, 0
}

// preempt sends a running request back to the front of the queue; it will
// recompute its prompt and output so far (vLLM's recompute preemption).
func (sc *scheduler) preempt(s *seq) {
	sc.running = slices.DeleteFunc(sc.running, func(o *seq) bool { return o == s })
	sc.release(s)
	s.state, s.reason = stateWaiting, waitCapacity
	sc.waiting = slices.Insert(sc.waiting, 0, s)
	s.delta.NumPreemptions++
	sc.totals.Preemptions++
}

// schedule picks the work of one engine step and reserves its KV blocks.
func (sc *scheduler) schedule(now time.Time) *batch {
	b := &batch{}
	budget := sc.cfg.MaxNumBatchedTokens
	preempted := false
	for i := 0; i < len(sc.running) && budget > 0; i++ {
		s := sc.running[i]
		n := len(s.tokens) - s.numComputed
		decode := s.emitted > 0 && n == 1
		drafts := 0
		if decode {
			drafts = min(sc.cfg.NumSpeculativeTokens, budget-1)
		} else {
			n = min(n, budget)
		}
		need := sc.blocksFor(s.numComputed+n+drafts) - len(s.blocks)
		for need > sc.pool.numFree && s.state == stateRunning {
			sc.preempt(sc.running[len(sc.running)-1])
			preempted = true
		}
		if s.state != stateRunning {
			break // it was the last one left to preempt
		}
		if need > 0 {
			s.blocks = append(s.blocks, sc.pool.allocate(need)...)
		}
		b.add(step{seq: s, tokens: n, drafts: drafts, decode: decode})
		budget -= n + drafts
	}
	i := 0
	// Like vLLM, admit nothing in a step that had to preempt.
	for !preempted && i < len(sc.waiting) && len(sc.running) < sc.cfg.MaxNumSeqs && budget > 0 {
		s := sc.waiting[i]
		var hashes []uint64
		var hits []int32
		if !sc.cfg.DisablePrefixCaching {
			sc.ensureHashes(s)
			// The last token is always computed, so its block never counts as a hit.
			hashes = s.hashes[:(len(s.tokens)-1)/sc.cfg.BlockSize]
			hits = sc.pool.lookup(hashes)
			if len(hits) < len(hashes) && sc.inProgress[hashes[len(hits)]] > 0 {
				s.reason = waitDeferred // another request is computing our next block: reuse it next step
				i++
				continue
			}
		}
		cached := len(hits) * sc.cfg.BlockSize
		n := min(len(s.tokens)-cached, budget)
		need := sc.blocksFor(cached+n) - len(hits)
		if !sc.pool.canAllocate(need, hits) {
			break
		}
		sc.waiting = slices.Delete(sc.waiting, i, i+1)
		sc.admit(s, hits, need, now)
		b.encodeBytes += sc.encode(s)
		b.add(step{seq: s, tokens: n})
		budget -= n
	}
	for _, s := range sc.waiting[i:] {
		s.reason = waitCapacity
	}
	return b
}

func (b *batch) add(st step) {
	b.steps = append(b.steps, st)
	if st.decode {
		b.decodeTokens += st.tokens + st.drafts
	} else {
		b.prefillTokens += st.tokens
	}
}

// admit moves a waiting request to running with its cache hits and fresh blocks.
func (sc *scheduler) admit(s *seq, hits []int32, fresh int, now time.Time) {
	sc.pool.acquire(hits)
	s.blocks = append(slices.Clone(hits), sc.pool.allocate(max(fresh, 0))...)
	cached := len(hits) * sc.cfg.BlockSize
	s.numComputed, s.numCommitted = cached, len(hits)
	if !sc.cfg.DisablePrefixCaching {
		// Announce the full blocks we are about to compute, so an identical
		// prompt arriving meanwhile waits for them instead of recomputing.
		s.registeredTo = len(s.tokens) / sc.cfg.BlockSize
		for j := s.numCommitted; j < s.registeredTo; j++ {
			sc.inProgress[s.hashes[j]]++
		}
		s.delta.PrefixCacheQueries += uint64(len(s.tokens))
		s.delta.PrefixCacheHits += uint64(cached)
		sc.totals.PrefixCacheQueries += uint64(len(s.tokens))
		sc.totals.PrefixCacheHits += uint64(cached)
	}
	if !s.admitted {
		s.admitted = true
		s.firstScheduled = now
		hit := min(cached, s.promptLen)
		s.delta.PromptTokens += uint64(s.promptLen)
		s.delta.PromptTokensLocalCacheHit += uint64(hit)
		s.delta.PromptTokensLocalCompute += uint64(s.promptLen - hit)
	}
	s.state = stateRunning
	sc.running = append(sc.running, s)
}

// encode looks s's media parts up in the encoder cache, once (when s is
// first scheduled), and returns the bytes of those it must encode.
func (sc *scheduler) encode(s *seq) (missed int) {
	for _, m := range s.media {
		s.delta.MmCacheQueries++
		sc.totals.MMCacheQueries++
		if sc.encoder.lookup(m.hash) {
			s.delta.MmCacheHits++
			sc.totals.MMCacheHits++
			continue
		}
		missed += m.bytes
	}
	s.media = nil
	return missed
}

// commitBlocks caches every newly computed full block.
func (sc *scheduler) commitBlocks(s *seq) {
	if sc.cfg.DisablePrefixCaching {
		return
	}
	sc.ensureHashes(s)
	for j := s.numCommitted; j < s.numComputed/sc.cfg.BlockSize; j++ {
		sc.pool.commit(s.blocks[j], s.hashes[j])
		if j < s.registeredTo {
			if sc.inProgress[s.hashes[j]]--; sc.inProgress[s.hashes[j]] <= 0 {
				delete(sc.inProgress, s.hashes[j])
			}
		}
		s.numCommitted = j + 1
	}
}

// acceptedDrafts is the sim's speculative acceptance pattern: a pure
// function of (prompt, seed, output position), each draft position accepted
// with chance 3/4 given the earlier ones were, so acceptance falls with the
// position as it does with a real draft model.
func acceptedDrafts(key uint64, seed int64, pos, k int) int {
	h := draw(key, seed, pos, saltSpec)
	a := 0
	for ; a < k; a++ {
		if a > 0 && a%8 == 0 {
			h = mix(h)
		}
		if (h>>(8*(a%8)))&0xff >= 0xc0 {
			break
		}
	}
	return a
}

// output is one chunk leaving the scheduler.
type output struct {
	seq   *seq
	chunk *stagepb.GenerateChunk
	final bool
}

// complete applies the results of a step computed until now and returns
// the chunks it produced, gauges filled in.
func (sc *scheduler) complete(b *batch, now time.Time) []output {
	var outs []output
	total := 0
	for _, st := range b.steps {
		s := st.seq
		if s.state != stateRunning {
			continue // aborted while the step ran
		}
		total += st.tokens + st.drafts
		s.numComputed += st.tokens
		if s.numComputed < len(s.tokens) {
			sc.commitBlocks(s) // a prefill chunk: nothing to sample yet
			continue
		}
		remaining := len(s.plan.ids) - s.emitted
		produce := 1
		if st.drafts > 0 {
			a := min(acceptedDrafts(s.key, s.seed, s.emitted, st.drafts), remaining-1)
			d := s.delta
			if len(d.SpecDecodeNumAcceptedTokensPerPos) < sc.cfg.NumSpeculativeTokens {
				d.SpecDecodeNumAcceptedTokensPerPos = append(d.SpecDecodeNumAcceptedTokensPerPos,
					make([]uint64, sc.cfg.NumSpeculativeTokens-len(d.SpecDecodeNumAcceptedTokensPerPos))...)
			}
			d.SpecDecodeNumDrafts++
			d.SpecDecodeNumDraftTokens += uint64(st.drafts)
			d.SpecDecodeNumAcceptedTokens += uint64(a)
			for p := range a {
				d.SpecDecodeNumAcceptedTokensPerPos[p]++
			}
			s.numComputed += a // accepted drafts are in the KV cache now
			produce += a
		}
		from := s.emitted
		s.tokens = append(s.tokens, s.plan.ids[from:from+produce]...)
		s.emitted += produce
		s.delta.GenerationTokens += uint64(produce)
		if from == 0 {
			s.firstToken = now
		}
		sc.commitBlocks(s)
		out := output{seq: s, chunk: s.render(from, s.emitted)}
		if s.emitted == len(s.plan.ids) {
			sc.finish(s, out.chunk, now)
			out.final = true
		}
		outs = append(outs, out)
	}
	if total > 0 {
		sc.totals.Steps++
		sc.pendingIter = append(sc.pendingIter, uint32(total))
	}
	if len(outs) > 0 && len(sc.pendingIter) > 0 {
		outs[0].chunk.Stats.IterationTokens = sc.pendingIter
		sc.pendingIter = nil
	}
	if len(outs) > 0 {
		outs[0].chunk.KvEvents = sc.pool.events.take()
	}
	running, capacity, deferred, usage := sc.gauges()
	for _, o := range outs {
		st := o.chunk.Stats
		st.NumRequestsRunning, st.NumRequestsWaitingCapacity, st.NumRequestsWaitingDeferred = running, capacity, deferred
		st.KvCacheUsagePerc = usage
	}
	return outs
}

// finish ends a request that produced its last token.
func (sc *scheduler) finish(s *seq, c *stagepb.GenerateChunk, now time.Time) {
	sc.running = slices.DeleteFunc(sc.running, func(o *seq) bool { return o == s })
	sc.release(s)
	s.state = stateDone
	c.FinishReason = s.plan.finish
	c.Timings = &stagepb.Timings{
		QueueSeconds:   s.firstScheduled.Sub(s.arrival).Seconds(),
		PrefillSeconds: s.firstToken.Sub(s.firstScheduled).Seconds(),
		DecodeSeconds:  now.Sub(s.firstToken).Seconds(),
	}
	sc.totals.Finished[s.plan.finish]++
}

// render builds the chunk for output tokens [from, to) and hands over the
// counters accumulated since the previous chunk.
func (s *seq) render(from, to int) *stagepb.GenerateChunk {
	c := &stagepb.GenerateChunk{Stats: s.delta}
	s.delta = &stagepb.EngineStats{}
	ids := s.plan.ids[from:to]
	switch s.role {
	case stagepb.RoleCodes:
		c.Codes = slices.Clone(ids)
	case stagepb.RoleAudio:
		pcm := make([]byte, 0, len(ids)*SamplesPerCode*2)
		for _, code := range ids {
			pcm = appendTone(pcm, code)
		}
		c.AudioPcm16, c.SampleRate = pcm, SampleRate
	default:
		for _, p := range s.plan.pieces[from:to] {
			c.Text += p
		}
		c.TokenIds = slices.Clone(ids)
	}
	return c
}

// gauges are the engine's live load, from its real queues.
func (sc *scheduler) gauges() (running, capacity, deferred uint32, usage float64) {
	for _, s := range sc.waiting {
		if s.reason == waitDeferred {
			deferred++
		} else {
			capacity++
		}
	}
	return uint32(len(sc.running)), capacity, deferred, float64(sc.pool.used) / float64(sc.pool.size())
}

// snapshot returns the totals with the live gauges filled in.
func (sc *scheduler) snapshot() Snapshot {
	s := sc.totals
	r, c, d, _ := sc.gauges()
	s.Running, s.WaitingCapacity, s.WaitingDeferred = int(r), int(c), int(d)
	s.KVBlocksUsed, s.KVBlocksTotal, s.KVBlocksCached = sc.pool.used, sc.pool.size(), len(sc.pool.cached)
	return s
}
