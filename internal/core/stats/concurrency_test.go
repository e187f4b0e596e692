package stats

import (
	"sync"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// tally is what one recorder goroutine sent to one engine index.
type tally struct{ prompt, gen, stop float64 }

// TestConcurrentRecordsDuringMembershipChanges streams records for existing
// replicas from several goroutines while the head loop joins, detaches and
// rejoins replicas. Every record must land: no unregistered records, and each
// replica's sums equal what was sent.
func TestConcurrentRecordsDuringMembershipChanges(t *testing.T) {
	reg, l := newTestLogger(t, Options{})
	rg := newIndexes()
	keyOf := map[int]replicaKey{}

	// published holds the indices recorders may use: only registered ones,
	// as the router only routes to replicas after Register.
	var published atomic.Pointer[[]int]
	var indices []int
	join := func(k replicaKey) {
		idx, err := rg.Attach(k)
		require.NoError(t, err)
		require.NoError(t, l.Register(idx, replica(k.Stage, k.Replica)))
		if _, ok := keyOf[idx]; !ok {
			keyOf[idx] = k
			indices = append(indices, idx)
			snap := append([]int(nil), indices...)
			published.Store(&snap)
		}
	}
	for i := range 4 {
		join(replicaKey{Stage: i % 2, Replica: uint32(10 * i)})
	}

	const recorders = 4
	const minRecords = 2000 // per recorder, also after the head is done
	stop := make(chan struct{})
	tallies := make([]map[int]*tally, recorders)
	var wg sync.WaitGroup
	for w := range recorders {
		tallies[w] = map[int]*tally{}
		wg.Go(func() {
			mine := tallies[w]
			for n := 0; ; n++ {
				if n >= minRecords {
					select {
					case <-stop:
						return
					default:
					}
				}
				idxs := *published.Load()
				idx := idxs[(n*7+w)%len(idxs)]
				tl := mine[idx]
				if tl == nil {
					tl = &tally{}
					mine[idx] = tl
				}
				prompt, gen := uint64(1+n%3), uint64(1+w)
				if err := l.Record(idx, &stagepb.EngineStats{PromptTokens: prompt, GenerationTokens: gen, NumRequestsRunning: 1}); err != nil {
					t.Errorf("record %d: %v", idx, err)
					return
				}
				tl.prompt += float64(prompt)
				tl.gen += float64(gen)
				if n%5 == 0 {
					if err := l.RecordFinished(idx, Finished{Reason: stagepb.FinishReason_FINISH_REASON_STOP, PromptTokens: int(prompt)}); err != nil {
						t.Errorf("finished %d: %v", idx, err)
						return
					}
					tl.stop++
				}
				if n%50 == 0 {
					if err := l.SetSleepState(idx, stagepb.SleepState(n%3)); err != nil {
						t.Errorf("sleep %d: %v", idx, err)
						return
					}
				}
			}
		})
	}

	// The head loop: joins, leaves and rejoins while records flow.
	attached := map[int]bool{}
	for _, idx := range indices {
		attached[idx] = true
	}
	for i := range 200 {
		switch i % 4 {
		case 0:
			join(replicaKey{Stage: i % 3, Replica: uint32(1000 + i)})
			attached[indices[len(indices)-1]] = true
		case 1, 2:
			idx := indices[(i*5)%len(indices)]
			require.NoError(t, l.Detach(idx))
			attached[idx] = false
		case 3:
			for _, idx := range indices {
				if !attached[idx] {
					join(keyOf[idx])
					attached[idx] = true
					break
				}
			}
		}
	}
	close(stop)
	wg.Wait()
	if t.Failed() {
		return
	}

	s := gatherSeries(t, reg)
	require.Equal(t, 0.0, s["troupe_stats_unregistered_records_total{}"])
	for _, idx := range indices {
		var want tally
		for _, m := range tallies {
			if tl := m[idx]; tl != nil {
				want.prompt += tl.prompt
				want.gen += tl.gen
				want.stop += tl.stop
			}
		}
		k := keyOf[idx]
		require.Equal(t, want.prompt, s[seriesKey("troupe_prompt_tokens_total", k.Stage, k.Replica)], "prompt %s", k)
		require.Equal(t, want.gen, s[seriesKey("troupe_generation_tokens_total", k.Stage, k.Replica)], "gen %s", k)
		require.Equal(t, want.stop, s[seriesKey("troupe_request_success_total", k.Stage, k.Replica, "finished_reason", "stop")], "stop %s", k)
		require.Equal(t, want.stop, s[seriesKey("troupe_request_prompt_tokens_count", k.Stage, k.Replica)], "finished %s", k)
		wantAttached := 0.0
		if attached[idx] {
			wantAttached = 1
		} else {
			require.Equal(t, 0.0, s[seriesKey("troupe_num_requests_running", k.Stage, k.Replica)], "detached %s shows no load", k)
		}
		require.Equal(t, wantAttached, s[seriesKey("troupe_replica_attached", k.Stage, k.Replica)], "attached %s", k)
	}
}

// modelReplica is the property test's model of one replica.
type modelReplica struct {
	key      replicaKey
	index    int
	attached bool
	k        int // largest K registered
	prompt   float64
	gen      float64
	hits     float64
	perPos   []float64
}

// TestMembershipProperty runs random interleavings of join, leave, rejoin and
// record across several stages against a simple model: every replica's
// counters equal what was recorded for it, indices never move, and no counter
// ever decreases.
func TestMembershipProperty(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		reg := prometheus.NewRegistry()
		l, err := New(reg, testModel, Options{})
		if err != nil {
			rt.Fatal(err)
		}
		// The invariant check runs after every step and gathers the registry.
		checkReg := reg
		rg := newIndexes()
		model := map[replicaKey]*modelReplica{}
		var order []*modelReplica
		var unregistered float64
		last := map[string]float64{} // every counter as last seen

		replicaIDs := []uint32{0, 1, 7, 1 << 20}
		pickKnown := func(rt *rapid.T, want func(*modelReplica) bool) *modelReplica {
			var c []*modelReplica
			for _, m := range order {
				if want(m) {
					c = append(c, m)
				}
			}
			if len(c) == 0 {
				rt.Skip("no candidate")
			}
			return rapid.SampledFrom(c).Draw(rt, "replica")
		}
		register := func(rt *rapid.T, k replicaKey) {
			idx, err := rg.Attach(k)
			if err != nil {
				rt.Fatal(err)
			}
			r := replica(k.Stage, k.Replica)
			r.NumSpeculativeTokens = rapid.IntRange(0, 3).Draw(rt, "K")
			r.SleepState = stagepb.SleepState(rapid.IntRange(0, 2).Draw(rt, "sleep"))
			if err := l.Register(idx, r); err != nil {
				rt.Fatal(err)
			}
			m := model[k]
			if m == nil {
				m = &modelReplica{key: k, index: idx}
				model[k] = m
				order = append(order, m)
			} else if m.index != idx {
				rt.Fatalf("%s moved from index %d to %d", k, m.index, idx)
			}
			m.attached = true
			m.k = max(m.k, r.NumSpeculativeTokens)
			for len(m.perPos) < m.k {
				m.perPos = append(m.perPos, 0)
			}
		}

		rt.Repeat(map[string]func(*rapid.T){
			"join": func(rt *rapid.T) {
				k := replicaKey{
					Stage:   rapid.IntRange(0, len(stageNames)-1).Draw(rt, "stage"),
					Replica: rapid.SampledFrom(replicaIDs).Draw(rt, "id"),
				}
				register(rt, k)
			},
			"leave": func(rt *rapid.T) {
				m := pickKnown(rt, func(m *modelReplica) bool { return m.attached })
				if err := l.Detach(m.index); err != nil {
					rt.Fatal(err)
				}
				m.attached = false
			},
			"rejoin": func(rt *rapid.T) {
				m := pickKnown(rt, func(m *modelReplica) bool { return !m.attached })
				register(rt, m.key)
			},
			"record": func(rt *rapid.T) {
				m := pickKnown(rt, func(*modelReplica) bool { return true })
				st := &stagepb.EngineStats{
					PromptTokens:     rapid.Uint64Range(0, 100).Draw(rt, "prompt"),
					GenerationTokens: rapid.Uint64Range(0, 100).Draw(rt, "gen"),
					PrefixCacheHits:  rapid.Uint64Range(0, 100).Draw(rt, "hits"),
					SpecDecodeNumAcceptedTokensPerPos: rapid.SliceOfN(rapid.Uint64Range(0, 5), 0, 4).
						Draw(rt, "perPos"),
				}
				if err := l.Record(m.index, st); err != nil {
					rt.Fatal(err)
				}
				m.prompt += float64(st.PromptTokens)
				m.gen += float64(st.GenerationTokens)
				m.hits += float64(st.PrefixCacheHits)
				for pos, v := range st.SpecDecodeNumAcceptedTokensPerPos {
					if pos < len(m.perPos) {
						m.perPos[pos] += float64(v)
					}
				}
			},
			"record unknown": func(rt *rapid.T) {
				idx := rapid.IntRange(-3, 50).Draw(rt, "index")
				if _, ok := rg.Key(idx); ok {
					rt.Skip("known index")
				}
				if err := l.Record(idx, statsOf(1, 1)); err == nil {
					rt.Fatalf("record for unknown index %d succeeded", idx)
				}
				unregistered++
			},
			"": func(rt *rapid.T) {
				s := gatherSeries(rt, checkReg)
				for name, v := range s {
					if prev, ok := last[name]; ok && isCounter(name) && v < prev {
						rt.Fatalf("%s decreased from %v to %v", name, prev, v)
					}
					last[name] = v
				}
				if got := s["troupe_stats_unregistered_records_total{}"]; got != unregistered {
					rt.Fatalf("unregistered records %v, want %v", got, unregistered)
				}
				for _, m := range order {
					st, id := m.key.Stage, m.key.Replica
					check := func(key string, want float64) {
						got, ok := s[key]
						if !ok || got != want {
							rt.Fatalf("%s = %v (present %v), want %v", key, got, ok, want)
						}
					}
					check(seriesKey("troupe_prompt_tokens_total", st, id), m.prompt)
					check(seriesKey("troupe_generation_tokens_total", st, id), m.gen)
					check(seriesKey("troupe_prefix_cache_hits_total", st, id), m.hits)
					for pos, want := range m.perPos {
						check(seriesKey("troupe_spec_decode_num_accepted_tokens_per_pos_total", st, id, "position", itoa(pos)), want)
					}
					if _, ok := s[seriesKey("troupe_spec_decode_num_accepted_tokens_per_pos_total", st, id, "position", itoa(len(m.perPos)))]; ok {
						rt.Fatalf("%s has more spec positions than K=%d", m.key, m.k)
					}
					attached := 0.0
					if m.attached {
						attached = 1
					}
					check(seriesKey("troupe_replica_attached", st, id), attached)
				}
			},
		})
	})
}

func isCounter(series string) bool {
	for i := range len(series) {
		if series[i] == '{' {
			name := series[:i]
			return len(name) > 6 && name[len(name)-6:] == "_total" || len(name) > 6 && name[len(name)-6:] == "_count"
		}
	}
	return false
}
