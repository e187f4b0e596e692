package router

import (
	"cmp"
	"math"
	"math/bits"
	"slices"
	"sync/atomic"
)

// LargeStage is the size of a stage (replicas in the snapshot, routable or
// not) above which Pick reads a bounded set of replicas instead of all of
// them (docs/routing.md, Large stages). Up to it every policy reads every
// replica.
const LargeStage = 64

// orderGroups is how many groups a large stage's replicas are hashed
// into for the rendezvous order (see stageOrder). Fixed, so that every
// head, whatever it has seen, places a replica in the same group.
const orderGroups = 128

// orderWidth is how many eligible replicas of each of the key's
// orderDepth heaviest groups a large pick reads: the first
// orderWidth×orderDepth of the key's order, on which heads agree.
const (
	orderWidth = 8
	orderDepth = 2
)

// Salts that keep a replica's group and a group's weight independent of
// the replica weights (weight).
const (
	groupSalt      = 0x2545f4914f6cdd1d
	groupScoreSalt = 0x9fb21c651e98df25
)

// stageOrder is a stage's replicas by group (groupOf), each group sorted
// by replica id: the structure a large stage's rendezvous order reads.
// The snapshot writer keeps it (with, without: one group's slice and the
// group array are copied per join or leave); it is immutable once
// published.
//
// The order of a key is two-level rendezvous: groups by weighted
// rendezvous (a group's weight is its size, so each replica is a key's
// first choice with probability 1/N, as in flat rendezvous), then a
// group's members by their own rendezvous weight. A pick then hashes
// orderGroups groups and the members of the groups it reads (about
// 2N/orderGroups), not N replicas. A join or a leave changes one group's
// size: keys move only into (join) or out of (leave) that group, about
// 1/N of them, and inside it about 1/N more move to or from the replica:
// about 2/N in all, against 1/N for flat rendezvous (TestStageOrderMoves).
type stageOrder struct {
	groups  [orderGroups][]member
	maxSize int // the largest group's size
	// heads memoizes keys' order heads (orderHead), filled by picks: a
	// key seen since the last change of the stage's membership (a new
	// stageOrder, whose memo starts empty) is not hashed against the
	// groups again. Allocated on the first pick that reads the order.
	heads atomic.Pointer[headMemo]
}

// headSlots is how many keys' order heads a stage's order memoizes: a
// direct-mapped table, a key's slot taken by the latest key hashed to it.
const headSlots = 1024

// headMemo is a stage order's memo of order heads, one per slot.
type headMemo [headSlots]headSlot

// headSlot is one slot of a headMemo: the memoized head, and the latest
// key that missed it. A key is memoized in an empty slot, or when it
// misses a second time in a row, so that keys picked once (most sessions
// of a busy stage) cost a store, not a head's allocation, and do not
// evict a key picked often.
type headSlot struct {
	head   atomic.Pointer[orderHead]
	missed atomic.Uint64
}

// maxKnown bounds the group scores an orderHead keeps: heaviest computes
// about 12 (a key that needed more is not memoized).
const maxKnown = 32

// orderHead is what a pick computes of a key's order before it reads any
// replica: the key's orderDepth heaviest groups (heaviest), the group
// scores that computed (so that a memoized pick's argmax and weight see
// what a fresh one sees), and each top group's topScan heaviest members,
// ranked from their inline keys. It depends on the membership alone, not
// on loads or on which replicas are eligible (a pick checks those), so it
// holds until the order changes. Immutable once built.
type orderHead struct {
	key    uint64
	best   [orderDepth]int
	floor  float64
	known  [orderGroups / 64]uint64
	scores [maxKnown]float64 // of the known groups, in group order
	heads  [orderDepth][topScan]*Replica
	nheads [orderDepth]int
}

// memo is o's head memo, allocated by the first caller.
func (o *stageOrder) memo() *headMemo {
	if m := o.heads.Load(); m != nil {
		return m
	}
	o.heads.CompareAndSwap(nil, new(headMemo))
	return o.heads.Load()
}

// member is one replica of a group, its key's hash inline so that a
// pick weighs a group's members without reading each replica.
type member struct {
	key uint64 // mix64(keyHash): weight(k, rep.Key) is mix64(k ^ key)
	rep *Replica
}

// searchMembers is the position of replica id in a group, and whether
// it is there.
func searchMembers(g []member, id uint32) (int, bool) {
	return slices.BinarySearchFunc(g, id, func(m member, id uint32) int { return cmp.Compare(m.rep.Key.Replica, id) })
}

// keyHash is the 64-bit name of a replica key that the hashes mix.
func keyHash(k Key) uint64 { return uint64(k.Stage)<<32 | uint64(k.Replica) }

// groupOf is the group of a replica key.
func groupOf(k Key) int { return int(mix64(keyHash(k)^groupSalt) % orderGroups) }

// with is o with rep added or replacing the replica under its key; o may
// be nil (an empty stage).
func (o *stageOrder) with(rep *Replica) *stageOrder {
	next := &stageOrder{}
	if o != nil {
		next.groups, next.maxSize = o.groups, o.maxSize // not the memo
	}
	g := groupOf(rep.Key)
	old := next.groups[g]
	m := member{key: mix64(keyHash(rep.Key)), rep: rep}
	i, found := searchMembers(old, rep.Key.Replica)
	if found {
		next.groups[g] = slices.Clone(old)
		next.groups[g][i] = m
		return next
	}
	next.groups[g] = slices.Insert(slices.Clip(old), i, m)
	next.maxSize = max(next.maxSize, len(next.groups[g]))
	return next
}

// without is o less the replica under k.
func (o *stageOrder) without(k Key) *stageOrder {
	if o == nil {
		return nil
	}
	g := groupOf(k)
	i, found := searchMembers(o.groups[g], k.Replica)
	if !found {
		return o
	}
	next := &stageOrder{groups: o.groups} // not the memo
	next.groups[g] = slices.Delete(slices.Clone(o.groups[g]), i, i+1)
	for _, ms := range next.groups {
		next.maxSize = max(next.maxSize, len(ms))
	}
	return next
}

// newStageOrder builds the order of a stage's replicas from scratch.
func newStageOrder(st []*Replica) *stageOrder {
	o := &stageOrder{}
	for _, rep := range st { // sorted by id: each group stays sorted
		g := groupOf(rep.Key)
		o.groups[g] = append(o.groups[g], member{key: mix64(keyHash(rep.Key)), rep: rep})
		o.maxSize = max(o.maxSize, len(o.groups[g]))
	}
	return o
}

// groupScore is the weighted rendezvous score of group g of size n for
// key k: n / −ln(u), u uniform in (0, 1) from the two hashes (groupU).
// The heaviest group wins with probability n / (sum of the sizes).
func groupScore(k uint64, g, n int) float64 {
	if n == 0 {
		return 0
	}
	return float64(n) / -math.Log(groupU(k, g))
}

// groupU is the uniform draw in (0, 1) of group g for key k.
func groupU(k uint64, g int) float64 {
	return (float64(mix64(k^groupMix[g])>>11) + 0.5) / (1 << 53)
}

// groupMix is mix64(g ^ groupScoreSalt) for each group: a constant of the
// order, hashed once rather than on every pick.
var groupMix = func() (m [orderGroups]uint64) {
	for g := range m {
		m[g] = mix64(uint64(g) ^ groupScoreSalt)
	}
	return m
}()

// pruneMargin keeps heaviest's pruning exact: a group is skipped only
// when its draw is below the bound by a relative margin far above the
// rounding error of math.Log and math.Exp (about 1e-16), so that it
// cannot score as much as the second heaviest group found so far; and
// far above the 2⁻³¹ resolution of a score in weight's high bits, so
// that a skipped group's members weigh less than a top group's
// (argmax), with a relative gap of at least 1e-5·n₂/(nmax·37) > 1e-8
// (−ln u ≤ 37 for the draws groupU makes; group sizes within 10×).
const pruneMargin = 1 - 1e-5

// order is one pick's view of a large stage's rendezvous order: the
// group scores of up to two keys, each computed at most once, and only
// for the groups the pick needs (the two heaviest, and the groups of the
// candidates it weighs). A nil *order is flat rendezvous (weight), as
// small stages use. One pick's: not safe for concurrent use.
type order struct {
	o      *stageOrder
	keys   [2]uint64
	nkeys  int
	known  [2][orderGroups / 64]uint64 // which scores are computed
	scores [2][orderGroups]float64
	// floor is the score of the key's orderDepth-th heaviest group once
	// heaviest ran for it (floorOK): every group not known scores less.
	floor   [2]float64
	floorOK [2]bool
	head    orderHead // a head computed and not memoized (headOf)
}

// reset points ord at a stage's order and forgets the cached scores.
func (ord *order) reset(o *stageOrder) {
	ord.o, ord.nkeys = o, 0
}

// slotOf is the slot of key k's scores, cached for the first two keys.
func (ord *order) slotOf(k uint64) int {
	for i := range ord.nkeys {
		if ord.keys[i] == k {
			return i
		}
	}
	i := ord.nkeys
	if i == len(ord.keys) {
		i = len(ord.keys) - 1 // a third key: recompute in the last slot
	} else {
		ord.nkeys++
	}
	ord.keys[i] = k
	ord.known[i] = [orderGroups / 64]uint64{}
	ord.floorOK[i] = false
	return i
}

// isKnown reports whether the score of group g is computed in slot i.
func (ord *order) isKnown(i, g int) bool { return ord.known[i][g/64]&(1<<(g%64)) != 0 }

// score is the score of group g for the key in slot i, computed once.
func (ord *order) score(i int, g int) float64 {
	if ord.isKnown(i, g) {
		return ord.scores[i][g]
	}
	v := groupScore(ord.keys[i], g, len(ord.o.groups[g]))
	ord.scores[i][g] = v
	ord.known[i][g/64] |= 1 << (g % 64)
	return v
}

// weight is the rendezvous weight of replica key for k: flat (weight)
// without a large stage's order, else the two-level order's, folded into
// one number: the group's score in the high 42 bits (a positive float's
// bits order as it does), the replica's own weight in the low 22. Two
// replicas of one group that tie in those bits go, in a pick's one pass,
// to the lower id (candidates are sorted by id).
func (ord *order) weight(k uint64, key Key) uint64 {
	if ord == nil || ord.o == nil {
		return weight(k, key)
	}
	s := ord.score(ord.slotOf(k), groupOf(key))
	return math.Float64bits(s)>>21<<22 | weight(k, key)>>42
}

// heaviest is k's orderDepth heaviest groups, heaviest first (-1: fewer
// non-empty groups), ties to the lower group. It hashes every group but
// takes the logarithm only of those whose draw could beat the second
// heaviest so far (pruneMargin): about a tenth of them.
func (ord *order) heaviest(k uint64) [orderDepth]int {
	i := ord.slotOf(k)
	var best [orderDepth]int
	var bs [orderDepth]float64
	for d := range best {
		best[d] = -1
	}
	nmax := float64(ord.o.maxSize)
	bound := 0.0 // draws below it score less than bs[orderDepth-1]
	for g := range ord.o.groups {
		n := len(ord.o.groups[g])
		if n == 0 {
			continue
		}
		if !ord.isKnown(i, g) && groupU(k, g) < bound {
			continue
		}
		v := ord.score(i, g)
		for d := range best {
			if best[d] < 0 || v > bs[d] {
				copy(best[d+1:], best[d:len(best)-1])
				copy(bs[d+1:], bs[d:len(bs)-1])
				best[d], bs[d] = g, v
				if last := bs[orderDepth-1]; last > 0 {
					// n/−ln(u) ≥ last needs u ≥ exp(−n/last) ≥ exp(−nmax/last).
					bound = math.Exp(-nmax/last) * pruneMargin
				}
				break
			}
		}
	}
	ord.floor[i], ord.floorOK[i] = bs[orderDepth-1], true
	return best
}

// argmax is the index of the heaviest for k (weight) of the n candidates
// that keep accepts, the first of equals; -1 when it accepts none. keep
// must be pure. Once heaviest ran for k, the groups it skipped score
// below its floor: when the heaviest candidate of a known group is in
// one of the key's top groups (the usual case: the pick read their
// heads), no candidate of a skipped group can weigh more, and their
// groups' logarithms are not taken.
func (ord *order) argmax(k uint64, n int, keyOf func(int) Key, keep func(int) bool) int {
	best, bw := -1, uint64(0)
	if ord != nil && ord.o != nil {
		if i := ord.slotOf(k); ord.floorOK[i] {
			unknown, bg := false, 0
			for j := range n {
				if !keep(j) {
					continue
				}
				key := keyOf(j)
				g := groupOf(key)
				if !ord.isKnown(i, g) {
					unknown = true
					continue
				}
				if w := math.Float64bits(ord.scores[i][g])>>21<<22 | weight(k, key)>>42; best < 0 || w > bw {
					best, bw, bg = j, w, g
				}
			}
			if best >= 0 && (!unknown || ord.scores[i][bg] >= ord.floor[i]) {
				return best
			}
			best = -1
		}
	}
	for j := range n {
		if keep(j) {
			if w := ord.weight(k, keyOf(j)); best < 0 || w > bw {
				best, bw = j, w
			}
		}
	}
	return best
}

// topScan is how many of a group's heaviest members top ranks before it
// reads any replica: when orderWidth of them are eligible, the rest of
// the group cannot come before them. A group with more than
// topScan−orderWidth of its head out (asleep, ejected, excluded) is read
// in full (slowTopOf): slower, same result.
const topScan = orderWidth + orderWidth/2

// top appends to c the first orderWidth eligible replicas of each of k's
// orderDepth heaviest groups, in k's order: the head of the order, which
// every head given the same membership computes alike. It ranks a
// group's topScan heaviest members from their inline keys (or takes them
// from the order's memo, headOf), then reads replicas in that order until
// orderWidth are eligible (usually orderWidth reads); only a group with
// fewer eligible among those is scanned in full.
func (ord *order) top(k uint64, c, exclude []*Replica) []*Replica {
	h := ord.headOf(k)
	for d, g := range h.best {
		if g < 0 {
			break
		}
		c = topOf(k, ord.o.groups[g], h.heads[d][:h.nheads[d]], c, exclude)
	}
	return c
}

// headOf is k's orderHead: from the order's memo, its group scores then
// restored into ord as heaviest would have left them, or computed
// (heaviest, then each top group ranked), and memoized on the key's
// second miss in a row (headSlot).
func (ord *order) headOf(k uint64) *orderHead {
	i := ord.slotOf(k)
	slot := &ord.o.memo()[mix64(k)%headSlots]
	if h := slot.head.Load(); h != nil && h.key == k {
		j := 0
		for w, known := range h.known {
			ord.known[i][w] |= known
			for b := known; b != 0; b &= b - 1 {
				ord.scores[i][w*64+bits.TrailingZeros64(b)] = h.scores[j]
				j++
			}
		}
		ord.floor[i], ord.floorOK[i] = h.floor, true
		return h
	}
	h := &ord.head // this pick's, unless it is memoized below
	if slot.missed.Swap(k) == k || slot.head.Load() == nil {
		h = new(orderHead)
	}
	*h = orderHead{key: k, best: ord.heaviest(k), floor: ord.floor[i], known: ord.known[i]}
	for d, g := range h.best {
		if g >= 0 {
			h.nheads[d] = rankHead(k, ord.o.groups[g], &h.heads[d])
		}
	}
	if h == &ord.head || bits.OnesCount64(h.known[0])+bits.OnesCount64(h.known[1]) > maxKnown {
		return h // not memoized: a first miss, or (rare) too many scores
	}
	j := 0
	for w, known := range h.known {
		for b := known; b != 0; b &= b - 1 {
			h.scores[j] = ord.scores[i][w*64+bits.TrailingZeros64(b)]
			j++
		}
	}
	slot.head.Store(h)
	return h
}

// rankHead puts the topScan heaviest members of group ms for k into
// heads, heaviest first, and returns how many.
func rankHead(k uint64, ms []member, heads *[topScan]*Replica) int {
	var ws [topScan]uint64
	n := 0
	for _, m := range ms {
		n = keepHeaviest(heads[:], ws[:], n, m.rep, mix64(k^m.key)) // weight(k, m.rep.Key)
	}
	return n
}

// topOf appends the first orderWidth eligible members of group ms in k's
// order, given heads, its heaviest members (rankHead).
func topOf(k uint64, ms []member, heads, c, exclude []*Replica) []*Replica {
	found := 0
	for _, rep := range heads {
		if found == orderWidth {
			break
		}
		if eligible(rep, exclude) {
			c = append(c, rep)
			found++
		}
	}
	if found == orderWidth || len(heads) == len(ms) {
		return c // the whole group weighed, or enough eligible at its head
	}
	return slowTopOf(k, ms, c[:len(c)-found], exclude)
}

// slowTopOf is topOf reading every member: a group whose heaviest
// topScan members are mostly out.
func slowTopOf(k uint64, ms []member, c, exclude []*Replica) []*Replica {
	var tops [orderWidth]*Replica
	var ws [orderWidth]uint64
	n := 0
	for _, m := range ms {
		w := mix64(k ^ m.key) // weight(k, m.rep.Key)
		if n == orderWidth && w <= ws[n-1] {
			continue
		}
		if eligible(m.rep, exclude) {
			n = keepHeaviest(tops[:], ws[:], n, m.rep, w)
		}
	}
	return append(c, tops[:n]...)
}

// keepHeaviest inserts rep of weight w into the n replicas of reps (by
// weight in ws, heaviest first), which hold at most len(reps): the
// lightest falls out when they are full, and rep is dropped when it is
// lighter than all of them. It returns the new count.
func keepHeaviest(reps []*Replica, ws []uint64, n int, rep *Replica, w uint64) int {
	if n == len(reps) && w <= ws[n-1] {
		return n
	}
	i := n
	if n < len(reps) {
		n++
	} else {
		i = n - 1
	}
	for ; i > 0 && ws[i-1] < w; i-- {
		reps[i], ws[i] = reps[i-1], ws[i-1]
	}
	reps[i], ws[i] = rep, w
	return n
}
