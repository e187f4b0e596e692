package router

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// TestLargeStageLoadQuality: at 10,000 replicas with distinct loads (a
// random permutation of 0..9,999), each chosen replica then taking its
// request (so the lightest fill up), least_loaded and deadline read a
// bounded sample, yet the replica they choose is on average within the
// least loaded 5% at the pick and in 95% of picks within the least
// loaded 12%. A uniform random pick averages 50% and fails both.
func TestLargeStageLoadQuality(t *testing.T) {
	const n = 10000
	for _, pc := range []struct {
		name string
		p    Policy
		req  func() *Request
	}{
		// Reports that stay fresh however slow the run (-race).
		{"least_loaded", LeastLoaded{MaxAge: time.Hour}, func() *Request { return &Request{} }},
		{"deadline", &Deadline{MaxAge: time.Hour}, func() *Request { return &Request{Deadline: time.Now().Add(time.Hour)} }},
	} {
		t.Run(pc.name, func(t *testing.T) {
			r, reps := benchRouter(n, StageRouting{Policy: pc.p}, EngineInfo{})
			// count[s] is how many replicas score s (load + in flight).
			count := make([]int, 2*n)
			for i, l := range rand.Perm(n) {
				reps[i].SetLoad(int64(l))
				count[l]++
			}
			ranks := make([]float64, 0, 2000)
			for range cap(ranks) {
				d, err := r.Pick(0, pc.req(), nil)
				require.NoError(t, err)
				score := d.Replica.Load() + d.Replica.InFlight()
				below := 0
				for _, c := range count[:score] {
					below += c
				}
				ranks = append(ranks, float64(below)/n)
				d.Replica.Acquire()
				count[score]--
				count[score+1]++
			}
			slices.Sort(ranks)
			var sum float64
			for _, x := range ranks {
				sum += x
			}
			assert.Less(t, sum/float64(len(ranks)), 0.05, "mean rank")
			assert.Less(t, ranks[len(ranks)*95/100], 0.12, "95th percentile rank")
		})
	}
}

// orderReplicas are n routable replicas connected to nothing, ids
// 0..n-1 shuffled by seed, so that a snapshot built by adding them
// in that order differs from another only in its history.
func orderReplicas(n int, seed uint64) []*Replica {
	reps := make([]*Replica, n)
	for i, id := range rand.New(rand.NewPCG(seed, 1)).Perm(n) {
		reps[i] = &Replica{Key: key(uint32(id) * 7)}
		reps[i].healthy.Store(true)
	}
	return reps
}

// grown is a router whose stage 0 got reps through the snapshot writer
// (Snapshot.with), one join at a time.
func grown(st StageRouting, reps []*Replica) *Router {
	r := New([]StageRouting{st}, nil, nil)
	for _, rep := range reps {
		r.snap.Store(r.snap.Load().with(rep))
	}
	return r
}

// TestLargeStageHeadsAgree: two routers (heads) given the same 2,000
// replicas, joined in different orders, send every session and every
// prefix nobody holds (a first turn, and a chat's later turn going to
// its conversation's home) to the same replica, though each reads its
// own random load sample.
func TestLargeStageHeadsAgree(t *testing.T) {
	const n = 2000
	mk := func(seed uint64) (*Router, *Router) {
		reps := orderReplicas(n, seed)
		aff := grown(StageRouting{Policy: LeastLoaded{}, SessionAffinity: true}, reps)
		pa := grown(StageRouting{Policy: NewPrefixAware(PolicyOptions{PrefixSource: PrefixSourceHead})}, reps)
		return aff, pa
	}
	a1, p1 := mk(1)
	a2, p2 := mk(2)
	spread := map[uint32]bool{}
	for i := range 200 {
		req := func() *Request { return &Request{SessionKey: fmt.Sprintf("session-%d", i)} }
		d1, err := a1.Pick(0, req(), nil)
		require.NoError(t, err)
		d2, err := a2.Pick(0, req(), nil)
		require.NoError(t, err)
		require.Equal(t, d1.Replica.Key, d2.Replica.Key, "session %d", i)
		assert.Equal(t, ReasonAffinity, d1.Reason)
		spread[d1.Replica.Key.Replica] = true

		text := strings.Repeat(fmt.Sprintf("system prompt %d. ", i), 30) + "user: hi"
		chat := fmt.Sprintf("system: be brief %d\nuser: hello %d\nassistant: hi\nuser: and?", i, i)
		for _, in := range []string{text, chat} {
			d1, err = p1.Pick(0, &Request{Text: in}, nil)
			require.NoError(t, err)
			d2, err = p2.Pick(0, &Request{Text: in}, nil)
			require.NoError(t, err)
			require.Equal(t, d1.Replica.Key, d2.Replica.Key, "input %q", in[:20])
		}
	}
	assert.Greater(t, len(spread), 150, "sessions spread over the stage")
}

// firstChoices is, for each key, its first replica in the order of a
// stage of reps.
func firstChoices(reps []*Replica, keys []uint64) []Key {
	var ord order
	ord.reset(newStageOrder(sortedByID(reps)))
	out := make([]Key, len(keys))
	for i, k := range keys {
		ord.nkeys = 0
		out[i] = ord.top(k, nil, nil)[0].Key
	}
	return out
}

func sortedByID(reps []*Replica) []*Replica {
	s := slices.Clone(reps)
	slices.SortFunc(s, func(a, b *Replica) int { return compareKeys(a.Key, b.Key) })
	return s
}

// TestStageOrderMoves: in a large stage's order, a replica that joins
// becomes the first choice of about 1/N of the keys and moves about 2/N in
// all (at most 3/N); one that leaves moves its own keys and about as many
// again; and each replica is the first choice of about 1/N of the keys.
func TestStageOrderMoves(t *testing.T) {
	const n, nk = 300, 30000
	reps := orderReplicas(n+1, 3)
	keys := make([]uint64, nk)
	for i := range keys {
		keys[i] = mix64(uint64(i) + 12345)
	}
	before := firstChoices(reps[:n], keys)
	after := firstChoices(reps, keys)
	joined := reps[n].Key
	moved, toNew := 0, 0
	for i := range keys {
		if before[i] != after[i] {
			moved++
			if after[i] == joined {
				toNew++
			}
		}
	}
	share := float64(nk) / n
	t.Logf("join: %d moved, %d to the new replica (1/N of keys: %.0f)", moved, toNew, share)
	assert.InDelta(t, share, float64(toNew), share/2, "the new replica takes about 1/N")
	assert.Less(t, float64(moved), 3*share, "a join moves about 2/N")

	// A leave, of the first replica: only its keys and about as many.
	left := reps[0].Key
	gone := firstChoices(reps[1:n], keys)
	moved, own := 0, 0
	for i := range keys {
		if before[i] != gone[i] {
			moved++
			if before[i] == left {
				own++
			}
		}
		assert.NotEqual(t, left, gone[i])
	}
	t.Logf("leave: %d moved, %d of them its own", moved, own)
	assert.InDelta(t, share, float64(own), share/2)
	assert.Less(t, float64(moved), 3*share, "a leave moves about 2/N")

	counts := map[Key]int{}
	for _, k := range before {
		counts[k]++
	}
	var most int
	for _, c := range counts {
		most = max(most, c)
	}
	assert.Greater(t, len(counts), n*95/100, "almost every replica is someone's first choice")
	assert.Less(t, float64(most), 2.2*share, "no replica is the first choice of far more than 1/N")
}

// TestLargeStagePrefix: at 10,000 replicas, prefix_aware still finds an
// engine-reported prefix held by 3 replicas, and a head-side prefix held
// by every replica of the stage (a system prompt sent everywhere), without
// reading them all; a session over its load bound leaves its replica.
func TestLargeStagePrefix(t *testing.T) {
	const n = 10000
	toy := EngineInfo{Name: "toy", BlockSize: 16, KVEvents: true}
	p := NewPrefixAware(PolicyOptions{Tokenizers: map[string]Tokenizer{"toy": byteTokens}})
	r, reps := benchRouter(n, StageRouting{Policy: p}, toy)
	for _, rep := range reps {
		rep.SetLoad(0)
	}
	text := strings.Repeat("a long shared system prompt. ", 40)
	holders := []*Replica{reps[11], reps[4242], reps[9001]}
	for i, rep := range holders {
		p.ApplyKVEvents(rep, &stagepb.KvEvents{Seq: uint64(i + 1), Stored: stagepb.BlockHashes(byteTokens(text), toy.BlockSize)})
	}
	for range 50 {
		d, err := r.Pick(0, &Request{Text: text + "question?"}, nil)
		require.NoError(t, err)
		assert.Contains(t, holders, d.Replica)
		assert.Equal(t, ReasonPrefixMatch, d.Reason)
		assert.Positive(t, d.MatchBlocks)
	}

	ph := NewPrefixAware(PolicyOptions{PrefixSource: PrefixSourceHead})
	r, reps = benchRouter(n, StageRouting{Policy: ph}, EngineInfo{})
	for _, rep := range reps {
		rep.SetLoad(0)
		ph.Index().Insert(rep.Key, HeadBlockHashes(text))
	}
	long := text + strings.Repeat("a private history. ", 20)
	ph.Index().Insert(reps[777].Key, HeadBlockHashes(long))
	d, err := r.Pick(0, &Request{Text: long + "next?"}, nil)
	require.NoError(t, err)
	assert.Equal(t, reps[777], d.Replica, "the longest match, among 10,000 holders of its start")
	assert.Equal(t, len(HeadBlockHashes(long)), d.MatchBlocks)

	// Session affinity over a large stage: the session's replica until
	// it is over the bound.
	r, reps = benchRouter(n, StageRouting{Policy: LeastLoaded{}, SessionAffinity: true}, EngineInfo{})
	for _, rep := range reps {
		rep.SetLoad(1)
	}
	d, err = r.Pick(0, &Request{SessionKey: "s"}, nil)
	require.NoError(t, err)
	assert.Equal(t, ReasonAffinity, d.Reason)
	home := d.Replica
	home.SetLoad(50)
	d, err = r.Pick(0, &Request{SessionKey: "s"}, nil)
	require.NoError(t, err)
	assert.Equal(t, ReasonLoadFallback, d.Reason)
	assert.NotEqual(t, home, d.Replica)
	home.SetLoad(1)
	d, err = r.Pick(0, &Request{SessionKey: "s"}, []*Replica{home})
	require.NoError(t, err)
	assert.NotEqual(t, home, d.Replica, "an excluded home is not picked")
}

// TestLargeStageIneligible: a large stage's pick never returns a replica
// that is out or excluded, and falls back to reading the stage when its
// draws find nothing eligible.
func TestLargeStageIneligible(t *testing.T) {
	for _, st := range []StageRouting{
		{Policy: LeastLoaded{}},
		{Policy: &Deadline{}},
		{Policy: LeastLoaded{}, SessionAffinity: true},
		{Policy: NewPrefixAware(PolicyOptions{PrefixSource: PrefixSourceHead})},
	} {
		t.Run(st.Policy.Name(), func(t *testing.T) {
			r, reps := benchRouter(5000, st, EngineInfo{})
			for i, rep := range reps {
				if i != 17 && i != 4000 {
					rep.healthy.Store(false)
				}
			}
			for i := range 50 {
				d, err := r.Pick(0, &Request{SessionKey: fmt.Sprint(i), Text: fmt.Sprint("text ", i)}, []*Replica{reps[4000]})
				require.NoError(t, err)
				assert.Same(t, reps[17], d.Replica)
			}
			_, err := r.Pick(0, &Request{}, []*Replica{reps[17], reps[4000]})
			assert.ErrorIs(t, err, ErrNoReplica)
		})
	}
}

// TestPickAllocsFlat: a pick allocates no more at 10,000 replicas than at
// 100 (pooled scratch; the request's own hashes aside).
func TestPickAllocsFlat(t *testing.T) {
	if raceEnabled {
		t.Skip("under -race sync.Pool drops items at random: the scratch's allocations are noise")
	}
	for _, st := range []StageRouting{
		{Policy: LeastLoaded{}},
		{Policy: &Deadline{}},
		{Policy: LeastLoaded{}, SessionAffinity: true},
		{Policy: NewPrefixAware(PolicyOptions{PrefixSource: PrefixSourceHead})},
	} {
		allocs := func(n int) float64 {
			r, _ := benchRouter(n, st, EngineInfo{})
			req := &Request{SessionKey: "s", Text: strings.Repeat("some text ", 40)}
			return testing.AllocsPerRun(200, func() { _, _ = r.Pick(0, req, nil) })
		}
		assert.LessOrEqual(t, allocs(10000), allocs(100)+1, st.Policy.Name())
	}
}

// TestOrderTopExact: the order's shortcuts (group logarithms pruned by a
// bound, a group's head ranked from inline keys before any replica is
// read, argmax leaving out the groups heaviest skipped, a key's head
// memoized by the order) change no result: for stages of several sizes
// with a share of replicas out and some excluded, top, argmax and weight
// equal a plain computation that scores every group and reads every member.
func TestOrderTopExact(t *testing.T) {
	for _, tc := range []struct {
		n   int
		out float64 // share of replicas not routable
	}{{100, 0}, {1000, 0.3}, {10000, 0.1}, {10000, 0.9}, {3000, 1}} {
		reps := orderReplicas(tc.n, uint64(tc.n))
		rng := rand.New(rand.NewPCG(uint64(tc.n), 2))
		for _, rep := range reps {
			if rng.Float64() < tc.out {
				rep.healthy.Store(false)
			}
		}
		exclude := []*Replica{reps[0], reps[1], reps[2]}
		o := newStageOrder(sortedByID(reps))
		var ord order
		for i := range 2000 {
			k := mix64(uint64(i) ^ uint64(tc.n))
			ord.reset(o)
			got := ord.top(k, nil, exclude)
			want := plainTop(o, k, exclude)
			require.Equal(t, keysOf(want), keysOf(got), "n=%d out=%v key %d", tc.n, tc.out, i)
			// A pick's candidates: the head of the order and a sample; the
			// heaviest among those a random bound keeps.
			c := append(got, reps[rng.IntN(len(reps))], reps[rng.IntN(len(reps))], reps[rng.IntN(len(reps))])
			for range 30 {
				c = append(c, reps[rng.IntN(len(reps))])
			}
			rng.Shuffle(len(c), func(a, b int) { c[a], c[b] = c[b], c[a] })
			var s [orderGroups]float64
			for g := range s {
				s[g] = groupScore(k, g, len(o.groups[g]))
			}
			plain := func(rep *Replica) uint64 {
				return math.Float64bits(s[groupOf(rep.Key)])>>21<<22 | weight(k, rep.Key)>>42
			}
			keep := make([]bool, len(c))
			for j := range keep {
				keep[j] = rng.IntN(4) != 0 || i%5 == 0 && j < len(got)
			}
			best := -1
			for j, rep := range c {
				if keep[j] && (best < 0 || plain(rep) > plain(c[best])) {
					best = j
				}
			}
			require.Equal(t, best, ord.argmax(k, len(c), func(j int) Key { return c[j].Key }, func(j int) bool { return keep[j] }), "n=%d key %d", tc.n, i)
			for _, rep := range c {
				require.Equal(t, plain(rep), ord.weight(k, rep.Key))
			}
			// Session affinity over c: the heaviest within the load bound, and
			// whether it is the heaviest of all.
			c = slices.Compact(c)
			for _, rep := range c {
				rep.SetLoad(int64(rng.IntN(6)))
			}
			sc := newScorer(c, 0)
			var total int64
			for _, rep := range c {
				total += sc.score(rep)
			}
			bound := int64(math.Ceil(AffinityLoadFactor * float64(total+1) / float64(len(c))))
			heaviest, chosen := -1, -1
			for j, rep := range c {
				if heaviest < 0 || plain(rep) > plain(c[heaviest]) {
					heaviest = j
				}
				if sc.score(rep)+1 <= bound && (chosen < 0 || plain(rep) > plain(c[chosen])) {
					chosen = j
				}
			}
			// Again from the order's memo (headOf): the same head, and
			// the same choice.
			ord.reset(o)
			require.Equal(t, keysOf(want), keysOf(ord.top(k, nil, exclude)), "n=%d key %d, memoized", tc.n, i)
			gotRep, gotFirst := Affinity{}.pickKey(k, c, &ord)
			require.Same(t, c[chosen], gotRep, "n=%d key %d", tc.n, i)
			require.Equal(t, chosen == heaviest, gotFirst, "n=%d key %d", tc.n, i)
		}
	}
}

// plainTop is order.top computed the plain way: every group's score,
// every member read.
func plainTop(o *stageOrder, k uint64, exclude []*Replica) []*Replica {
	var s [orderGroups]float64
	for g := range s {
		s[g] = groupScore(k, g, len(o.groups[g]))
	}
	best := [orderDepth]int{-1, -1}
	for g, v := range s {
		if v == 0 {
			continue
		}
		for d := range best {
			if best[d] < 0 || v > s[best[d]] {
				copy(best[d+1:], best[d:len(best)-1])
				best[d] = g
				break
			}
		}
	}
	var c []*Replica
	for _, g := range best {
		if g >= 0 {
			c = slowTopOf(k, o.groups[g], c, exclude)
		}
	}
	return c
}

func keysOf(c []*Replica) []Key {
	out := make([]Key, len(c))
	for i, rep := range c {
		out[i] = rep.Key
	}
	return out
}

// TestOrderHeadMemo: a key's order head, memoized by the stage's order on
// its first pick (an empty slot) or its second (a slot another key held),
// gives the plain computation's top on later picks while replicas go out
// and come back (the memo holds no eligibility), and a
// join or a leave (a new order) starts from an empty memo: a replica that
// joins at the head of a key's order is read, one that leaves is not.
func TestOrderHeadMemo(t *testing.T) {
	const n = 10000
	reps := orderReplicas(n, 5)
	o := newStageOrder(sortedByID(reps))
	rng := rand.New(rand.NewPCG(5, 6))
	var ord order
	topOn := func(o *stageOrder, k uint64) []*Replica {
		ord.reset(o)
		return ord.top(k, nil, nil)
	}
	memoOf := func(o *stageOrder, k uint64) *orderHead {
		m := o.heads.Load()
		if m == nil {
			return nil
		}
		return m[mix64(k)%headSlots].head.Load()
	}
	for i := range 300 {
		k := mix64(uint64(i) + 777)
		if h := memoOf(o, k); h != nil {
			require.NotEqual(t, k, h.key, "key %d memoized before its first pick", i) // another key's slot
		}
		require.Equal(t, keysOf(plainTop(o, k, nil)), keysOf(topOn(o, k)), "key %d, first pick", i)
		if h := memoOf(o, k); h == nil || h.key != k {
			// Its slot held another key: memoized on its second miss.
			require.Equal(t, keysOf(plainTop(o, k, nil)), keysOf(topOn(o, k)), "key %d, second pick", i)
		}
		h := memoOf(o, k)
		require.NotNil(t, h, "key %d not memoized", i)
		require.Equal(t, k, h.key)
		require.Equal(t, keysOf(plainTop(o, k, nil)), keysOf(topOn(o, k)), "key %d, memoized", i)

		// Out and back: the memo still serves, and the pick reads who is in.
		var out []*Replica
		for _, rep := range topOn(o, k) {
			if rng.IntN(2) == 0 {
				rep.healthy.Store(false)
				out = append(out, rep)
			}
		}
		got := topOn(o, k)
		require.Same(t, h, memoOf(o, k))
		require.Equal(t, keysOf(plainTop(o, k, nil)), keysOf(got), "key %d, %d of its head out", i, len(out))
		for _, rep := range out {
			require.NotContains(t, got, rep)
			rep.healthy.Store(true)
		}
		require.Equal(t, keysOf(plainTop(o, k, nil)), keysOf(topOn(o, k)), "key %d, back in", i)

		// A join that becomes the key's first choice: a replica in its
		// heaviest group that weighs more than the group's heaviest.
		g, first := h.best[0], h.heads[0][0]
		id := uint32(n * 7)
		for groupOf(key(id)) != g || weight(k, key(id)) <= weight(k, first.Key) {
			id++
		}
		joined := &Replica{Key: key(id)}
		joined.healthy.Store(true)
		grown := o.with(joined)
		require.Nil(t, grown.heads.Load(), "a new order starts with an empty memo")
		got = topOn(grown, k)
		require.Same(t, joined, got[0], "key %d: the joined replica heads its order", i)
		require.Equal(t, keysOf(plainTop(grown, k, nil)), keysOf(got))
		// A leave of the key's first choice.
		shrunk := o.without(first.Key)
		got = topOn(shrunk, k)
		require.NotContains(t, got, first, "key %d: the replica that left", i)
		require.Equal(t, keysOf(plainTop(shrunk, k, nil)), keysOf(got))
		// The old order's memo is untouched by the new orders'.
		require.Same(t, h, memoOf(o, k))
	}
}

// TestOrderHeadMemoConcurrent: picks that fill and read one order's memo
// at once (run with -race) each get the plain computation's top.
func TestOrderHeadMemoConcurrent(t *testing.T) {
	const n, nk, workers = 5000, 64, 4
	reps := orderReplicas(n, 9)
	o := newStageOrder(sortedByID(reps))
	want := make([][]Key, nk)
	for i := range want {
		want[i] = keysOf(plainTop(o, mix64(uint64(i)), nil))
	}
	var wg sync.WaitGroup
	errs := make(chan string, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var ord order
			for j := range 2000 {
				i := (j*7 + w) % nk
				ord.reset(o)
				if got := keysOf(ord.top(mix64(uint64(i)), nil, nil)); !slices.Equal(got, want[i]) {
					errs <- fmt.Sprintf("worker %d key %d: %v, want %v", w, i, got, want[i])
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
}
