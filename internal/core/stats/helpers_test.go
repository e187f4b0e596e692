package stats

import (
	"fmt"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const testModel = "troupe-omni-sim"

var stageNames = []string{"thinker", "talker", "vocoder"}

func newTestLogger(t testing.TB, opts Options) (*prometheus.Registry, *Logger) {
	t.Helper()
	reg := prometheus.NewRegistry()
	l, err := New(reg, testModel, opts)
	require.NoError(t, err)
	return reg, l
}

func replica(stage int, id uint32) Replica {
	return Replica{
		Stage: stage, StageName: stageNames[stage], ReplicaID: id,
		Engine: "sim", Version: "v0.1.0", Addr: "127.0.0.1:1",
	}
}

// fakeClock is a settable Options.Now.
type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time { return c.t }

// failer is what the helpers need of *testing.T and *rapid.T.
type failer interface {
	Helper()
	Errorf(format string, args ...any)
	Fatalf(format string, args ...any)
	FailNow()
}

// gatherSeries reads every sample of the registry into a map from
// `name{label="value",...}` (labels sorted) to its value. Histograms appear as
// name_count and name_sum. It gathers; it never creates children.
func gatherSeries(t failer, g prometheus.Gatherer) map[string]float64 {
	t.Helper()
	mfs, err := g.Gather()
	require.NoError(t, err)
	out := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			ls := labelString(m.GetLabel())
			switch mf.GetType() {
			case dto.MetricType_COUNTER:
				out[mf.GetName()+ls] = m.GetCounter().GetValue()
			case dto.MetricType_GAUGE:
				out[mf.GetName()+ls] = m.GetGauge().GetValue()
			case dto.MetricType_HISTOGRAM:
				out[mf.GetName()+"_count"+ls] = float64(m.GetHistogram().GetSampleCount())
				out[mf.GetName()+"_sum"+ls] = m.GetHistogram().GetSampleSum()
			default:
				t.Fatalf("unexpected metric type %v for %s", mf.GetType(), mf.GetName())
			}
		}
	}
	return out
}

func labelString(lps []*dto.LabelPair) string {
	parts := make([]string, 0, len(lps))
	for _, lp := range lps {
		parts = append(parts, lp.GetName()+`="`+lp.GetValue()+`"`)
	}
	sort.Strings(parts)
	return "{" + strings.Join(parts, ",") + "}"
}

// seriesKey builds the gatherSeries key of a per-replica series.
func seriesKey(name string, stage int, id uint32, extra ...string) string {
	parts := []string{
		`model_name="` + testModel + `"`,
		`replica="` + itoa(int(id)) + `"`,
		`stage="` + itoa(stage) + `"`,
	}
	for i := 0; i+1 < len(extra); i += 2 {
		parts = append(parts, extra[i]+`="`+extra[i+1]+`"`)
	}
	sort.Strings(parts)
	return name + "{" + strings.Join(parts, ",") + "}"
}

func itoa(i int) string { return strconv.Itoa(i) }

// familyOf returns the gathered family with the given name, or nil.
func familyOf(t testing.TB, g prometheus.Gatherer, name string) *dto.MetricFamily {
	t.Helper()
	mfs, err := g.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf
		}
	}
	return nil
}

// replicaSeriesCount counts the gathered series that carry the replica's
// stage and replica labels.
func replicaSeriesCount(t testing.TB, g prometheus.Gatherer, stage int, id uint32) int {
	t.Helper()
	mfs, err := g.Gather()
	require.NoError(t, err)
	n := 0
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var s, r string
			for _, lp := range m.GetLabel() {
				switch lp.GetName() {
				case "stage":
					s = lp.GetValue()
				case "replica":
					r = lp.GetValue()
				}
			}
			if s == itoa(stage) && r == itoa(int(id)) {
				n++
			}
		}
	}
	return n
}

func statsOf(prompt, gen uint64) *stagepb.EngineStats {
	return &stagepb.EngineStats{PromptTokens: prompt, GenerationTokens: gen}
}

// replicaKey names a replica in the tests.
type replicaKey struct {
	Stage   int
	Replica uint32
}

// indexes hands out engine indexes the way the head's loop does: on a key's
// first join, in join order, stable for the key afterwards.
type indexes struct {
	byKey map[replicaKey]int
	keys  []replicaKey
}

func newIndexes() *indexes { return &indexes{byKey: map[replicaKey]int{}} }

func (x *indexes) Attach(k replicaKey) (int, error) {
	if i, ok := x.byKey[k]; ok {
		return i, nil
	}
	if len(x.keys) > MaxEngineIndex {
		return -1, fmt.Errorf("stats test: engine indexes exhausted")
	}
	x.byKey[k] = len(x.keys)
	x.keys = append(x.keys, k)
	return len(x.keys) - 1, nil
}

// Key reports which key holds index.
func (x *indexes) Key(index int) (replicaKey, bool) {
	if index < 0 || index >= len(x.keys) {
		return replicaKey{}, false
	}
	return x.keys[index], true
}

func (k replicaKey) String() string { return fmt.Sprintf("%d/%d", k.Stage, k.Replica) }
