package stats

import (
	"bytes"
	"context"
	"errors"
	"math"
	"os/exec"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

var (
	textFormat = expfmt.NewFormat(expfmt.TypeTextPlain)
	omFormat   = expfmt.NewFormat(expfmt.TypeOpenMetrics)
)

// weirdModel needs every escape of a label value.
const weirdModel = "we\"ird\\model\nname"

// richLogger is a logger in every state a series can be in: spec decode with
// K>0 and K=0, a K that grew on rejoin, detached replicas (one with a late
// record), a swept one, sleep states, cache info with and without a
// config, exemplars (a W3C trace id, a long one and one with characters to
// escape, one above the last bucket), unregistered records, and a model
// name and stage names that need escaping.
func richLogger(t *testing.T) (*prometheus.Registry, *Logger) {
	t.Helper()
	return richLoggerIn(t, ReplicaSeriesFull)
}

// richLoggerIn is richLogger with the given replica series mode.
func richLoggerIn(t *testing.T, mode ReplicaSeries) (*prometheus.Registry, *Logger) {
	t.Helper()
	clock := &fakeClock{t: time.Unix(1_700_000_000, 0)}
	reg := prometheus.NewRegistry()
	l, err := New(reg, weirdModel, Options{
		DetachedSeriesTTL: time.Minute, Now: clock.now, Series: mode,
		StageNames: []string{"thinker", `tal"ker\`, "voc\noder"},
	})
	require.NoError(t, err)
	for i := range 6 {
		r := replica(i%3, uint32(10+i))
		r.StageName = []string{"thinker", `tal"ker\`, "voc\noder"}[i%3]
		r.NumSpeculativeTokens = i % 3
		r.SleepState = stagepb.SleepStates[i%3]
		if i%2 == 0 {
			r.Cache = &stagepb.CacheConfig{BlockSize: 16, NumKvBlocks: uint32(1000 * i), EnablePrefixCaching: i%4 == 0, MaxNumSeqs: 64}
		}
		r.Engine, r.Version = `si"m`, "v\\1"
		require.NoError(t, l.Register(i, r))
	}
	// K grows on rejoin.
	r := replica(1, 11)
	r.StageName = `tal"ker\`
	r.NumSpeculativeTokens = 4
	require.NoError(t, l.Register(1, r))

	ids := []string{
		"4bf92f3577b34da6a3ce929d0e0e4736",
		strings.Repeat("long-trace-id-", 6),
		`quo"te\back` + "\nslash",
	}
	for i := range 6 {
		require.NoError(t, l.Record(i, &stagepb.EngineStats{
			PromptTokens: uint64(100 * (i + 1)), GenerationTokens: 1234567, PrefixCacheQueries: 12, PrefixCacheHits: 4,
			PromptTokensLocalCompute: 8, PromptTokensLocalCacheHit: 4, PromptTokensExternalKvTransfer: uint64(i),
			NumPreemptions:      uint64(i),
			SpecDecodeNumDrafts: 1, SpecDecodeNumDraftTokens: 2, SpecDecodeNumAcceptedTokens: 1,
			SpecDecodeNumAcceptedTokensPerPos: []uint64{1, 2, 3, 4, 5},
			IterationTokens:                   []uint32{1, 13, 20000},
			NumRequestsRunning:                uint32(i), NumRequestsWaitingCapacity: 1, NumRequestsWaitingDeferred: 2,
			KvCacheUsagePerc: 0.1 * float64(i),
		}))
		for j := range 3 {
			require.NoError(t, l.RecordFinished(i, Finished{
				Reason: stagepb.FinishReasons[(i+j)%4], PromptTokens: 10 * j, GenerationTokens: j * 7, PrefillComputedTokens: j,
				TTFT: time.Duration(j) * 30 * time.Millisecond, E2E: time.Duration(1+j*j*j) * 1100 * time.Millisecond,
				InterTokenLatencies: []time.Duration{time.Millisecond, 7 * time.Millisecond},
				Queue:               time.Duration(j) * time.Second, Prefill: 3 * time.Millisecond, Decode: time.Duration(j) * time.Second,
				MaxTokensParam: 64 * j, N: j,
				TraceID: ids[(i+j)%len(ids)],
			}))
		}
	}
	// E2E above the last bucket: the exemplar goes on +Inf.
	require.NoError(t, l.RecordFinished(0, Finished{Reason: stagepb.FinishReason_FINISH_REASON_STOP, E2E: 3 * time.Hour, TraceID: ids[0]}))

	require.NoError(t, l.Detach(3))
	require.NoError(t, l.Detach(4))
	require.NoError(t, l.Record(4, statsOf(5, 5))) // late record on a detached replica
	require.NoError(t, l.Detach(5))
	clock.t = clock.t.Add(2 * time.Minute)
	require.NoError(t, l.Register(4, func() Replica { r := replica(1, 14); r.StageName = `tal"ker\`; return r }()))
	require.Equal(t, 2, l.Sweep(clock.t)) // 3 and 5
	require.Error(t, l.Record(99, statsOf(1, 1)))
	return reg, l
}

// gatherEncoded encodes Gather's families as promhttp would.
func gatherEncoded(t failer, g prometheus.Gatherer, f expfmt.Format) string {
	t.Helper()
	mfs, err := g.Gather()
	require.NoError(t, err)
	var buf bytes.Buffer
	enc := expfmt.NewEncoder(&buf, f)
	for _, mf := range mfs {
		require.NoError(t, enc.Encode(mf))
	}
	if c, ok := enc.(expfmt.Closer); ok {
		require.NoError(t, c.Close())
	}
	return buf.String()
}

func fastEncoded(t failer, l *Logger, f expfmt.Format) string {
	t.Helper()
	var buf bytes.Buffer
	require.NoError(t, l.WriteMetrics(&buf, f))
	if f.FormatType() == expfmt.TypeOpenMetrics {
		buf.WriteString("# EOF\n")
	}
	return buf.String()
}

// familyBlocks splits an exposition into its families: name (from # TYPE)
// to its sorted lines. It fails if a family's lines are not contiguous, a
// family appears twice, or a sample does not belong to the family above it.
func familyBlocks(t failer, text string) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	cur := ""
	lines := strings.Split(strings.TrimSuffix(text, "\n"), "\n")
	for i, line := range lines {
		switch {
		case line == "# EOF":
			require.Equal(t, len(lines)-1, i, "# EOF is the last line")
			continue
		case strings.HasPrefix(line, "# HELP "):
			name := strings.Fields(line)[2]
			_, seen := out[name]
			require.False(t, seen, "family %s appears twice", name)
			cur = name
			out[name] = nil
		case strings.HasPrefix(line, "# TYPE "):
			require.Equal(t, cur, strings.Fields(line)[2], "TYPE right after HELP")
		default:
			require.NotEmpty(t, cur, "sample before any family: %q", line)
			require.True(t, strings.HasPrefix(line, cur), "sample %q outside its family %s", line, cur)
		}
		out[cur] = append(out[cur], line)
	}
	for _, ls := range out {
		sort.Strings(ls)
	}
	return out
}

// canonical re-encodes families with their series sorted, without what the
// text format does not carry (created timestamps, exemplars), as text.
func canonical(t failer, mfs []*dto.MetricFamily) string {
	t.Helper()
	var buf bytes.Buffer
	enc := expfmt.NewEncoder(&buf, textFormat)
	sort.Slice(mfs, func(i, j int) bool { return mfs[i].GetName() < mfs[j].GetName() })
	for _, mf := range mfs {
		sort.Slice(mf.Metric, func(i, j int) bool {
			return labelString(mf.Metric[i].GetLabel()) < labelString(mf.Metric[j].GetLabel())
		})
		require.NoError(t, enc.Encode(mf))
	}
	return buf.String()
}

// requireFastEqualsGather holds both fast expositions to Gather's.
func requireFastEqualsGather(t failer, reg prometheus.Gatherer, l *Logger) {
	t.Helper()
	// Text: it parses (expfmt's own parser), and reads as Gather's families.
	fast := fastEncoded(t, l, textFormat)
	parsed, err := textParse(strings.NewReader(fast))
	require.NoError(t, err)
	gathered, err := reg.Gather()
	require.NoError(t, err)
	var pmfs []*dto.MetricFamily
	for _, mf := range parsed {
		pmfs = append(pmfs, mf)
	}
	require.Equal(t, canonical(t, gathered), canonical(t, pmfs), "parsed fast text vs Gather")
	// And line for line what expfmt writes (same numbers, label order).
	requireSameBlocks(t, familyBlocks(t, gatherEncoded(t, reg, textFormat)), familyBlocks(t, fast), "text")

	// OpenMetrics: line for line what expfmt writes, exemplars included.
	requireSameBlocks(t, familyBlocks(t, gatherEncoded(t, reg, omFormat)), familyBlocks(t, fastEncoded(t, l, omFormat)), "OpenMetrics")
}

// requireSameBlocks compares family by family, so a failure shows one.
func requireSameBlocks(t failer, want, got map[string][]string, format string) {
	t.Helper()
	names := func(m map[string][]string) []string {
		out := make([]string, 0, len(m))
		for n := range m {
			out = append(out, n)
		}
		sort.Strings(out)
		return out
	}
	require.Equal(t, names(want), names(got), "%s: families", format)
	for _, n := range names(want) {
		require.Equal(t, want[n], got[n], "%s: family %s", format, n)
	}
}

func TestFastExpositionEqualsGather(t *testing.T) {
	reg, l := richLogger(t)
	requireFastEqualsGather(t, reg, l)

	om := fastEncoded(t, l, omFormat)
	for _, want := range []string{
		`# TYPE troupe_prompt_tokens counter`, // OpenMetrics counters lose _total in TYPE
		`troupe_prompt_tokens_total{model_name="we\"ird\\model\nname",replica="10",stage="0"} 100.0`,
		`# {trace_id="4bf92f3577b34da6a3ce929d0e0e4736"} 10800.0 `, // the +Inf exemplar
		`# {trace_id="quo\"te\\back\nslash"}`,
		`# {trace_id="` + strings.Repeat("long-trace-id-", 6) + `"}`,
		`troupe_stage_info{stage="2",stage_name="voc\noder"} 1.0`,
	} {
		require.Contains(t, om, want)
	}
	require.NotContains(t, om, `replica="13"`, "swept")
	require.Equal(t, 1, strings.Count(om, "# EOF"))
	require.NotContains(t, fastEncoded(t, l, textFormat), "# EOF")
	require.NotContains(t, fastEncoded(t, l, textFormat), "trace_id")
}

func TestFastExpositionEmptyAndDisabled(t *testing.T) {
	for _, opts := range []Options{{}, {Disabled: true}, {StageNames: []string{"a"}}} {
		reg, l := newTestLogger(t, opts)
		requireFastEqualsGather(t, reg, l)
		require.ErrorContains(t, l.WriteMetrics(&bytes.Buffer{}, expfmt.NewFormat(expfmt.TypeProtoDelim)), "stats: exposition format")
	}
}

// TestFastExpositionPromtool runs Prometheus' own checker on the fast text
// output of the rich logger (skipped where promtool is not installed;
// deploy's test runs it on a real head in CI). promtool reads the text
// format only; the OpenMetrics output is held line for line to expfmt's
// above, and scripts/bench-scrape.sh has a real Prometheus scrape it.
func TestFastExpositionPromtool(t *testing.T) {
	path, err := exec.LookPath("promtool")
	if err != nil {
		t.Skip("promtool is not installed (Debian package prometheus)")
	}
	_, l := richLogger(t)
	for _, f := range []expfmt.Format{textFormat} {
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		cmd := exec.CommandContext(ctx, path, "check", "metrics")
		cmd.Stdin = strings.NewReader(fastEncoded(t, l, f))
		out, err := cmd.CombinedOutput()
		cancel()
		// Exit 3: lint findings only; any other failure is a parse error.
		if ee, ok := err.(*exec.ExitError); ok && ee.ExitCode() == 3 {
			err = nil
		}
		require.NoError(t, err, "%s: %s", f, out)
		require.NotContains(t, string(out), "error", "%s", f)
	}
}

// TestFastExpositionProperty: after any sequence of joins, leaves, sweeps,
// records and finished requests, both fast expositions equal Gather's.
func TestFastExpositionProperty(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		clock := &fakeClock{t: time.Unix(1_700_000_000, 0)}
		reg := prometheus.NewRegistry()
		l, err := New(reg, testModel, Options{DetachedSeriesTTL: time.Minute, Now: clock.now, MaxModelLen: 1000})
		if err != nil {
			rt.Fatal(err)
		}
		registered := map[int]bool{}
		rt.Repeat(map[string]func(*rapid.T){
			"join": func(rt *rapid.T) {
				i := rapid.IntRange(0, 7).Draw(rt, "index")
				r := replica(i%3, uint32(i))
				r.NumSpeculativeTokens = rapid.IntRange(0, 3).Draw(rt, "K")
				r.SleepState = stagepb.SleepState(rapid.IntRange(0, 2).Draw(rt, "sleep"))
				if rapid.Bool().Draw(rt, "cache") {
					r.Cache = &stagepb.CacheConfig{BlockSize: rapid.Uint32Range(1, 64).Draw(rt, "block")}
				}
				if err := l.Register(i, r); err != nil {
					rt.Fatal(err)
				}
				registered[i] = true
			},
			"leave": func(rt *rapid.T) {
				i := rapid.IntRange(0, 7).Draw(rt, "index")
				if !registered[i] {
					rt.Skip("not registered")
				}
				if err := l.Detach(i); err != nil {
					rt.Fatal(err)
				}
			},
			"sweep": func(rt *rapid.T) {
				clock.t = clock.t.Add(time.Duration(rapid.IntRange(0, 90).Draw(rt, "seconds")) * time.Second)
				l.Sweep(clock.t)
				for i := range registered {
					registered[i] = l.Registered(i)
				}
			},
			"record": func(rt *rapid.T) {
				i := rapid.IntRange(0, 7).Draw(rt, "index")
				err := l.Record(i, &stagepb.EngineStats{
					PromptTokens:                      rapid.Uint64Range(0, 1<<40).Draw(rt, "prompt"),
					PrefixCacheHits:                   rapid.Uint64Range(0, 100).Draw(rt, "hits"),
					SpecDecodeNumAcceptedTokensPerPos: rapid.SliceOfN(rapid.Uint64Range(0, 5), 0, 4).Draw(rt, "perPos"),
					IterationTokens:                   rapid.SliceOfN(rapid.Uint32Range(0, 20000), 0, 3).Draw(rt, "iter"),
					NumRequestsRunning:                rapid.Uint32().Draw(rt, "running"),
					KvCacheUsagePerc:                  rapid.Float64Range(0, 1).Draw(rt, "kv"),
				})
				if (err == nil) != registered[i] {
					rt.Fatalf("record on %d: %v (registered %v)", i, err, registered[i])
				}
			},
			"finished": func(rt *rapid.T) {
				i := rapid.IntRange(0, 7).Draw(rt, "index")
				ms := func(name string) time.Duration {
					return time.Duration(rapid.Float64Range(0, 1e7).Draw(rt, name) * float64(time.Millisecond))
				}
				err := l.RecordFinished(i, Finished{
					Reason:       stagepb.FinishReasons[rapid.IntRange(0, 3).Draw(rt, "reason")],
					PromptTokens: rapid.IntRange(0, 5000).Draw(rt, "promptTokens"),
					TTFT:         ms("ttft"), E2E: ms("e2e"), Decode: ms("decode"),
					GenerationTokens: rapid.IntRange(0, 5000).Draw(rt, "gen"),
					TraceID:          rapid.StringMatching(`[a-f0-9"\\]{0,60}`).Draw(rt, "trace"),
				})
				if (err == nil) != registered[i] {
					rt.Fatalf("finished on %d: %v (registered %v)", i, err, registered[i])
				}
			},
		})
		requireFastEqualsGather(rt, reg, l)
	})
}

// TestScrapeConsistentUnderRecords scrapes, fast and slow, while recorders
// observe into every histogram: every scrape parses, each histogram's count
// equals its +Inf bucket and its buckets never decrease left to right, no
// count or sum ever decreases from one scrape to the next, and once the
// recorders stop, both paths agree exactly and count what was recorded.
func TestScrapeConsistentUnderRecords(t *testing.T) {
	reg, l := newTestLogger(t, Options{})
	const replicas, recorders, scrapes = 4, 4, 30
	for i := range replicas {
		require.NoError(t, l.Register(i, replica(i%3, uint32(i))))
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	recorded := make([]int, recorders)
	errs := make(chan error, recorders)
	for w := range recorders {
		wg.Go(func() {
			for n := 0; ; n++ {
				select {
				case <-stop:
					recorded[w] = n
					return
				default:
				}
				if err := l.RecordFinished((w+n)%replicas, Finished{
					Reason: stagepb.FinishReason_FINISH_REASON_STOP, E2E: time.Duration(n%50) * 100 * time.Millisecond,
					TTFT: time.Duration(n%7) * time.Millisecond, TraceID: "abc",
				}); err != nil {
					errs <- err
					recorded[w] = n
					return
				}
			}
		})
	}
	stopped := false
	halt := func() {
		if !stopped {
			stopped = true
			close(stop)
			wg.Wait()
		}
	}
	defer halt()

	last := map[string]float64{}
	for range scrapes {
		mfs, err := textParse(strings.NewReader(fastEncoded(t, l, textFormat)))
		require.NoError(t, err)
		for name, mf := range mfs {
			for _, m := range mf.GetMetric() {
				h := m.GetHistogram()
				if h == nil {
					continue
				}
				key := name + labelString(m.GetLabel())
				prev := uint64(0)
				for _, b := range h.GetBucket() {
					require.GreaterOrEqual(t, b.GetCumulativeCount(), prev, "%s buckets cumulative", key)
					prev = b.GetCumulativeCount()
				}
				require.Equal(t, h.GetSampleCount(), prev, "%s count == +Inf bucket", key)
				for k, v := range map[string]float64{"_count": float64(h.GetSampleCount()), "_sum": h.GetSampleSum()} {
					require.GreaterOrEqual(t, v, last[key+k], "%s%s never decreases", key, k)
					last[key+k] = v
				}
			}
		}
		_, err = reg.Gather() // the slow path, concurrently too
		require.NoError(t, err)
	}
	halt()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	requireFastEqualsGather(t, reg, l)
	s := gatherSeries(t, reg)
	total, want := 0.0, 0
	for i := range replicas {
		total += s[seriesKey("troupe_e2e_request_latency_seconds_count", i%3, uint32(i))]
	}
	for _, n := range recorded {
		want += n
	}
	require.Positive(t, want)
	require.Equal(t, float64(want), total)
}

// TestWriteMetricsError: a failing writer's error comes back wrapped.
func TestWriteMetricsError(t *testing.T) {
	_, l := richLogger(t)
	err := l.WriteMetrics(failingWriter{}, textFormat)
	require.ErrorIs(t, err, errWrite)
	require.ErrorContains(t, err, "stats: write metrics")
	require.True(t, slices.IsSorted(l.MetricFamilyNames()))
}

var errWrite = errors.New("write refused")

type failingWriter struct{}

func (failingWriter) Write([]byte) (int, error) { return 0, errWrite }

func textParse(r *strings.Reader) (map[string]*dto.MetricFamily, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	return p.TextToMetricFamilies(r)
}

// TestAppendFloatAsExpfmt: the integer shortcut formats as strconv's 'g'
// (and OpenMetrics' ".0" rule) around its edges.
func TestAppendFloatAsExpfmt(t *testing.T) {
	for _, v := range []float64{0, math.Copysign(0, -1), 1, 7, 999999, 1e6, 1e6 + 1, 123456789, 0.5, 1.5, 2.5e-7, -3, math.Inf(1), math.NaN(), 1 << 53} {
		want := strconv.FormatFloat(v, 'g', -1, 64)
		if v == 0 {
			want = "0" // expfmt writes -0 as 0
		}
		require.Equal(t, want, string(appendFloat(nil, v, false)), "%v", v)
		om := want
		if !strings.ContainsAny(om, "e.") && !math.IsInf(v, 0) && !math.IsNaN(v) {
			om += ".0"
		}
		require.Equal(t, om, string(appendFloat(nil, v, true)), "%v", v)
	}
}
