package router

import (
	"cmp"
	"encoding/binary"
	"hash/fnv"
	"math/rand/v2"
	"slices"
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

// Pick implements Policy.
func (p *PrefixAware) Pick(req *Request, c []*Replica) Decision {
	type cand struct {
		r             *Replica
		s             scheme
		match, blocks int
		floor         float64 // the home's: counts as holding at least this share
	}
	sc := newScorer(c, p.MaxAge)
	score := sc.score
	cs := make([]cand, len(c))
	groups := map[scheme][]int{} // replicas that share a scheme are matched in one pass
	for i, r := range c {
		cs[i] = cand{r: r, s: p.schemeOf(r)}
		groups[cs[i].s] = append(groups[cs[i].s], i)
	}
	for s, idx := range groups {
		hs := p.hashesOf(req, s)
		keys := make([]Key, len(idx))
		for k, j := range idx {
			keys[k] = cs[j].r.Key
		}
		for k, m := range p.index.Match(hs, keys) {
			cs[idx[k]].match, cs[idx[k]].blocks = m, len(hs)
		}
	}
	ratio := func(x cand) float64 {
		if x.blocks <= 0 {
			return x.floor
		}
		return max(x.floor, float64(x.match)/float64(x.blocks))
	}
	least, n := 0, 1
	for i := 1; i < len(cs); i++ {
		switch a, b := score(cs[i].r), score(cs[least].r); {
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
	longest := func(ok func(*Replica) bool) int {
		best, n := -1, 0
		for i, x := range cs {
			if (x.match == 0 && x.floor == 0) || !ok(x.r) {
				continue
			}
			if best < 0 {
				best, n = i, 1
				continue
			}
			rx, rb := ratio(x), ratio(cs[best])
			sx, sb := score(x.r), score(cs[best].r)
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
		total += score(x.r)
	}
	bound := p.bound(total, len(cs))
	within := func(r *Replica) bool { return float64(score(r)+1) <= bound }
	// With no match anywhere, or when the preferred replica is above the
	// bound, the prefix's rendezvous order decides: every head ranks the
	// replicas alike for the same prefix, so they agree without talking.
	rendezvous := func() int {
		if req.Text == "" && len(req.Tokens) == 0 {
			return least // nothing to agree on
		}
		for _, i := range p.rank(req, len(cs), func(i int) Key { return cs[i].r.Key }) {
			if within(cs[i].r) {
				return i
			}
		}
		return least
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
	best := longest(func(*Replica) bool { return true })
	switch {
	case best < 0:
		chosen = rendezvous()
	case p.overloaded(score(cs[best].r), score(cs[least].r)):
		// Load rules the preferred replica out, and every other one
		// as loaded; among the rest the cache still decides (a shorter
		// match, such as a shared system prompt, beats none).
		d.Reason = ReasonLoadFallback
		if alt := longest(func(r *Replica) bool { return !p.overloaded(score(r), score(cs[least].r)) }); alt >= 0 {
			chosen = alt
		}
	default:
		chosen, d.Reason = best, ReasonPrefixMatch
		if within(cs[best].r) {
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
		if alt != best && within(cs[alt].r) && cs[best].match-cs[alt].match <= p.ReplicateMaxBlocks {
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

// rank orders candidates by their rendezvous weight for req's prefix: the
// hash of its first RootBlocks head blocks (text or token ids), so inputs
// that share those blocks, such as a system prompt, rank replicas alike on
// every head. An input shorter than a block ranks by its whole text.
func (p *PrefixAware) rank(req *Request, n int, key func(int) Key) []int {
	hs := p.hashesOf(req, scheme{})
	var root uint64
	if len(hs) > 0 {
		root = hs[min(max(p.RootBlocks, 1), len(hs))-1]
	} else {
		h := fnv.New64a()
		h.Write([]byte(req.Text))
		for _, id := range req.Tokens {
			h.Write(binary.LittleEndian.AppendUint32(nil, id))
		}
		root = h.Sum64()
	}
	idx := make([]int, n)
	ws := make([]uint64, n)
	for i := range idx {
		idx[i] = i
		ws[i] = weight(root, key(i))
	}
	slices.SortFunc(idx, func(a, b int) int { return cmp.Compare(ws[b], ws[a]) })
	return idx
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
