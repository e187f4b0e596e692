package router

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

func key(id uint32) Key { return Key{Replica: id} }

func TestPrefixIndexLongestMatch(t *testing.T) {
	x := NewPrefixIndex(100)
	x.Insert(key(0), []uint64{1, 2, 3, 4})
	x.Insert(key(1), []uint64{1, 2})
	x.Insert(key(2), []uint64{9})
	assert.Equal(t, []int{3, 2, 0}, x.Match([]uint64{1, 2, 3, 5}, []Key{key(0), key(1), key(2)}))
	assert.Equal(t, []int{0, 0, 1}, x.Match([]uint64{9, 1}, []Key{key(0), key(1), key(2)}), "a match starts at the first block")
	assert.Equal(t, []int{0}, x.Match([]uint64{1}, []Key{key(3)}), "unknown replica")
	assert.Equal(t, []int{0}, x.Match(nil, []Key{key(0)}))
	assert.Equal(t, 5, x.Len())
}

func TestPrefixIndexEvictsLeastRecentlyUsed(t *testing.T) {
	x := NewPrefixIndex(4)
	x.Insert(key(0), []uint64{1, 2, 3})
	x.Match([]uint64{1}, []Key{key(0)}) // 1 is used again: 2 is now the oldest
	x.Insert(key(0), []uint64{7, 8})
	assert.Equal(t, 4, x.Len(), "bounded")
	assert.Equal(t, []int{1}, x.Match([]uint64{1, 2, 3}, []Key{key(0)}), "2 was evicted, which cuts the chain after 1")
	assert.Equal(t, []int{2}, x.Match([]uint64{7, 8}, []Key{key(0)}))
}

func TestPrefixIndexForgetDropsAReplica(t *testing.T) {
	x := NewPrefixIndex(100)
	x.Insert(key(0), []uint64{1, 2, 3})
	x.Insert(key(1), []uint64{1, 2})
	x.Forget(key(0))
	assert.Equal(t, []int{0, 2}, x.Match([]uint64{1, 2, 3}, []Key{key(0), key(1)}))
	assert.Equal(t, 2, x.Len(), "blocks no one holds are gone")
	x.Forget(key(1))
	assert.Equal(t, 0, x.Len())
}

func TestPrefixIndexEngineReports(t *testing.T) {
	x := NewPrefixIndex(100)
	k := key(0)
	// Reports arrive out of order: the eviction (seq 3) before the store (seq 2).
	x.Apply(k, &stagepb.KvEvents{Seq: 3, Removed: []uint64{2}})
	x.Apply(k, &stagepb.KvEvents{Seq: 2, Stored: []uint64{1, 2, 3}})
	assert.Equal(t, []int{1}, x.Match([]uint64{1, 2, 3}, []Key{k}), "a late report does not resurrect an evicted block")
	x.Insert(k, []uint64{1, 2, 3})
	assert.Equal(t, []int{1}, x.Match([]uint64{1, 2, 3}, []Key{k}), "a guess never overrides the engine")
	x.Apply(k, &stagepb.KvEvents{Seq: 4, Stored: []uint64{2}})
	assert.Equal(t, []int{3}, x.Match([]uint64{1, 2, 3}, []Key{k}))

	x.Apply(k, &stagepb.KvEvents{Seq: 6, Cleared: true, Stored: []uint64{5}})
	x.Apply(k, &stagepb.KvEvents{Seq: 5, Stored: []uint64{1}})
	assert.Equal(t, []int{0}, x.Match([]uint64{1}, []Key{k}), "reports from before a clear are stale")
	assert.Equal(t, []int{1}, x.Match([]uint64{5}, []Key{k}), "what the clearing report stored is held")
}

// TestPrefixIndexResetToSnapshot: a snapshot replaces every older belief
// about its replica, keeps a newer report that came first, leaves other
// replicas alone, and a report older than it is stale.
func TestPrefixIndexResetToSnapshot(t *testing.T) {
	x := NewPrefixIndex(100)
	k, other := Key{Replica: 1}, Key{Replica: 2}
	x.Apply(k, &stagepb.KvEvents{Seq: 3, Stored: []uint64{1, 2}})
	x.Apply(k, &stagepb.KvEvents{Seq: 9, Stored: []uint64{7}}) // newer than the snapshot
	x.Apply(other, &stagepb.KvEvents{Seq: 4, Stored: []uint64{1}})
	x.Reset(k, &stagepb.KvEvents{Seq: 8, Snapshot: true, Cleared: true, Stored: []uint64{5}})
	assert.Equal(t, []int{0, 1}, x.Match([]uint64{1}, []Key{k, other}), "the snapshot does not hold 1; the other replica still does")
	assert.Equal(t, []int{1}, x.Match([]uint64{5}, []Key{k}))
	assert.Equal(t, []int{1}, x.Match([]uint64{7}, []Key{k}), "a report newer than the snapshot stays")
	x.Apply(k, &stagepb.KvEvents{Seq: 6, Stored: []uint64{2}})
	assert.Equal(t, []int{0}, x.Match([]uint64{2}, []Key{k}), "a report older than the snapshot is stale")
	x.Apply(k, &stagepb.KvEvents{Seq: 10, Removed: []uint64{5}})
	assert.Equal(t, []int{0}, x.Match([]uint64{5}, []Key{k}), "later reports apply")
}

// refIndex is a brute-force model of PrefixIndex: plain maps and a recency
// slice, everything recomputed by scanning.
type refIndex struct {
	capacity  int
	holders   map[uint64]map[Key]holder
	recent    []uint64 // most recent first
	clearedAt map[Key]uint64
}

func newRefIndex(capacity int) *refIndex {
	return &refIndex{capacity: capacity, holders: map[uint64]map[Key]holder{}, clearedAt: map[Key]uint64{}}
}

func (r *refIndex) touch(h uint64) {
	r.recent = slices.DeleteFunc(r.recent, func(x uint64) bool { return x == h })
	r.recent = slices.Insert(r.recent, 0, h)
}

func (r *refIndex) get(h uint64) map[Key]holder {
	if r.holders[h] == nil {
		r.holders[h] = map[Key]holder{}
		r.touch(h)
	}
	return r.holders[h]
}

func (r *refIndex) drop(h uint64) {
	delete(r.holders, h)
	r.recent = slices.DeleteFunc(r.recent, func(x uint64) bool { return x == h })
}

func (r *refIndex) evict() {
	for len(r.holders) > r.capacity {
		r.drop(r.recent[len(r.recent)-1])
	}
}

func (r *refIndex) match(hashes []uint64, keys []Key) []int {
	out := make([]int, len(keys))
	stopped := make([]bool, len(keys))
	for _, h := range hashes {
		hs, ok := r.holders[h]
		if !ok {
			break
		}
		any := false
		for k, key := range keys {
			if stopped[k] {
				continue
			}
			if hs[key].held {
				out[k]++
				any = true
			} else {
				stopped[k] = true
			}
		}
		if !any {
			break
		}
		r.touch(h)
		if !slices.Contains(stopped, false) {
			break
		}
	}
	return out
}

func (r *refIndex) insert(key Key, hashes []uint64) {
	for _, h := range hashes {
		hs := r.get(h)
		if old, ok := hs[key]; !ok || old.seq == 0 {
			hs[key] = holder{key: key, held: true, seq: old.seq}
		}
		r.touch(h)
	}
	r.evict()
}

func (r *refIndex) forgetWhere(drop func(holder) bool) {
	for h, hs := range r.holders {
		for k, hd := range hs {
			if drop(hd) {
				delete(hs, k)
			}
		}
		if len(hs) == 0 {
			r.drop(h)
		}
	}
}

func (r *refIndex) apply(key Key, ev *stagepb.KvEvents) {
	seq := ev.GetSeq()
	if ev.GetCleared() && seq > r.clearedAt[key] {
		r.clearedAt[key] = seq
		r.forgetWhere(func(hd holder) bool { return hd.key == key && hd.seq < seq })
	}
	if seq < r.clearedAt[key] {
		return
	}
	set := func(h uint64, held bool) {
		hs := r.get(h)
		if old, ok := hs[key]; !ok || old.seq <= seq {
			hs[key] = holder{key: key, seq: seq, held: held}
		}
		r.touch(h)
	}
	for _, h := range ev.GetRemoved() {
		set(h, false)
	}
	for _, h := range ev.GetStored() {
		set(h, true)
	}
	r.evict()
}

func (r *refIndex) forget(key Key) {
	delete(r.clearedAt, key)
	r.forgetWhere(func(hd holder) bool { return hd.key == key })
}

// state renders an index's content, most recent block first.
func (x *PrefixIndex) state() []string {
	x.mu.Lock()
	defer x.mu.Unlock()
	var out []string
	for e := x.lru.next; e != &x.lru; e = e.next {
		hs := slices.Clone(e.holders)
		slices.SortFunc(hs, func(a, b holder) int { return int(a.key.Replica) - int(b.key.Replica) })
		out = append(out, fmt.Sprint(e.hash, hs))
	}
	return out
}

func (r *refIndex) state() []string {
	var out []string
	for _, h := range r.recent {
		var hs []holder
		for _, hd := range r.holders[h] {
			hs = append(hs, hd)
		}
		slices.SortFunc(hs, func(a, b holder) int { return int(a.key.Replica) - int(b.key.Replica) })
		out = append(out, fmt.Sprint(h, hs))
	}
	return out
}

// TestPrefixIndexMatchesBruteForce runs random operations on the index and
// on the brute-force model and requires the same answers and the same
// content (recency order included) after every step.
func TestPrefixIndexMatchesBruteForce(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		capacity := rapid.IntRange(1, 12).Draw(t, "capacity")
		x, ref := NewPrefixIndex(capacity), newRefIndex(capacity)
		keyGen := rapid.Custom(func(t *rapid.T) Key { return key(rapid.Uint32Range(0, 3).Draw(t, "replica")) })
		hashesGen := rapid.SliceOfN(rapid.Uint64Range(1, 16), 0, 8)
		for step := range rapid.IntRange(1, 60).Draw(t, "steps") {
			switch op := rapid.IntRange(0, 9).Draw(t, "op"); {
			case op < 3:
				k, hs := keyGen.Draw(t, "key"), hashesGen.Draw(t, "hashes")
				x.Insert(k, hs)
				ref.insert(k, hs)
			case op < 6:
				k := keyGen.Draw(t, "key")
				all := rapid.SliceOfNDistinct(rapid.Uint64Range(1, 16), 0, 8, rapid.ID).Draw(t, "blocks")
				split := rapid.IntRange(0, len(all)).Draw(t, "split")
				ev := &stagepb.KvEvents{
					Seq:     rapid.Uint64Range(1, 20).Draw(t, "seq"),
					Cleared: rapid.IntRange(0, 5).Draw(t, "clear") == 0,
					Stored:  all[:split],
					Removed: all[split:],
				}
				x.Apply(k, ev)
				ref.apply(k, ev)
			case op < 7:
				k := keyGen.Draw(t, "key")
				x.Forget(k)
				ref.forget(k)
			default:
				hs := hashesGen.Draw(t, "query")
				keys := rapid.SliceOfNDistinct(keyGen, 1, 4, func(k Key) Key { return k }).Draw(t, "keys")
				require.Equal(t, ref.match(hs, keys), x.Match(hs, keys), "step %d: match", step)
			}
			require.Equal(t, ref.state(), x.state(), "step %d: content", step)
			require.LessOrEqual(t, x.Len(), capacity)
		}
	})
}

// replicas returns n replicas that are not connected to anything: enough
// for a policy, which only reads their keys, loads and engine info.
func replicas(n int) []*Replica {
	out := make([]*Replica, n)
	for i := range out {
		out[i] = &Replica{Key: key(uint32(i))}
	}
	return out
}

func TestPrefixAwareConvergesThenSpillsUnderLoad(t *testing.T) {
	p := NewPrefixAware(PolicyOptions{})
	c := replicas(3)
	system := strings.Repeat("You are a helpful assistant who answers briefly. ", 20)

	first := p.Pick(&Request{Text: system + "user: hello"}, c)
	assert.Equal(t, ReasonLoad, first.Reason, "nothing cached anywhere yet")
	assert.Equal(t, PrefixHead, first.PrefixSource)
	home := first.Replica
	for i := range 20 {
		text := system + fmt.Sprintf("user: question %d", i)
		d := p.Pick(&Request{Text: text}, c)
		require.Same(t, home, d.Replica, "requests sharing a prefix converge")
		assert.Equal(t, ReasonPrefixMatch, d.Reason)
		assert.Equal(t, len(system)/HeadBlockBytes, d.MatchBlocks)
		assert.Equal(t, len(HeadBlockHashes(text)), d.InputBlocks)
	}

	// The home replica is now far busier than the others: load decides.
	home.SetLoad(DefaultBalanceAbs + 2)
	d := p.Pick(&Request{Text: system + "user: one more"}, c)
	assert.Equal(t, ReasonLoadFallback, d.Reason)
	assert.NotSame(t, home, d.Replica)
	spill := d.Replica
	// The spill replica holds the prefix now too; with both equally
	// matched, the less loaded of the two wins.
	home.SetLoad(1)
	d = p.Pick(&Request{Text: system + "user: and another"}, c)
	assert.Equal(t, ReasonPrefixMatch, d.Reason)
	assert.Same(t, spill, d.Replica)

	// A replica that leaves is forgotten.
	p.Forget(spill.Key)
	p.Forget(home.Key)
	d = p.Pick(&Request{Text: system + "user: anyone?"}, c)
	assert.Equal(t, ReasonLoad, d.Reason)
}

func TestPrefixAwareFallbackKeepsTheBestMatchItCan(t *testing.T) {
	p := NewPrefixAware(PolicyOptions{})
	c := replicas(3)
	system := strings.Repeat("a shared system prompt of some length. ", 20)
	history := system + strings.Repeat("a long conversation that only one replica has seen. ", 20)
	p.Index().Insert(c[0].Key, HeadBlockHashes(history))
	p.Index().Insert(c[1].Key, HeadBlockHashes(system))
	c[0].SetLoad(DefaultBalanceAbs + 1)
	c[1].SetLoad(1)
	d := p.Pick(&Request{Text: history + "user: next"}, c)
	assert.Equal(t, ReasonLoadFallback, d.Reason)
	assert.Same(t, c[1], d.Replica, "the system prompt's holder beats an idle replica with nothing")
	assert.Equal(t, len(system)/HeadBlockBytes, d.MatchBlocks)

	// A replica that is overloaded too is out, match or not.
	c[1].SetLoad(DefaultBalanceAbs)
	d = p.Pick(&Request{Text: history + "user: next"}, c)
	assert.Equal(t, ReasonLoadFallback, d.Reason)
	assert.Same(t, c[2], d.Replica)
}

func TestPrefixAwareUsesEngineReports(t *testing.T) {
	words := func(s string) []uint32 {
		var ids []uint32
		for _, w := range strings.Fields(s) {
			ids = append(ids, uint32(len(w))) // a toy tokenizer: ids are word lengths
		}
		return ids
	}
	opts := PolicyOptions{Tokenizers: map[string]Tokenizer{"toy": words}}
	c := replicas(2)
	for _, r := range c {
		r.Engine = EngineInfo{Name: "toy", BlockSize: 4, KVEvents: true}
	}
	prompt := strings.Repeat("one three eleven letters ", 8) // 32 tokens: 8 blocks

	p := NewPrefixAware(opts)
	d := p.Pick(&Request{Text: prompt}, c)
	assert.Equal(t, ReasonLoad, d.Reason)
	assert.Equal(t, PrefixEngine, d.PrefixSource)
	assert.Equal(t, 8, d.InputBlocks)
	assert.Equal(t, 0, p.Index().Len(), "the head does not guess for an engine that reports")

	// Replica 1 reports the first 5 blocks; replica 0 reports nothing.
	hashes := stagepb.BlockHashes(words(prompt), 4)
	p.ApplyKVEvents(c[1], &stagepb.KvEvents{Seq: 1, Stored: hashes[:5]})
	d = p.Pick(&Request{Text: prompt}, c)
	assert.Equal(t, ReasonPrefixMatch, d.Reason)
	assert.Same(t, c[1], d.Replica)
	assert.Equal(t, 5, d.MatchBlocks)

	// With the head's source forced, the same engines get guesses instead,
	// and reports are ignored.
	h := NewPrefixAware(PolicyOptions{Tokenizers: opts.Tokenizers, PrefixSource: PrefixSourceHead})
	h.ApplyKVEvents(c[1], &stagepb.KvEvents{Seq: 1, Stored: hashes})
	assert.Equal(t, 0, h.Index().Len())
	d = h.Pick(&Request{Text: prompt}, c)
	assert.Equal(t, PrefixHead, d.PrefixSource)
	assert.Equal(t, len(HeadBlockHashes(prompt)), h.Index().Len())

	// An engine without a tokenizer on the head is guessed for.
	c[0].Engine.Name = "unknown"
	assert.Equal(t, scheme{}, p.schemeOf(c[0]))
}

func TestPrefixAwareWithoutTextRoutesByLoad(t *testing.T) {
	p := NewPrefixAware(PolicyOptions{})
	c := replicas(2)
	c[0].SetLoad(3)
	for range 5 {
		d := p.Pick(&Request{}, c)
		assert.Equal(t, ReasonLoad, d.Reason)
		assert.Same(t, c[1], d.Replica)
		assert.Equal(t, 0, d.InputBlocks)
	}
	assert.Equal(t, 0, p.Index().Len())
}

func BenchmarkPrefixAwarePick(b *testing.B) {
	p := NewPrefixAware(PolicyOptions{})
	c := replicas(8)
	system := strings.Repeat("You are a helpful assistant who answers briefly. ", 40)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			i++
			p.Pick(&Request{Text: system + fmt.Sprintf("user %d: question %d", i%512, i)}, c)
		}
	})
}

// A token-id input routes by its ids: the engine's blocks of them where
// the engine reports, the head's fixed-size id blocks otherwise.
func TestPrefixAwareRoutesTokenIDs(t *testing.T) {
	shared := make([]uint32, 4*HeadBlockTokens)
	for i := range shared {
		shared[i] = uint32(1000 + i)
	}
	ids := func(tail uint32) []uint32 { return append(slices.Clone(shared), tail, tail+1, tail+2) }

	p := NewPrefixAware(PolicyOptions{})
	c := replicas(3)
	home := p.Pick(&Request{Tokens: ids(1)}, c).Replica
	d := p.Pick(&Request{Tokens: ids(7)}, c)
	assert.Equal(t, ReasonPrefixMatch, d.Reason)
	assert.Same(t, home, d.Replica)
	assert.Equal(t, 4, d.MatchBlocks)
	assert.Equal(t, HeadTokenBlockHashes(ids(7)), HeadTokenBlockHashes(ids(9)), "a partial last block is not hashed")
	assert.NotEqual(t, HeadTokenBlockHashes(shared)[1], HeadTokenBlockHashes(shared[HeadBlockTokens:])[0], "hashes are chained")

	// Engine-reported: the ids are the engine's own, hashed as it does
	// (no tokenizer is needed, but the engine must be one the head names).
	e := NewPrefixAware(PolicyOptions{Tokenizers: map[string]Tokenizer{"toy": func(string) []uint32 { return nil }}})
	for _, r := range c {
		r.Engine = EngineInfo{Name: "toy", BlockSize: 4, KVEvents: true}
	}
	e.ApplyKVEvents(c[2], &stagepb.KvEvents{Seq: 1, Stored: stagepb.BlockHashes(shared, 4)})
	d = e.Pick(&Request{Tokens: ids(1)}, c)
	assert.Equal(t, ReasonPrefixMatch, d.Reason)
	assert.Same(t, c[2], d.Replica)
	assert.Equal(t, PrefixEngine, d.PrefixSource)
	assert.Equal(t, len(shared)/4, d.MatchBlocks)
}

// A prefix that carries half the traffic is served from more than one
// replica: its holder takes no more than its share of the load, the rest
// goes to copies (prefix_replicated), and the load stays balanced while
// most requests still find their prefix.
func TestPrefixAwareReplicatesAHotPrefix(t *testing.T) {
	p := NewPrefixAware(PolicyOptions{})
	c := replicas(4)
	systems := make([]string, 4)
	for i := range systems {
		systems[i] = strings.Repeat(fmt.Sprintf("system prompt %d says something long. ", i), 20)
	}
	served := map[*Replica]int{}
	reasons := map[Reason]int{}
	var running []*Replica // each request runs for the next 12 picks
	for i := range 2000 {
		sys := systems[0]
		if i%2 == 1 {
			sys = systems[1+i/2%3]
		}
		d := p.Pick(&Request{Text: sys + fmt.Sprintf("user %d: a question", i)}, c)
		d.Replica.Acquire()
		running = append(running, d.Replica)
		if len(running) > 12 {
			running[0].Release()
			running = running[1:]
		}
		served[d.Replica]++
		reasons[d.Reason]++
	}
	busiest, idlest := 0, len(c)*2000
	for _, r := range c {
		busiest, idlest = max(busiest, served[r]), min(idlest, served[r])
	}
	assert.LessOrEqual(t, float64(busiest), 1.5*float64(idlest), "served: %v", served)
	assert.Positive(t, reasons[ReasonPrefixReplicated], "reasons: %v", reasons)
	assert.Greater(t, reasons[ReasonPrefixMatch]+reasons[ReasonPrefixReplicated], 1900, "reasons: %v", reasons)
}
