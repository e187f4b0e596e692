package stats

import (
	"errors"
	"math"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/protobuf/proto"
)

// The Logger is a prometheus.Collector: New registers it on the Registerer
// it is given, and Gather of that registry collects every family as const
// metrics (with created timestamps and exemplars). That path builds a
// dto.Metric per series and is as complete as it is slow; /metrics writes
// the same families with WriteMetrics instead (expose.go).

var _ prometheus.Collector = (*Logger)(nil)

// Describe sends the descriptor of every family. Safe for concurrent use.
func (l *Logger) Describe(ch chan<- *prometheus.Desc) {
	for _, f := range l.fams {
		ch <- f.desc
	}
}

// Collect sends every series of every family. Safe for concurrent use,
// also with records and membership changes.
func (l *Logger) Collect(ch chan<- prometheus.Metric) {
	replicas := l.appendEngines(nil)
	aggs := l.appendAggregates(nil)
	for _, f := range l.fams {
		engines := l.sources(f, replicas, aggs)
		switch f.kind {
		case kindUnregistered:
			ch <- constMetric(f.desc, prometheus.CounterValue, float64(l.unregistered.Load()), time.Time{})
		case kindStageInfo:
			if stages := l.stages.Load(); stages != nil {
				for _, s := range *stages {
					ch <- constMetric(f.desc, prometheus.GaugeValue, 1, time.Time{}, strconv.Itoa(s.index), s.name)
				}
			}
		case kindCacheInfo:
			for _, e := range engines {
				if ci := e.cache.Load(); ci != nil {
					ch <- constMetric(f.desc, prometheus.GaugeValue, 1, time.Time{}, ci.values...)
				}
			}
		case kindHistogram:
			for _, e := range engines {
				ch <- collectHistogram(f, e)
			}
		default:
			for _, e := range engines {
				for i := range f.count(e) {
					lv := []string{e.lv[0], e.lv[1], e.lv[2]}
					if f.label != "" {
						lv = append(lv, f.values[i])
					}
					if f.kind == kindCounter {
						ch <- constMetric(f.desc, prometheus.CounterValue, float64(f.counter(e, i)), e.created, lv...)
					} else {
						ch <- constMetric(f.desc, prometheus.GaugeValue, f.gauge(e, i), time.Time{}, lv...)
					}
				}
			}
		}
	}
}

// constMetric is a const metric, with a created timestamp unless ct is
// zero, or an invalid metric that makes Gather report the error.
func constMetric(desc *prometheus.Desc, t prometheus.ValueType, v float64, ct time.Time, lv ...string) prometheus.Metric {
	var m prometheus.Metric
	var err error
	if ct.IsZero() {
		m, err = prometheus.NewConstMetric(desc, t, v, lv...)
	} else {
		m, err = prometheus.NewConstMetricWithCreatedTimestamp(desc, t, v, ct, lv...)
	}
	if err != nil {
		return prometheus.NewInvalidMetric(desc, err)
	}
	return m
}

// collectHistogram is one replica's histogram with its classic buckets and
// its native ones (nativeHistogram), which only the protobuf exposition
// carries. It reads the classic buckets, then the native ones, then the
// sum; observe counts native before classic, so the native total, used as
// the sample count, is never below a classic bucket and equals the native
// buckets' total exactly, as Prometheus requires.
func collectHistogram(f *family, e *engine) prometheus.Metric {
	h := &e.hists[f.hist]
	counts := make([]uint64, len(h.counts))
	h.read(counts)
	zero, spans, deltas, count := h.readNative()
	sum := math.Float64frombits(h.sum.Load())
	buckets := make(map[float64]uint64, len(h.bounds))
	for i, b := range h.bounds {
		buckets[b] = counts[i]
	}
	m, err := prometheus.NewConstHistogramWithCreatedTimestamp(f.desc, count, sum, buckets, e.created, e.lv[0], e.lv[1], e.lv[2])
	if err != nil {
		return prometheus.NewInvalidMetric(f.desc, err)
	}
	m = nativeHistogram{Metric: m, zero: zero, threshold: h.nr.zeroThreshold(), spans: spans, deltas: deltas}
	var exemplars []prometheus.Exemplar
	for i := range h.ex {
		id, v, ts, ok := h.ex[i].load(nil)
		if !ok {
			continue
		}
		exemplars = append(exemplars, prometheus.Exemplar{
			Value: v, Labels: prometheus.Labels{"trace_id": string(id)}, Timestamp: time.Unix(0, ts),
		})
	}
	if len(exemplars) == 0 {
		return m
	}
	m, err = prometheus.NewMetricWithExemplars(m, exemplars...)
	if err != nil {
		return prometheus.NewInvalidMetric(f.desc, err)
	}
	return m
}

// nativeHistogram adds the native buckets (schema nativeSchema) to a const
// classic histogram's dto.Histogram.
type nativeHistogram struct {
	prometheus.Metric
	zero      uint64
	threshold float64
	spans     []*dto.BucketSpan
	deltas    []int64
}

// Write writes the classic histogram, then its native fields.
func (m nativeHistogram) Write(out *dto.Metric) error {
	if err := m.Metric.Write(out); err != nil {
		return err
	}
	h := out.GetHistogram()
	if h == nil {
		return errors.New("stats: native buckets on a metric that is not a histogram")
	}
	h.Schema = proto.Int32(nativeSchema)
	h.ZeroThreshold = proto.Float64(m.threshold)
	h.ZeroCount = proto.Uint64(m.zero)
	h.PositiveSpan = m.spans
	h.PositiveDelta = m.deltas
	return nil
}
