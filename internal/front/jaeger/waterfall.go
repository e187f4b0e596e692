package jaeger

import (
	"bytes"
	"cmp"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/troupe-serving/troupe/pkg/telemetry"
)

// Span is one span of a fetched trace, reduced to what a waterfall shows.
type Span struct {
	TraceID      string // 32 lowercase hex digits
	SpanID       string // 16 lowercase hex digits
	ParentSpanID string // "" for a root
	Service      string // the resource's service.name ("unknown" when absent)
	Name         string
	Kind         string // internal, server, client, producer, consumer or ""
	Start, End   time.Time
	// Attributes holds the span's attributes rendered as strings (arrays
	// and maps as JSON).
	Attributes    map[string]string
	Error         bool // status ERROR, or the legacy error=true attribute
	StatusMessage string
}

// Duration is End-Start, never negative.
func (s Span) Duration() time.Duration { return max(s.End.Sub(s.Start), 0) }

// Trace is the spans of one trace, in the order the source listed them.
type Trace struct {
	TraceID string
	Spans   []Span
}

// ParseOTLPJSON decodes a trace in OTLP JSON: either Jaeger's api_v3 answer
// ({"result":{"resourceSpans":[...]}}) or a bare TracesData
// ({"resourceSpans":[...]}). It accepts what OTLP JSON allows: ids in hex
// (or base64, as generic protobuf JSON writes bytes), 64-bit integers as
// strings or numbers, enums as numbers or names.
func ParseOTLPJSON(data []byte) (*Trace, error) {
	var env struct {
		Result        *otlpTracesData     `json:"result"`
		ResourceSpans []otlpResourceSpans `json:"resourceSpans"`
		Error         *struct {
			HTTPCode int    `json:"httpCode"`
			Message  string `json:"message"`
		} `json:"error"`
	}
	if err := json.Unmarshal(data, &env); err != nil {
		return nil, fmt.Errorf("jaeger: decode OTLP JSON: %w", err)
	}
	if env.Error != nil {
		return nil, fmt.Errorf("jaeger: error %d: %s", env.Error.HTTPCode, env.Error.Message)
	}
	rss := env.ResourceSpans
	if env.Result != nil {
		rss = env.Result.ResourceSpans
	}
	t := &Trace{}
	for _, rs := range rss {
		service := "unknown"
		for _, kv := range rs.Resource.Attributes {
			if kv.Key == "service.name" {
				service = kv.Value.String()
			}
		}
		scopes := append(rs.ScopeSpans, rs.InstrumentationLibrarySpans...)
		for _, ss := range scopes {
			for _, sp := range ss.Spans {
				s, err := sp.toSpan(service)
				if err != nil {
					return nil, err
				}
				if t.TraceID == "" {
					t.TraceID = s.TraceID
				}
				t.Spans = append(t.Spans, s)
			}
		}
	}
	if len(t.Spans) == 0 {
		return nil, errors.New("jaeger: the trace holds no spans")
	}
	return t, nil
}

type otlpTracesData struct {
	ResourceSpans []otlpResourceSpans `json:"resourceSpans"`
}

type otlpResourceSpans struct {
	Resource struct {
		Attributes []otlpKeyValue `json:"attributes"`
	} `json:"resource"`
	ScopeSpans                  []otlpScopeSpans `json:"scopeSpans"`
	InstrumentationLibrarySpans []otlpScopeSpans `json:"instrumentationLibrarySpans"` // OTLP before 0.19
}

type otlpScopeSpans struct {
	Spans []otlpSpan `json:"spans"`
}

type otlpSpan struct {
	TraceID           string          `json:"traceId"`
	SpanID            string          `json:"spanId"`
	ParentSpanID      string          `json:"parentSpanId"`
	Name              string          `json:"name"`
	Kind              json.RawMessage `json:"kind"`
	StartTimeUnixNano json.RawMessage `json:"startTimeUnixNano"`
	EndTimeUnixNano   json.RawMessage `json:"endTimeUnixNano"`
	Attributes        []otlpKeyValue  `json:"attributes"`
	Status            struct {
		Code    json.RawMessage `json:"code"`
		Message string          `json:"message"`
	} `json:"status"`
}

type otlpKeyValue struct {
	Key   string       `json:"key"`
	Value otlpAnyValue `json:"value"`
}

type otlpAnyValue struct {
	StringValue *string         `json:"stringValue"`
	BoolValue   *bool           `json:"boolValue"`
	IntValue    json.RawMessage `json:"intValue"`
	DoubleValue json.RawMessage `json:"doubleValue"`
	BytesValue  *string         `json:"bytesValue"`
	ArrayValue  *struct {
		Values []otlpAnyValue `json:"values"`
	} `json:"arrayValue"`
	KvlistValue *struct {
		Values []otlpKeyValue `json:"values"`
	} `json:"kvlistValue"`
}

// String renders the value: scalars plainly, arrays and maps as JSON.
func (v otlpAnyValue) String() string {
	switch {
	case v.StringValue != nil:
		return *v.StringValue
	case v.BoolValue != nil:
		return strconv.FormatBool(*v.BoolValue)
	case v.IntValue != nil:
		return unquote(v.IntValue)
	case v.DoubleValue != nil:
		return unquote(v.DoubleValue)
	case v.BytesValue != nil:
		return *v.BytesValue
	case v.ArrayValue != nil:
		items := make([]string, len(v.ArrayValue.Values))
		for i, item := range v.ArrayValue.Values {
			items[i] = item.String()
		}
		b, _ := json.Marshal(items)
		return string(b)
	case v.KvlistValue != nil:
		m := make(map[string]string, len(v.KvlistValue.Values))
		for _, kv := range v.KvlistValue.Values {
			m[kv.Key] = kv.Value.String()
		}
		b, _ := json.Marshal(m)
		return string(b)
	}
	return ""
}

// unquote returns a JSON number or string as its text.
func unquote(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	return string(bytes.TrimSpace(raw))
}

var spanKinds = []string{"", "internal", "server", "client", "producer", "consumer"}

func (o otlpSpan) toSpan(service string) (Span, error) {
	traceID, err := normalizeID(o.TraceID, 16)
	if err != nil {
		return Span{}, fmt.Errorf("jaeger: span %q: trace id: %w", o.Name, err)
	}
	spanID, err := normalizeID(o.SpanID, 8)
	if err != nil {
		return Span{}, fmt.Errorf("jaeger: span %q: span id: %w", o.Name, err)
	}
	var parent string
	if o.ParentSpanID != "" {
		if parent, err = normalizeID(o.ParentSpanID, 8); err != nil {
			return Span{}, fmt.Errorf("jaeger: span %q: parent span id: %w", o.Name, err)
		}
		if strings.Trim(parent, "0") == "" {
			parent = ""
		}
	}
	start, err := unixNano(o.StartTimeUnixNano)
	if err != nil {
		return Span{}, fmt.Errorf("jaeger: span %q: start time: %w", o.Name, err)
	}
	end, err := unixNano(o.EndTimeUnixNano)
	if err != nil {
		return Span{}, fmt.Errorf("jaeger: span %q: end time: %w", o.Name, err)
	}
	s := Span{
		TraceID: traceID, SpanID: spanID, ParentSpanID: parent,
		Service: service, Name: o.Name,
		Start: start, End: end,
		Attributes:    make(map[string]string, len(o.Attributes)),
		StatusMessage: o.Status.Message,
	}
	kind := strings.ToLower(strings.TrimPrefix(unquote(o.Kind), "SPAN_KIND_"))
	if n, err := strconv.Atoi(kind); err == nil {
		kind = ""
		if n > 0 && n < len(spanKinds) {
			kind = spanKinds[n]
		}
	}
	if kind == "unspecified" {
		kind = ""
	}
	s.Kind = kind
	switch unquote(o.Status.Code) {
	case "2", "STATUS_CODE_ERROR":
		s.Error = true
	}
	for _, kv := range o.Attributes {
		s.Attributes[kv.Key] = kv.Value.String()
	}
	if s.Attributes["error"] == "true" {
		s.Error = true
	}
	return s, nil
}

// normalizeID returns an id of size bytes as lowercase hex, from hex (as
// OTLP JSON writes ids) or base64 (as generic protobuf JSON writes bytes).
func normalizeID(s string, size int) (string, error) {
	if len(s) == 2*size {
		if b, err := hex.DecodeString(s); err == nil {
			return hex.EncodeToString(b), nil
		}
	}
	if b, err := base64.StdEncoding.DecodeString(s); err == nil && len(b) == size {
		return hex.EncodeToString(b), nil
	}
	return "", fmt.Errorf("%q is not a %d-byte id in hex or base64", s, size)
}

func unixNano(raw json.RawMessage) (time.Time, error) {
	if len(raw) == 0 {
		return time.Time{}, errors.New("missing")
	}
	n, err := strconv.ParseUint(unquote(raw), 10, 64)
	if err != nil {
		return time.Time{}, err
	}
	if n > 1<<63-1 {
		return time.Time{}, fmt.Errorf("%d is out of range", n)
	}
	return time.Unix(0, int64(n)).UTC(), nil
}

// WaterfallOptions tune RenderWaterfall.
type WaterfallOptions struct {
	// BarWidth is the width of the timeline in characters; 0 means 40.
	BarWidth int
	// MaxNameWidth truncates long, deeply indented span names; 0 means 64.
	MaxNameWidth int
}

// RenderWaterfall writes t as an indented waterfall: one line per span with
// its service, name (children indented under their parent, siblings by start
// time, except that a parent's stage spans follow the pipeline's order, see
// orderSpans), replica (troupe.replica.id), duration, and a bar placed on a
// timeline that spans the whole trace. Error spans are marked "!" in front of
// their name, drawn with '!' and followed by ERROR and the status message.
// Spans whose parent is not in the trace are shown at the top level.
func RenderWaterfall(w io.Writer, t *Trace, opts WaterfallOptions) error {
	if t == nil || len(t.Spans) == 0 {
		return errors.New("jaeger: empty trace")
	}
	barWidth := cmp.Or(opts.BarWidth, 40)
	maxName := cmp.Or(opts.MaxNameWidth, 64)
	rows := orderSpans(t.Spans)

	begin, end := t.Spans[0].Start, t.Spans[0].End
	services := map[string]bool{}
	for _, s := range t.Spans {
		if s.Start.Before(begin) {
			begin = s.Start
		}
		if s.End.After(end) {
			end = s.End
		}
		services[s.Service] = true
	}
	total := max(end.Sub(begin), 0)

	type line struct{ service, name, replica, dur, bar, note string }
	lines := make([]line, len(rows))
	wService, wName, wReplica, wDur := len("SERVICE"), len("SPAN"), len("REPLICA"), len("DURATION")
	for i, r := range rows {
		s := r.span
		name := strings.Repeat("  ", r.depth)
		if s.Error {
			name += "! "
		}
		name = truncate(name+s.Name, maxName)
		l := line{
			service: s.Service,
			name:    name,
			replica: cmp.Or(s.Attributes[string(telemetry.KeyReplicaID)], "-"),
			dur:     FormatDuration(s.Duration()),
			bar:     bar(s.Start.Sub(begin), s.Duration(), total, barWidth, s.Error),
		}
		if s.Error {
			l.note = "  ERROR"
			if s.StatusMessage != "" {
				l.note += ": " + s.StatusMessage
			}
		}
		lines[i] = l
		wService = max(wService, len(l.service))
		wName = max(wName, len([]rune(l.name)))
		wReplica = max(wReplica, len(l.replica))
		wDur = max(wDur, len([]rune(l.dur)))
	}

	var b strings.Builder
	fmt.Fprintf(&b, "trace %s: %d spans, %d services, %s\n", t.TraceID, len(t.Spans), len(services), FormatDuration(total))
	timeline := "0" + strings.Repeat(" ", max(barWidth-len(FormatDuration(total))-1, 1)) + FormatDuration(total)
	fmt.Fprintf(&b, "%s  %s  %s  %s  %s\n",
		pad("SERVICE", wService), pad("SPAN", wName), pad("REPLICA", wReplica), padLeft("DURATION", wDur), " "+timeline)
	for _, l := range lines {
		fmt.Fprintf(&b, "%s  %s  %s  %s  |%s|%s\n",
			pad(l.service, wService), pad(l.name, wName), pad(l.replica, wReplica), padLeft(l.dur, wDur), l.bar, l.note)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

type row struct {
	span  Span
	depth int
}

// orderSpans returns the spans depth first: roots (and orphans) by start
// time, each followed by its children by start time. Spans caught in a
// parent cycle, which no root reaches, come last at the top level.
//
// Among one parent's children, the spans of pipeline stages (those with a
// troupe.stage.id) are listed in the pipeline's order, a stage's attempts
// by start time: the stages of a streamed answer overlap, and a later
// stage (a vocoder waiting for its input) may start before the earlier
// ones. They keep the places the start times give the stage spans as a
// whole, so the other children stay where their start times put them.
func orderSpans(spans []Span) []row {
	ids := make(map[string]bool, len(spans))
	for _, s := range spans {
		ids[s.SpanID] = true
	}
	children := map[string][]int{}
	var roots []int
	for i, s := range spans {
		if s.ParentSpanID == "" || !ids[s.ParentSpanID] || s.ParentSpanID == s.SpanID {
			roots = append(roots, i)
			continue
		}
		children[s.ParentSpanID] = append(children[s.ParentSpanID], i)
	}
	byStart := func(a, b int) int {
		sa, sb := spans[a], spans[b]
		return cmp.Or(
			sa.Start.Compare(sb.Start),
			sb.End.Compare(sa.End), // the enclosing span first
			cmp.Compare(sa.Name, sb.Name),
			cmp.Compare(sa.SpanID, sb.SpanID),
			cmp.Compare(a, b),
		)
	}
	out := make([]row, 0, len(spans))
	visited := make([]bool, len(spans))
	var walk func(i, depth int)
	walk = func(i, depth int) {
		if visited[i] {
			return
		}
		visited[i] = true
		out = append(out, row{span: spans[i], depth: depth})
		kids := children[spans[i].SpanID]
		slices.SortFunc(kids, byStart)
		pipelineOrder(spans, kids)
		for _, k := range kids {
			walk(k, depth+1)
		}
	}
	slices.SortFunc(roots, byStart)
	for _, r := range roots {
		walk(r, 0)
	}
	var rest []int
	for i := range spans {
		if !visited[i] {
			rest = append(rest, i)
		}
	}
	slices.SortFunc(rest, byStart)
	for _, r := range rest {
		walk(r, 0)
	}
	return out
}

// pipelineOrder reorders the stage spans among kids (sorted by start) by
// their troupe.stage.id, stably, leaving every other span in its place.
func pipelineOrder(spans []Span, kids []int) {
	var at, stages []int // positions in kids, and the spans there
	for pos, k := range kids {
		if _, ok := stageID(spans[k]); ok {
			at = append(at, pos)
			stages = append(stages, k)
		}
	}
	if len(stages) < 2 {
		return
	}
	slices.SortStableFunc(stages, func(a, b int) int {
		ia, _ := stageID(spans[a])
		ib, _ := stageID(spans[b])
		return cmp.Compare(ia, ib)
	})
	for n, pos := range at {
		kids[pos] = stages[n]
	}
}

// stageID is a span's troupe.stage.id: its stage's index in the pipeline.
func stageID(s Span) (int, bool) {
	v, ok := s.Attributes[string(telemetry.KeyStageID)]
	if !ok {
		return 0, false
	}
	id, err := strconv.Atoi(v)
	return id, err == nil
}

// bar draws a span starting offset into a trace of length total as width
// characters: '#' (or '!' for errors) where the span runs, at least one.
func bar(offset, dur, total time.Duration, width int, isErr bool) string {
	from, n := 0, width
	if total > 0 {
		from = int(int64(offset) * int64(width) / int64(total))
		// Round the length up, so short spans stay visible.
		n = int((int64(dur)*int64(width) + int64(total) - 1) / int64(total))
	}
	from = min(max(from, 0), width-1)
	n = min(max(n, 1), width-from)
	fill := "#"
	if isErr {
		fill = "!"
	}
	return strings.Repeat(" ", from) + strings.Repeat(fill, n) + strings.Repeat(" ", width-from-n)
}

// FormatDuration prints d with three significant digits: 950µs, 12.3ms, 1.50s.
func FormatDuration(d time.Duration) string {
	f := func(v float64, unit string) string {
		switch {
		case v >= 100:
			return strconv.FormatFloat(v, 'f', 0, 64) + unit
		case v >= 10:
			return strconv.FormatFloat(v, 'f', 1, 64) + unit
		default:
			return strconv.FormatFloat(v, 'f', 2, 64) + unit
		}
	}
	switch {
	case d >= time.Second:
		return f(d.Seconds(), "s")
	case d >= time.Millisecond:
		return f(float64(d)/float64(time.Millisecond), "ms")
	case d >= time.Microsecond:
		return f(float64(d)/float64(time.Microsecond), "µs")
	default:
		return strconv.FormatInt(int64(d), 10) + "ns"
	}
}

func truncate(s string, n int) string {
	r := []rune(s)
	if len(r) <= n {
		return s
	}
	return string(r[:n-3]) + "..."
}

func pad(s string, n int) string {
	return s + strings.Repeat(" ", max(n-len([]rune(s)), 0))
}

func padLeft(s string, n int) string {
	return strings.Repeat(" ", max(n-len([]rune(s)), 0)) + s
}
