package router

import (
	"encoding/binary"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
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

// DefaultHomeLoadWindow is the time constant of the smoothed load that
// places a conversation in the head-side mode (see PrefixAware).
const DefaultHomeLoadWindow = 5 * time.Second

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
// In the head-side mode a worker that publishes the blocks heads route to
// it (EngineInfo.RoutedSubscription) tells every head each pick's blocks
// (Decision.RoutedBlocks, ApplyRoutedBlocks), so every head's index
// holds every head's picks. Where a candidate's worker does not, each
// head's index holds only what that head routed, so several heads would
// each follow their own partial view: a chat's later turn there (every
// candidate head-side, the input rendered as tokenizers.ChatText renders
// it, with an assistant message) is placed by a rule every head computes
// alike from the request and signals every head shares: its
// conversation's home (see conversationKey and homeOf), not the index's
// longest match. The index still decides a first turn, and when the home
// is overloaded.
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

	// HomeLoadWindow is the time constant of the smoothed load a
	// conversation's home is placed by (head-side mode).
	HomeLoadWindow time.Duration

	// MaxAge: load reports older than this are unknown (see scorer).
	MaxAge time.Duration
	// Affinity is session affinity on top of it, when the stage has it.
	Affinity Affinity

	source     string
	tokenizers map[string]Tokenizer
	index      *PrefixIndex

	smoothMu sync.Mutex
	smooth   map[Key]*smoothedLoad
	clock    func() int64 // unix nanoseconds for the smoothing (tests); nil: the pick's time
}

// smoothedLoad is an exponentially weighted moving average of a replica's
// shared load, as of at (unix nanoseconds).
type smoothedLoad struct {
	v  float64
	at int64
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
		HomeLoadWindow:     DefaultHomeLoadWindow,
		MaxAge:             opts.SignalMaxAge,
		Affinity:           Affinity{MaxAge: opts.SignalMaxAge, LoadFactor: b.AffinityLoadFactor},
		source:             src,
		tokenizers:         opts.Tokenizers,
		index:              NewPrefixIndex(opts.IndexCapacity),
		smooth:             map[Key]*smoothedLoad{},
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

// schemeMemo is schemeOf for one pick, remembering the last engine it
// looked up: a stage's replicas are usually of one engine, so a large
// pick looks up its tokenizer once rather than once per candidate.
type schemeMemo struct {
	p         *PrefixAware
	name      string
	blockSize int
	s         scheme
	ok        bool
}

func (m *schemeMemo) of(r *Replica) scheme {
	e := &r.Engine
	if m.p.source != PrefixSourceAuto || !e.KVEvents || e.BlockSize <= 0 {
		return scheme{}
	}
	if !m.ok || e.Name != m.name || e.BlockSize != m.blockSize {
		m.name, m.blockSize, m.s, m.ok = e.Name, e.BlockSize, m.p.schemeOf(r), true
	}
	return m.s
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
	loads   []float64
	cur     []int64
	ord     *order // the pick's rendezvous order (Request.order)
}

var pickScratchPool = sync.Pool{New: func() any { return new(pickScratch) }}

// Pick implements Policy.
func (p *PrefixAware) Pick(req *Request, c []*Replica) Decision {
	sp := pickScratchPool.Get().(*pickScratch)
	defer pickScratchPool.Put(sp)
	sp.ord = req.order
	defer func() { sp.ord = nil }()
	sc := newScorer(c, p.MaxAge)
	cs := slices.Grow(sp.cs[:0], len(c))[:len(c)]
	sp.cs = cs
	schemes := sp.schemes[:0]
	memo := schemeMemo{p: p}
	for i, r := range c {
		cs[i] = cand{r: r, s: memo.of(r), score: sc.scoreSinceReport(r)}
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
	// within it: no sort (distinct keys have distinct weights).
	rendezvous := func() int {
		if req.Text == "" && len(req.Tokens) == 0 {
			return least // nothing to agree on
		}
		chosen := req.order.argmax(p.root(req), len(cs), func(i int) Key { return cs[i].r.Key }, func(i int) bool { return within(cs[i]) })
		if chosen < 0 {
			return least
		}
		return chosen
	}
	// In the head-side mode a chat's later turn goes to its
	// conversation's home, which every head computes alike (homeOf),
	// unless that is overloaded.
	home, homeFallback := -1, false
	if conv, ok := p.conversationOf(req, cs); ok {
		home, homeFallback = p.homeOf(conv, cs, sc, sp)
	} else if hs := p.hashesOf(req, scheme{}); p.RootBlocks > 0 && len(hs) > p.RootBlocks {
		// An input longer than its root has a home: the first replica
		// in its rendezvous order within the bound, which counts as
		// holding at least the root. Where this head knows no more of
		// the input than a prefix many inputs share (a system prompt,
		// held by many replicas), every head then sends it home, where
		// other heads may have put the rest of it; what this head knows
		// beyond the root still wins.
		cs[rendezvous()].floor = float64(p.RootBlocks) / float64(len(hs))
	}
	chosen := least
	best := home
	if home < 0 {
		best = longest(func(cand) bool { return true })
	}
	switch {
	case best < 0:
		chosen = rendezvous()
	case homeFallback:
		chosen, d.Reason = home, ReasonLoadFallback
	case home < 0 && p.overloaded(cs[best].score, cs[least].score):
		// Load rules the preferred replica out, and every other one
		// as loaded; among the rest the cache still decides (a shorter
		// match, such as a shared system prompt, beats none).
		d.Reason = ReasonLoadFallback
		if alt := longest(func(x cand) bool { return !p.overloaded(x.score, cs[least].score) }); alt >= 0 {
			chosen = alt
		}
	default:
		chosen, d.Reason = best, ReasonPrefixMatch
		if home >= 0 || within(cs[best]) {
			break // a conversation's home is within its own bound
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
		// this input. Its worker tells every head (RoutedBlocks).
		hs := p.hashesOf(req, x.s)
		p.index.Insert(x.r.Key, hs)
		if x.r.Engine.RoutedSubscription {
			d.RoutedBlocks = hs
		}
	}
	return d
}

// conversationOf is req's conversation key (see conversationKey) when
// every candidate is in the head-side mode and some candidate's worker
// does not share the blocks heads route to it (EngineInfo.
// RoutedSubscription: an older worker); ok is false otherwise, and for an
// input that is not a rendered chat.
func (p *PrefixAware) conversationOf(req *Request, cs []cand) (uint64, bool) {
	shared := true
	for _, x := range cs {
		if x.s.engine != "" {
			return 0, false // engine reports: the index is every head's
		}
		shared = shared && x.r.Engine.RoutedSubscription
	}
	if shared {
		// Every candidate's worker tells every head what each head
		// routed there (routed-block reports): the index is every
		// head's, and its longest match decides, as with one head.
		return 0, false
	}
	return conversationKey(req.Text)
}

// conversationKey names the conversation of a chat rendered as
// tokenizers.ChatText renders it: the FNV-1a hash of its opening (the text
// before the first assistant message), which every later turn starts with.
// ok is false for a first turn (no assistant message yet: the index places
// it), for a text that does not start with a system, developer or user
// message, and for one whose opening has no user message.
func conversationKey(text string) (uint64, bool) {
	if !strings.HasPrefix(text, "system: ") && !strings.HasPrefix(text, "developer: ") && !strings.HasPrefix(text, "user: ") {
		return 0, false
	}
	i := strings.Index(text, "\nassistant: ")
	if i < 0 {
		return 0, false // a first turn: nothing of its own to keep yet
	}
	open := text[:i]
	if !strings.HasPrefix(open, "user: ") && !strings.Contains(open, "\nuser: ") {
		return 0, false
	}
	h := fnv.New64a()
	h.Write([]byte(open))
	return h.Sum64(), true
}

// homeOf is the home of conversation conv among cs (head-side mode): the
// first replica in conv's rendezvous order whose load, smoothed over
// HomeLoadWindow, is within conv's own bound, lightest + (0.5 + 2u)·
// max((ReplicateFactor−1)·avg, ReplicateSlack) with u in [0, 1) a hash of
// conv, and that is not overloaded now (fallback: the first within the
// bound was). Every input is the same on every head, so heads agree without
// talking; the why of each term is in docs/routing.md, prefix_aware, step 6.
func (p *PrefixAware) homeOf(conv uint64, cs []cand, sc scorer, sp *pickScratch) (home int, fallback bool) {
	loads := slices.Grow(sp.loads[:0], len(cs))[:len(cs)]
	sp.loads = loads
	window := float64(p.HomeLoadWindow)
	if window <= 0 {
		window = float64(DefaultHomeLoadWindow)
	}
	now := sc.now
	if p.clock != nil {
		now = p.clock()
	}
	cur := slices.Grow(sp.cur[:0], len(cs))[:len(cs)]
	sp.cur = cur
	var total float64
	least := int64(math.MaxInt64)
	p.smoothMu.Lock()
	for i, x := range cs {
		s := p.smooth[x.r.Key]
		if s == nil {
			s = &smoothedLoad{}
			p.smooth[x.r.Key] = s
		}
		cur[i] = sharedLoad(x.r, sc)
		least = min(least, cur[i])
		switch {
		case s.at == 0:
			s.v, s.at = float64(cur[i]), now
		case now > s.at:
			s.v += (1 - math.Exp(-float64(now-s.at)/window)) * (float64(cur[i]) - s.v)
			s.at = now
		}
		loads[i] = s.v
		total += s.v
	}
	p.smoothMu.Unlock()
	avg := total / float64(len(cs))
	lightest := slices.Min(loads)
	u := float64(mix64(conv^0x5bd1e995)>>11) / (1 << 53)
	bound := lightest + (0.5+2*u)*max(avg*(p.ReplicateFactor-1), float64(p.ReplicateSlack))
	// The first in rendezvous order within the bound, and the first
	// that is also not overloaded: no sort.
	keyOf := func(i int) Key { return cs[i].r.Key }
	first := sp.ord.argmax(conv, len(cs), keyOf, func(i int) bool { return loads[i] <= bound })
	home = sp.ord.argmax(conv, len(cs), keyOf, func(i int) bool { return loads[i] <= bound && !p.overloaded(cur[i], least) })
	switch {
	case first < 0: // unreachable: the lightest is within
		return slices.Index(loads, lightest), false
	case home < 0:
		return first, false // every one within is overloaded: all alike
	}
	return home, home != first
}

// sharedLoad is r's load as every head sees it: what r reported, when
// fresh; this head's scorer otherwise (a stale report, or an engine that
// reports none, where the head's own in-flight count is all it knows).
func sharedLoad(r *Replica, sc scorer) int64 {
	if at := r.loadAt.Load(); at != 0 && sc.now-at <= sc.maxAge {
		return r.Load()
	}
	return sc.score(r)
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
func (p *PrefixAware) Forget(k Key) {
	p.index.Forget(k)
	p.smoothMu.Lock()
	delete(p.smooth, k)
	p.smoothMu.Unlock()
}

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

// UsesRoutedBlocks reports whether r is in the head-side mode, whose
// index other heads' picks feed (routed-block reports).
func (p *PrefixAware) UsesRoutedBlocks(r *Replica) bool { return p.schemeOf(r).engine == "" }

// ApplyRoutedBlocks records a routed-block report for r (the head-side
// blocks a head routed there: as if this head had routed them; a snapshot
// adds the recent ones to what this head guessed), or forgets r's blocks
// when the report says its cache was cleared. Replicas in the
// engine-reported mode ignore it.
func (p *PrefixAware) ApplyRoutedBlocks(r *Replica, ev *stagepb.KvEvents) {
	if p.schemeOf(r).engine != "" {
		return
	}
	if ev.GetCleared() && !ev.GetSnapshot() {
		p.index.Forget(r.Key)
	}
	if len(ev.GetStored()) > 0 {
		p.index.Insert(r.Key, ev.GetStored())
	}
}

// UsesKVEvents reports whether the policy reads r's engine reports (r is in
// the engine-reported mode).
func (p *PrefixAware) UsesKVEvents(r *Replica) bool { return p.schemeOf(r).engine != "" }
