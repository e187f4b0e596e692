package stats

import (
	"bytes"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"sync"

	"github.com/prometheus/common/expfmt"
)

// The fast exposition: the Logger writes its families straight in the
// Prometheus text format 0.0.4 or OpenMetrics 1.0, from its atomics and
// label pairs rendered once per replica, into a pooled buffer that is
// flushed to the writer in chunks. It writes what an expfmt encoder would
// write for Gather's families (same families, label sets in the same sorted
// order, same number formatting, the exemplars in OpenMetrics), without the
// dto.Metric per series that Gather builds (TestFastExpositionEqualsGather).

// Exposition formats, by index into family.fast.
const (
	formatText = iota
	formatOpenMetrics
	numFormats
)

// fastFamily is a family's pre-rendered text in one format.
type fastFamily struct {
	header string   // # HELP and # TYPE lines
	prefix string   // name + "{" (name + " " without labels)
	nested []string // `label="value"` by nested label index
	// histograms: name_bucket{, the `,le="bound"} ` of each bucket (+Inf
	// last), name_sum{ and name_count{.
	bucket     string
	le         []string
	sum, count string
}

// prepare renders the family's fastFamily in both formats.
func (f *family) prepare() {
	for ft := range numFormats {
		om := ft == formatOpenMetrics
		name := f.name
		typ := ""
		switch f.kind {
		case kindCounter, kindUnregistered:
			typ = "counter"
			if om {
				name = strings.TrimSuffix(name, "_total")
			}
		case kindGauge, kindStageInfo, kindCacheInfo:
			typ = "gauge"
		case kindHistogram:
			typ = "histogram"
		}
		help := helpEscaper.Replace(f.help)
		if om {
			help = labelEscaper.Replace(f.help)
		}
		ff := fastFamily{header: "# HELP " + name + " " + help + "\n# TYPE " + name + " " + typ + "\n"}
		if f.kind == kindUnregistered {
			ff.prefix = f.name + " "
		} else {
			ff.prefix = f.name + "{"
		}
		for _, v := range f.values {
			ff.nested = append(ff.nested, labelPair(f.label, v))
		}
		if f.kind == kindHistogram {
			ff.bucket = f.name + "_bucket{"
			ff.sum = f.name + "_sum{"
			ff.count = f.name + "_count{"
			for _, b := range f.bounds {
				ff.le = append(ff.le, `,le="`+string(appendFloat(nil, b, om))+`"} `)
			}
			ff.le = append(ff.le, `,le="+Inf"} `)
		}
		f.fast[ft] = ff
	}
}

var helpEscaper = strings.NewReplacer(`\`, `\\`, "\n", `\n`)

// appendFloat formats v as expfmt does: the shortest representation that
// reads back as v ('g'), in OpenMetrics with ".0" added to an integer.
func appendFloat(b []byte, v float64, om bool) []byte {
	if v >= 0 && v < 1e6 && v == math.Trunc(v) {
		// Most values: an integer that 'g' writes in full (it switches to
		// an exponent at 1e6), formatted several times faster.
		b = strconv.AppendUint(b, uint64(v), 10)
		if om {
			b = append(b, '.', '0')
		}
		return b
	}
	start := len(b)
	b = strconv.AppendFloat(b, v, 'g', -1, 64)
	if om && !math.IsInf(v, 0) && !math.IsNaN(v) && !bytes.ContainsAny(b[start:], "e.") {
		b = append(b, '.', '0')
	}
	return b
}

// flushAt is the buffered size at which the writer hands its buffer on.
const flushAt = 32 << 10

// exposer is the state of one fast exposition; pooled, so that a scrape
// allocates nothing once the pool is warm.
type exposer struct {
	b       []byte
	w       io.Writer
	err     error
	om      bool
	ft      int
	engines []*engine
	aggs    []*engine // minimal mode: the stage aggregates
	counts  []uint64
}

var exposerPool = sync.Pool{New: func() any { return &exposer{b: make([]byte, 0, 2*flushAt)} }}

func (x *exposer) flush() {
	if x.err == nil && len(x.b) > 0 {
		_, x.err = x.w.Write(x.b)
	}
	x.b = x.b[:0]
}

func (x *exposer) maybeFlush() {
	if len(x.b) >= flushAt {
		x.flush()
	}
}

func (x *exposer) float(v float64) { x.b = appendFloat(x.b, v, x.om) }

// count writes a bucket count or _count: an integer in OpenMetrics, a
// float in the text format (as expfmt).
func (x *exposer) count(n uint64) {
	if x.om {
		x.b = strconv.AppendUint(x.b, n, 10)
		return
	}
	x.b = appendFloat(x.b, float64(n), false)
}

// formatOf is the index of exposition format f: the Logger writes the text
// format 0.0.4 and OpenMetrics (1.0.0 and 0.0.1 alike, as expfmt does).
func formatOf(f expfmt.Format) (int, error) {
	switch f.FormatType() {
	case expfmt.TypeTextPlain:
		return formatText, nil
	case expfmt.TypeOpenMetrics:
		return formatOpenMetrics, nil
	}
	return 0, fmt.Errorf("stats: exposition format %q not supported (text or OpenMetrics)", f)
}

// MetricFamilyNames are the names of every family WriteMetrics may write,
// sorted. A /metrics handler that writes the Logger with WriteMetrics must
// not also gather these families from a registry.
func (l *Logger) MetricFamilyNames() []string {
	out := make([]string, len(l.fams))
	for i, f := range l.fams {
		out[i] = f.name
	}
	return out
}

// WriteMetrics writes every family of the Logger to w in format f (the text
// format or OpenMetrics; OpenMetrics with exemplars, and without the final
// "# EOF", which the caller writes after its other families). It writes the
// same families, series, values and exemplars as Gather of the Collector,
// through a pooled buffer, allocating next to nothing. It may be called
// concurrently with everything else, also with itself; a series' values
// are read as described at histogram. Errors are w's, wrapped.
func (l *Logger) WriteMetrics(w io.Writer, f expfmt.Format) error {
	ft, err := formatOf(f)
	if err != nil {
		return err
	}
	x := exposerPool.Get().(*exposer)
	x.w, x.err, x.ft, x.om = w, nil, ft, ft == formatOpenMetrics
	x.engines = l.appendEngines(x.engines[:0])
	x.aggs = l.appendAggregates(x.aggs[:0])
	for _, fam := range l.fams {
		if x.err != nil {
			break // the writer failed (the scraper left): stop formatting
		}
		l.writeFamily(x, fam)
		x.maybeFlush()
	}
	x.flush()
	err = x.err
	clear(x.engines)
	clear(x.aggs)
	x.w = nil
	exposerPool.Put(x)
	if err != nil {
		return fmt.Errorf("stats: write metrics: %w", err)
	}
	return nil
}

// appendEngines appends every bound replica, in index order.
func (l *Logger) appendEngines(dst []*engine) []*engine {
	for i := range int(l.maxIndex.Load()) + 1 {
		if e := l.table.load(i); e != nil {
			dst = append(dst, e)
		}
	}
	return dst
}

// appendAggregates appends the stage aggregates (minimal mode), in stage
// order.
func (l *Logger) appendAggregates(dst []*engine) []*engine {
	if a := l.aggs.Load(); a != nil {
		dst = append(dst, *a...)
	}
	return dst
}

// sources are the engines whose series of family f are exposed: the
// replicas, or in minimal mode the stage aggregates for a counter or a
// histogram.
func (l *Logger) sources(f *family, replicas, aggs []*engine) []*engine {
	if l.minimal && f.aggregated() {
		return aggs
	}
	return replicas
}

func (l *Logger) writeFamily(x *exposer, f *family) {
	ff := &f.fast[x.ft]
	switch f.kind {
	case kindUnregistered:
		x.b = append(x.b, ff.header...)
		x.b = append(x.b, ff.prefix...)
		x.float(float64(l.unregistered.Load()))
		x.b = append(x.b, '\n')
		return
	case kindStageInfo:
		stages := l.stages.Load()
		if stages == nil || len(*stages) == 0 {
			return
		}
		x.b = append(x.b, ff.header...)
		for _, s := range *stages {
			x.b = append(x.b, ff.prefix...)
			x.b = append(x.b, s.rendered...)
			x.b = append(x.b, "} "...)
			x.float(1)
			x.b = append(x.b, '\n')
		}
		return
	}
	engines := l.sources(f, x.engines, x.aggs)
	if len(engines) == 0 {
		return
	}
	header := false
	for _, e := range engines {
		switch f.kind {
		case kindCacheInfo:
			ci := e.cache.Load()
			if ci == nil {
				continue
			}
			if !header {
				x.b, header = append(x.b, ff.header...), true
			}
			x.b = append(x.b, ff.prefix...)
			x.b = append(x.b, ci.rendered...)
			x.b = append(x.b, "} "...)
			x.float(1)
			x.b = append(x.b, '\n')
		case kindHistogram:
			if !header {
				x.b, header = append(x.b, ff.header...), true
			}
			x.histogram(ff, e, &e.hists[f.hist])
		default:
			n := f.count(e)
			for i := range n {
				if !header {
					x.b, header = append(x.b, ff.header...), true
				}
				x.b = append(x.b, ff.prefix...)
				l.labels(x, f, ff, e, i)
				x.b = append(x.b, "} "...)
				if f.kind == kindCounter {
					x.float(float64(f.counter(e, i)))
				} else {
					x.float(f.gauge(e, i))
				}
				x.b = append(x.b, '\n')
			}
		}
		x.maybeFlush()
	}
}

// labels writes a per-replica series' label pairs in sorted order.
func (l *Logger) labels(x *exposer, f *family, ff *fastFamily, e *engine, i int) {
	switch f.pos {
	case posNone:
		x.b = append(x.b, e.mrs...)
	case posBeforeModel:
		x.b = append(x.b, ff.nested[i]...)
		x.b = append(x.b, ',')
		x.b = append(x.b, e.mrs...)
	case posAfterModel:
		x.b = append(x.b, l.modelPair...)
		x.b = append(x.b, ',')
		x.b = append(x.b, ff.nested[i]...)
		x.b = append(x.b, ',')
		x.b = append(x.b, e.rs...)
	case posBeforeStage:
		x.b = append(x.b, e.mr...)
		x.b = append(x.b, ',')
		x.b = append(x.b, ff.nested[i]...)
		x.b = append(x.b, ',')
		x.b = append(x.b, e.s...)
	}
}

func (x *exposer) histogram(ff *fastFamily, e *engine, h *histogram) {
	if cap(x.counts) < len(h.counts) {
		x.counts = make([]uint64, len(h.counts))
	}
	counts := x.counts[:len(h.counts)]
	count, sum := h.read(counts)
	for i, c := range counts {
		x.b = append(x.b, ff.bucket...)
		x.b = append(x.b, e.mrs...)
		x.b = append(x.b, ff.le[i]...)
		x.count(c)
		if x.om && h.ex != nil {
			x.exemplar(&h.ex[i])
		}
		x.b = append(x.b, '\n')
	}
	x.b = append(x.b, ff.sum...)
	x.b = append(x.b, e.mrs...)
	x.b = append(x.b, "} "...)
	x.float(sum)
	x.b = append(x.b, '\n')
	x.b = append(x.b, ff.count...)
	x.b = append(x.b, e.mrs...)
	x.b = append(x.b, "} "...)
	x.count(count)
	x.b = append(x.b, '\n')
}

// exemplar writes ` # {trace_id="…"} value timestamp` if the slot holds one.
func (x *exposer) exemplar(s *exemplarSlot) {
	mark := len(x.b)
	x.b = append(x.b, ` # {trace_id="`...)
	idStart := len(x.b)
	b, v, ts, ok := s.load(x.b)
	if !ok {
		x.b = x.b[:mark]
		return
	}
	x.b = escapeInPlace(b, idStart)
	x.b = append(x.b, `"} `...)
	x.float(v)
	x.b = append(x.b, ' ')
	x.b = appendFloat(x.b, float64(ts)/1e9, true)
}

// escapeInPlace escapes b[from:] as a label value.
func escapeInPlace(b []byte, from int) []byte {
	if !bytes.ContainsAny(b[from:], "\\\"\n") {
		return b
	}
	raw := string(b[from:]) // rare: a trace id with characters to escape
	b = b[:from]
	for i := 0; i < len(raw); i++ {
		switch c := raw[i]; c {
		case '\\':
			b = append(b, '\\', '\\')
		case '"':
			b = append(b, '\\', '"')
		case '\n':
			b = append(b, '\\', 'n')
		default:
			b = append(b, c)
		}
	}
	return b
}
