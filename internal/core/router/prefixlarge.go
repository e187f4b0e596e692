package router

import (
	"math/rand/v2"
	"slices"
)

// prefixHolders is how many holders of an input's cached prefix, per
// hash scheme, a large stage's prefix_aware pick reads (the longest
// matches first).
const prefixHolders = 16

// holderBudget bounds the index holders one deepest call looks at.
const holderBudget = 8 * prefixHolders

// largeCandidates adds to c (a large stage's load sample) what
// prefix_aware decides by besides load: the first replicas of the
// prefix's rendezvous order (where a prefix nobody holds goes, where a
// hot one spills), of the conversation's when the input is a chat's later
// turn (its home), and the replicas holding the longest cached prefix of
// the input in each hash scheme found among the candidates. keys is
// scratch space, returned for reuse.
func (p *PrefixAware) largeCandidates(req *Request, s *Snapshot, stage int, ord *order, c, exclude []*Replica, keys []Key) ([]*Replica, []Key) {
	if req.Text == "" && len(req.Tokens) == 0 {
		return c, keys // nothing to match or agree on: load decides
	}
	c = ord.top(p.root(req), c, exclude)
	if conv, ok := conversationKey(req.Text); ok {
		c = ord.top(conv, c, exclude)
	}
	// The schemes of the candidates so far: a stage's engines are
	// usually of one kind, and a kind the draws missed is rare enough
	// to be decided by load.
	var schemes [4]scheme
	ns := 0
	memo := schemeMemo{p: p}
	for _, rep := range c {
		if sch := memo.of(rep); ns < len(schemes) && !slices.Contains(schemes[:ns], sch) {
			schemes[ns] = sch
			ns++
		}
	}
	for _, sch := range schemes[:ns] {
		keys = p.index.deepest(p.hashesOf(req, sch), prefixHolders, func(k Key) bool {
			rep, ok := s.Lookup(k)
			return ok && memo.of(rep) == sch && eligible(rep, exclude)
		}, keys[:0])
		for _, k := range keys {
			if rep, ok := s.Lookup(k); ok {
				c = append(c, rep)
			}
		}
	}
	clear(keys)
	return c, keys[:0]
}

// deepest appends to out up to max keys that keep accepts, of replicas
// holding the deepest blocks of hashes: first the holders of the deepest
// block the index has, then of shallower ones at doubling steps, each
// block's holders from a random offset, at most holderBudget holders
// looked at in all. Its cost follows max and the input's length, not how
// many replicas hold a block (a shared system prompt may be held by every
// replica of a stage).
func (x *PrefixIndex) deepest(hashes []uint64, max int, keep func(Key) bool, out []Key) []Key {
	if len(hashes) == 0 || max <= 0 {
		return out
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	d := 0
	for d < len(hashes) {
		if e := x.entries[hashes[d]]; e == nil || len(e.holders) == 0 {
			break
		}
		d++
	}
	start, budget := len(out), holderBudget
	for i, step := d-1, 1; i >= 0 && budget > 0 && len(out)-start < max; i, step = i-step, step*2 {
		if i < step && i > 0 {
			step = i // end on the first block
		}
		hs := x.entries[hashes[i]].holders
		off := rand.IntN(len(hs))
		for j := range hs {
			if budget == 0 || len(out)-start == max {
				break
			}
			budget--
			hd := hs[(off+j)%len(hs)]
			if hd.held && !slices.Contains(out[start:], hd.key) && keep(hd.key) {
				out = append(out, hd.key)
			}
		}
	}
	return out
}
