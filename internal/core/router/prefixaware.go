package router

import (
	"encoding/binary"
	"hash/fnv"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// HeadBlockBytes is the block size of the head's own (approximate) prefix
// hashes: bytes of the input text, about as many tokens as an engine's
// 16-token KV block holds.
const HeadBlockBytes = 64

// HeadBlockTokens is the block size of the head's own prefix hashes of an
// input sent as token ids.
const HeadBlockTokens = 16

// Defaults of the balance threshold (see PrefixAware).
const (
	DefaultBalanceAbs         = 8
	DefaultBalanceRel         = 1.5
	DefaultReplicateFactor    = 1.25
	DefaultReplicateSlack     = 1
	DefaultRootBlocks         = 4
	DefaultReplicateMaxBlocks = 32
)

// PrefixAware sends a request to the replica holding the longest cached
// prefix of its input, unless that replica is overloaded relative to the
// least loaded one (the balance threshold of SGLang's cache-aware router),
// in which case load decides: the request goes to the longest match among
// the replicas that are not overloaded, which is the least loaded one when
// none of them matches. Matches are compared as the fraction of the input's
// blocks held, so replicas named by different hash schemes compare fairly;
// ties go to the less loaded replica, then at random.
//
// What each replica holds comes from one of two sources, per replica:
//   - engine-reported: the replica's engine reports KvEvents (Health says
//     so), the head has the engine's tokenizer, and the source is auto: the
//     index holds exactly what the engine reported, in the engine's own
//     token blocks;
//   - head-side (approximate): any other engine. After each pick the head
//     records the input's 64-byte text blocks as held by the chosen
//     replica, a guess that needs nothing from the engine.
//
// The index is bounded (LRU) and a replica's entries are dropped when it
// leaves (Forget). Pick is safe for concurrent use.
type PrefixAware struct {
	// A replica is overloaded when its score is at least BalanceAbs above
	// the least loaded replica's and more than BalanceRel times it.
	BalanceAbs int64
	BalanceRel float64
	// A replica above the bound (see bound) takes no request for its cache:
	// the request goes to another replica, which holds or gets a copy of
	// the prefix (ReasonPrefixReplicated).
	ReplicateFactor    float64
	ReplicateSlack     int64
	ReplicateMaxBlocks int
	// RootBlocks is how many leading head blocks name a prefix for the
	// rendezvous order.
	RootBlocks int

	// MaxAge: load reports older than this are unknown (see scorer).
	MaxAge time.Duration
	// Affinity is session affinity on top of it, when the stage has it.
	Affinity Affinity

	source     string
	tokenizers map[string]Tokenizer
	index      *PrefixIndex
}

// NewPrefixAware returns a prefix_aware policy for one stage.
func NewPrefixAware(opts PolicyOptions) *PrefixAware {
	src := opts.PrefixSource
	if src == "" {
		src = PrefixSourceAuto
	}
	b := opts.Balance.WithDefaults()
	return &PrefixAware{
		BalanceAbs:         b.Abs,
		BalanceRel:         b.Rel,
		ReplicateFactor:    b.ReplicateFactor,
		ReplicateSlack:     b.ReplicateSlack,
		ReplicateMaxBlocks: b.ReplicateMaxBlocks,
		RootBlocks:         b.RootBlocks,
		MaxAge:             opts.SignalMaxAge,
		Affinity:           Affinity{MaxAge: opts.SignalMaxAge, LoadFactor: b.AffinityLoadFactor},
		source:             src,
		tokenizers:         opts.Tokenizers,
		index:              NewPrefixIndex(opts.IndexCapacity),
	}
}

// Name implements Policy.
func (*PrefixAware) Name() string { return PolicyPrefixAware }

// Reasons implements Policy.
func (*PrefixAware) Reasons() []Reason {
	return []Reason{ReasonLoad, ReasonPrefixMatch, ReasonLoadFallback, ReasonPrefixReplicated}
}

// Index is the policy's prefix index.
func (p *PrefixAware) Index() *PrefixIndex { return p.index }

// scheme names how a replica's blocks are hashed: the head's text blocks
// (tokenizer nil), or an engine's token blocks of blockSize.
type scheme struct {
	engine    string
	blockSize int
}

type schemeHashes struct {
	scheme scheme
	hashes []uint64
}

// schemeOf is the hash scheme the policy uses for r.
func (p *PrefixAware) schemeOf(r *Replica) scheme {
	if p.source == PrefixSourceAuto && r.Engine.KVEvents && r.Engine.BlockSize > 0 && p.tokenizers[r.Engine.Name] != nil {
		return scheme{engine: r.Engine.Name, blockSize: r.Engine.BlockSize}
	}
	return scheme{}
}

// hashesOf returns req's block hashes in scheme s, computing them once.
func (p *PrefixAware) hashesOf(req *Request, s scheme) []uint64 {
	for _, sh := range req.hashes {
		if sh.scheme == s {
			return sh.hashes
		}
	}
	var hs []uint64
	switch {
	case len(req.Tokens) > 0 && s.engine == "":
		hs = HeadTokenBlockHashes(req.Tokens)
	case len(req.Tokens) > 0:
		hs = stagepb.BlockHashes(req.Tokens, s.blockSize) // the engine's own ids
	case s.engine == "":
		hs = HeadBlockHashes(req.Text)
	default:
		hs = stagepb.BlockHashes(p.tokenizers[s.engine](req.Text), s.blockSize)
	}
	req.hashes = append(req.hashes, schemeHashes{scheme: s, hashes: hs})
	return hs
}

// HeadBlockHashes are the head's approximate block hashes of a text: FNV-1a
// over each full HeadBlockBytes block, chained through the previous hash.
func HeadBlockHashes(text string) []uint64 {
	out := make([]uint64, 0, len(text)/HeadBlockBytes)
	var parent [8]byte
	for j := 0; (j+1)*HeadBlockBytes <= len(text); j++ {
		h := fnv.New64a()
		h.Write(parent[:])
		h.Write([]byte(text[j*HeadBlockBytes : (j+1)*HeadBlockBytes]))
		sum := h.Sum64()
		out = append(out, sum)
		binary.LittleEndian.PutUint64(parent[:], sum)
	}
	return out
}

// HeadTokenBlockHashes are the head's block hashes of an input of token
// ids: FNV-1a over each full HeadBlockTokens block of little-endian ids,
// chained through the previous hash.
func HeadTokenBlockHashes(ids []uint32) []uint64 {
	out := make([]uint64, 0, len(ids)/HeadBlockTokens)
	var parent [8]byte
	var b [4]byte
	for j := 0; (j+1)*HeadBlockTokens <= len(ids); j++ {
		h := fnv.New64a()
		h.Write(parent[:])
		for _, id := range ids[j*HeadBlockTokens : (j+1)*HeadBlockTokens] {
			binary.LittleEndian.PutUint32(b[:], id)
			h.Write(b[:])
		}
		sum := h.Sum64()
		out = append(out, sum)
		binary.LittleEndian.PutUint64(parent[:], sum)
	}
	return out
}

// cand is one candidate of a prefix-aware pick.
type cand struct {
	r             *Replica
	s             scheme
	score         int64 // the scorer's, read once per pick
	match, blocks int
	floor         float64 // the home's: counts as holding at least this share
}

// pickScratch is a pick's working memory, reused through a pool so that a
// pick allocates nothing that grows with the stage.
type pickScratch struct {
	cs      []cand
	schemes []scheme
	keys    []Key
	idx     []int
	out     []int
	live    []int
}

var pickScratchPool = sync.Pool{New: func() any { return new(pickScratch) }}

// Pick implements Policy.
func (p *PrefixAware) Pick(req *Request, c []*Replica) Decision {
	sp := pickScratchPool.Get().(*pickScratch)
	defer pickScratchPool.Put(sp)
	sc := newScorer(c, p.MaxAge)
	cs := slices.Grow(sp.cs[:0], len(c))[:len(c)]
	sp.cs = cs
	schemes := sp.schemes[:0]
	for i, r := range c {
		cs[i] = cand{r: r, s: p.schemeOf(r), score: sc.score(r)}
		if !slices.Contains(schemes, cs[i].s) {
			schemes = append(schemes, cs[i].s)
		}
	}
	sp.schemes = schemes
	// Replicas that share a scheme are matched in one pass.
	for _, s := range schemes {
		hs := p.hashesOf(req, s)
		keys, idx := sp.keys[:0], sp.idx[:0]
		for j := range cs {
			if cs[j].s == s {
				keys, idx = append(keys, cs[j].r.Key), append(idx, j)
			}
		}
		out := slices.Grow(sp.out[:0], len(keys))[:len(keys)]
		clear(out)
		sp.keys, sp.idx, sp.out = keys, idx, out
		sp.live = p.index.match(hs, keys, out, sp.live)
		for k, m := range out {
			cs[idx[k]].match, cs[idx[k]].blocks = m, len(hs)
		}
	}
	defer clear(cs) // the pool holds no replica
	ratio := func(x cand) float64 {
		if x.blocks <= 0 {
			return x.floor
		}
		return max(x.floor, float64(x.match)/float64(x.blocks))
	}
	least, n := 0, 1
	for i := 1; i < len(cs); i++ {
		switch a, b := cs[i].score, cs[least].score; {
		case a < b:
			least, n = i, 1
		case a == b:
			n++ // reservoir sampling: each tie equally likely
			if rand.IntN(n) == 0 {
				least = i
			}
		}
	}
	// longest is the candidate with the longest match among those ok
	// accepts, ties to the less loaded, then at random; -1 when none
	// matches at all.
	longest := func(ok func(cand) bool) int {
		best, n := -1, 0
		for i, x := range cs {
			if (x.match == 0 && x.floor == 0) || !ok(x) {
				continue
			}
			if best < 0 {
				best, n = i, 1
				continue
			}
			rx, rb := ratio(x), ratio(cs[best])
			sx, sb := x.score, cs[best].score
			switch {
			case rx > rb || (rx == rb && sx < sb):
				best, n = i, 1
			case rx == rb && sx == sb:
				n++
				if rand.IntN(n) == 0 {
					best = i
				}
			}
		}
		return best
	}
	d := Decision{Policy: PolicyPrefixAware, Reason: ReasonLoad}
	var total int64
	for _, x := range cs {
		total += x.score
	}
	bound := p.bound(total, len(cs))
	within := func(x cand) bool { return float64(x.score+1) <= bound }
	// With no match anywhere, or when the preferred replica is above the
	// bound, the prefix's rendezvous order decides: every head ranks the
	// replicas alike for the same prefix, so they agree without talking.
	// The first in rendezvous order within the bound is the heaviest
	// within it: one pass, no sort (distinct keys have distinct weights).
	rendezvous := func() int {
		if req.Text == "" && len(req.Tokens) == 0 {
			return least // nothing to agree on
		}
		root := p.root(req)
		chosen, cw := -1, uint64(0)
		for i, x := range cs {
			if w := weight(root, x.r.Key); within(x) && (chosen < 0 || w > cw) {
				chosen, cw = i, w
			}
		}
		if chosen < 0 {
			return least
		}
		return chosen
	}
	// An input longer than its root has a home: the first replica in its
	// rendezvous order within the bound, which counts as holding at least
	// the root. Where this head knows no more of the input than a prefix
	// many inputs share (a system prompt, held by many replicas), every
	// head then sends it home, where other heads may have put the rest of
	// it; what this head knows beyond the root still wins.
	if hs := p.hashesOf(req, scheme{}); p.RootBlocks > 0 && len(hs) > p.RootBlocks {
		cs[rendezvous()].floor = float64(p.RootBlocks) / float64(len(hs))
	}
	chosen := least
	best := longest(func(cand) bool { return true })
	switch {
	case best < 0:
		chosen = rendezvous()
	case p.overloaded(cs[best].score, cs[least].score):
		// Load rules the preferred replica out, and every other one
		// as loaded; among the rest the cache still decides (a shorter
		// match, such as a shared system prompt, beats none).
		d.Reason = ReasonLoadFallback
		if alt := longest(func(x cand) bool { return !p.overloaded(x.score, cs[least].score) }); alt >= 0 {
			chosen = alt
		}
	default:
		chosen, d.Reason = best, ReasonPrefixMatch
		if within(cs[best]) {
			break
		}
		// The preferred replica is busier than its share: its prefix is
		// hot. Serve the request from another replica, one that already
		// holds a copy if any is within the bound, else the next in the
		// prefix's rendezvous order, which now gets a copy; but only
		// when that costs at most ReplicateMaxBlocks blocks of recompute
		// (a shared prefix, not a long private history).
		alt := longest(within)
		if alt < 0 {
			alt = rendezvous()
		}
		if alt != best && within(cs[alt]) && cs[best].match-cs[alt].match <= p.ReplicateMaxBlocks {
			chosen, d.Reason = alt, ReasonPrefixReplicated
		}
	}
	x := cs[chosen]
	if x.match == 0 && d.Reason == ReasonPrefixMatch {
		d.Reason = ReasonLoad // the home, holding nothing known: placed, not matched
	}
	d.Replica = x.r
	d.MatchBlocks, d.InputBlocks = x.match, x.blocks
	d.PrefixSource = PrefixHead
	if x.s.engine != "" {
		d.PrefixSource = PrefixEngine
	} else if x.blocks > 0 {
		// The head's guess: the chosen replica computes, and so caches,
		// this input.
		p.index.Insert(x.r.Key, p.hashesOf(req, x.s))
	}
	return d
}

// bound is the most load (this request included) a replica may carry and
// still take a request because of its cache or its rendezvous rank: the
// stage's average times ReplicateFactor, and at least ReplicateSlack above
// the average, so that a light load is not spread for nothing.
func (p *PrefixAware) bound(total int64, n int) float64 {
	avg := float64(total+1) / float64(n)
	return max(p.ReplicateFactor*avg, avg+float64(p.ReplicateSlack))
}

// root is the rendezvous key of req's prefix: the hash of its first
// RootBlocks head blocks (text or token ids), so inputs that share those
// blocks, such as a system prompt, rank replicas alike on every head. An
// input shorter than a block ranks by its whole text.
func (p *PrefixAware) root(req *Request) uint64 {
	hs := p.hashesOf(req, scheme{})
	if len(hs) > 0 {
		return hs[min(max(p.RootBlocks, 1), len(hs))-1]
	}
	h := fnv.New64a()
	h.Write([]byte(req.Text))
	for _, id := range req.Tokens {
		h.Write(binary.LittleEndian.AppendUint32(nil, id))
	}
	return h.Sum64()
}

// overloaded reports whether a replica of load s is too far above the least
// loaded replica's m to take more cached work.
func (p *PrefixAware) overloaded(s, m int64) bool {
	return s >= m+p.BalanceAbs && float64(s) > p.BalanceRel*float64(m)
}

// Forget drops what the index knows about a replica.
func (p *PrefixAware) Forget(k Key) { p.index.Forget(k) }

// ApplyKVEvents records an engine's report about its cache, for replicas
// in the engine-reported mode; reports of other replicas are ignored.
func (p *PrefixAware) ApplyKVEvents(r *Replica, ev *stagepb.KvEvents) {
	if p.schemeOf(r).engine != "" {
		r.cacheAt.Store(time.Now().UnixNano())
		p.index.Apply(r.Key, ev)
	}
}

// ApplyCacheSnapshot replaces what the index holds of r with its engine's
// snapshot (see PrefixIndex.Reset), for replicas in the engine-reported
// mode; others are ignored.
func (p *PrefixAware) ApplyCacheSnapshot(r *Replica, snap *stagepb.KvEvents) {
	if p.schemeOf(r).engine != "" {
		r.cacheAt.Store(time.Now().UnixNano())
		p.index.Reset(r.Key, snap)
	}
}

// UsesKVEvents reports whether the policy reads r's engine reports (r is in
// the engine-reported mode).
func (p *PrefixAware) UsesKVEvents(r *Replica) bool { return p.schemeOf(r).engine != "" }
