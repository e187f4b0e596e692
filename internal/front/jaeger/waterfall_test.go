package jaeger

import (
	"bytes"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// testdata/jaeger_trace.json is Jaeger v2.13's answer to
// GET /api/v3/traces/{id} for the trace emitPipeline sends, recorded by
// TestJaegerSmoke with TROUPE_JAEGER_RECORD (see scripts/jaeger-smoke.sh).
const fixtureTraceID = "42062905e4d1f4777ffc2d79537e9403"

func readFixture(t *testing.T) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "jaeger_trace.json"))
	require.NoError(t, err)
	return b
}

func TestFormatDuration(t *testing.T) {
	for d, want := range map[time.Duration]string{
		0:                        "0ns",
		999:                      "999ns",
		1500:                     "1.50µs",
		950 * time.Microsecond:   "950µs",
		12300 * time.Microsecond: "12.3ms",
		100 * time.Millisecond:   "100ms",
		1500 * time.Millisecond:  "1.50s",
		90 * time.Second:         "90.0s",
	} {
		assert.Equal(t, want, FormatDuration(d), "%d", d)
	}
}

func TestBar(t *testing.T) {
	ms := time.Millisecond
	cases := []struct {
		offset, dur, total time.Duration
		err                bool
		want               string
	}{
		{0, 100 * ms, 100 * ms, false, "##########"},
		{50 * ms, 50 * ms, 100 * ms, false, "     #####"},
		{20 * ms, 1 * ms, 100 * ms, false, "  #       "}, // short spans stay visible
		{99 * ms, 1 * ms, 100 * ms, false, "         #"},
		{100 * ms, 0, 100 * ms, false, "         #"},     // clamped into the timeline
		{10 * ms, 31 * ms, 100 * ms, true, " !!!!     "}, // length rounds up
		{0, 0, 0, false, "##########"},                   // a zero-length trace
	}
	for _, c := range cases {
		assert.Equal(t, c.want, bar(c.offset, c.dur, c.total, 10, c.err), "%v+%v of %v", c.offset, c.dur, c.total)
	}
}

func synthetic(id, parent, name string, from, to int) Span {
	base := time.Unix(1700000000, 0)
	return Span{
		TraceID: "0000000000000000000000000000000a", SpanID: id, ParentSpanID: parent, Service: "svc", Name: name,
		Start: base.Add(time.Duration(from) * time.Millisecond), End: base.Add(time.Duration(to) * time.Millisecond),
		Attributes: map[string]string{},
	}
}

func TestOrderSpans(t *testing.T) {
	spans := []Span{
		synthetic("c2", "r", "second child", 50, 60),
		synthetic("gc", "c1", "grandchild", 11, 12),
		synthetic("r", "", "root", 0, 100),
		synthetic("c1", "r", "first child", 10, 20),
		synthetic("o", "missing", "orphan", 5, 6),
		synthetic("x", "y", "cycle x", 70, 71),
		synthetic("y", "x", "cycle y", 72, 73),
		synthetic("s", "s", "self parent", 80, 81),
	}
	var got []string
	for _, r := range orderSpans(spans) {
		got = append(got, strings.Repeat(".", r.depth)+r.span.Name)
	}
	assert.Equal(t, []string{
		"root", ".first child", "..grandchild", ".second child",
		"orphan",
		"self parent",
		"cycle x", ".cycle y",
	}, got)
}

func TestParseOTLPJSONVariants(t *testing.T) {
	// Generic protobuf JSON: base64 ids, numbers as numbers, enum names,
	// the pre-0.19 instrumentationLibrarySpans, the legacy error attribute.
	doc := `{"resourceSpans":[{"resource":{"attributes":[{"key":"service.name","value":{"stringValue":"w"}}]},
	  "instrumentationLibrarySpans":[{"spans":[
	    {"traceId":"S/kvNXezTaajzpKdDg5HNg==","spanId":"APBnqgupArc=","name":"a","kind":"SPAN_KIND_CLIENT",
	     "startTimeUnixNano":1700000000000000000,"endTimeUnixNano":"1700000000002000000",
	     "attributes":[{"key":"troupe.replica.id","value":{"intValue":3}},{"key":"error","value":{"boolValue":true}},
	                   {"key":"list","value":{"arrayValue":{"values":[{"stringValue":"x"},{"intValue":"2"}]}}}],
	     "status":{"code":"STATUS_CODE_UNSET"}}]}]}]}`
	tr, err := ParseOTLPJSON([]byte(doc))
	require.NoError(t, err)
	require.Len(t, tr.Spans, 1)
	s := tr.Spans[0]
	assert.Equal(t, "4bf92f3577b34da6a3ce929d0e0e4736", s.TraceID)
	assert.Equal(t, "00f067aa0ba902b7", s.SpanID)
	assert.Equal(t, "w", s.Service)
	assert.Equal(t, "client", s.Kind)
	assert.Equal(t, 2*time.Millisecond, s.Duration())
	assert.Equal(t, "3", s.Attributes["troupe.replica.id"])
	assert.Equal(t, `["x","2"]`, s.Attributes["list"])
	assert.True(t, s.Error, "error=true marks an error span")

	for name, bad := range map[string]string{
		"not json":     `{`,
		"no spans":     `{"result":{"resourceSpans":[]}}`,
		"short id":     `{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":"abc","spanId":"00f067aa0ba902b7","startTimeUnixNano":"1","endTimeUnixNano":"2"}]}]}]}`,
		"bad time":     `{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":"4bf92f3577b34da6a3ce929d0e0e4736","spanId":"00f067aa0ba902b7","startTimeUnixNano":"soon","endTimeUnixNano":"2"}]}]}]}`,
		"jaeger error": `{"error":{"httpCode":404,"message":"trace not found"}}`,
	} {
		_, err := ParseOTLPJSON([]byte(bad))
		assert.Error(t, err, name)
	}
}

func TestRenderWaterfallRejectsEmpty(t *testing.T) {
	var buf bytes.Buffer
	assert.Error(t, RenderWaterfall(&buf, &Trace{}, WaterfallOptions{}))
	assert.Error(t, RenderWaterfall(&buf, nil, WaterfallOptions{}))
	assert.Zero(t, buf.Len())
}

// wantFixtureWaterfall was checked by hand: 100ms over 40 characters is
// 2.5ms a character; the failed thinker attempt runs 2-10ms (columns 0-3),
// the second 11-60ms (4-23), the talker 61-98ms (24-38).
const wantFixtureWaterfall = `trace 42062905e4d1f4777ffc2d79537e9403: 16 spans, 2 services, 100ms
SERVICE        SPAN                                           REPLICA  DURATION   0                                  100ms
troupe-head    POST /v1/chat/completions                      -           100ms  |########################################|
troupe-head      troupe.request                               -          98.0ms  |########################################|
troupe-head        ! troupe.stage thinker                     0          8.00ms  |!!!!                                    |  ERROR: replica thinker/0 unavailable
troupe-head          ! troupe.stage.v1.StageService/Generate  -          6.00ms  | !!!                                    |  ERROR: replica thinker/0 unavailable
troupe-head        troupe.stage thinker                       2          49.0ms  |    ####################                |
troupe-head          troupe.stage.v1.StageService/Generate    -          47.0ms  |    ###################                 |
troupe-worker          troupe.stage.v1.StageService/Generate  2          45.0ms  |     ##################                 |
troupe-worker            queue                                -          2.00ms  |     #                                  |
troupe-worker            prefill                              -          8.00ms  |      ####                              |
troupe-worker            decode                               -          34.0ms  |         ##############                 |
troupe-head        troupe.stage talker                        1          37.0ms  |                        ############### |
troupe-head          troupe.stage.v1.StageService/Generate    -          35.0ms  |                        ##############  |
troupe-worker          troupe.stage.v1.StageService/Generate  1          33.0ms  |                         ############## |
troupe-worker            queue                                -          2.00ms  |                         #              |
troupe-worker            prefill                              -          8.00ms  |                          ####          |
troupe-worker            decode                               -          22.0ms  |                             #########  |
`

func TestRenderWaterfallOfRecordedJaegerTrace(t *testing.T) {
	tr, err := ParseOTLPJSON(readFixture(t))
	require.NoError(t, err)
	assert.Equal(t, fixtureTraceID, tr.TraceID)
	require.Len(t, tr.Spans, 16)

	var buf bytes.Buffer
	require.NoError(t, RenderWaterfall(&buf, tr, WaterfallOptions{}))
	assert.Equal(t, wantFixtureWaterfall, buf.String())

	// The tree holds whatever order Jaeger lists spans in.
	reversed := &Trace{TraceID: tr.TraceID}
	for i := len(tr.Spans) - 1; i >= 0; i-- {
		reversed.Spans = append(reversed.Spans, tr.Spans[i])
	}
	var again bytes.Buffer
	require.NoError(t, RenderWaterfall(&again, reversed, WaterfallOptions{}))
	assert.Equal(t, buf.String(), again.String())
}

func TestRenderWaterfallOptions(t *testing.T) {
	tr, err := ParseOTLPJSON(readFixture(t))
	require.NoError(t, err)
	var buf bytes.Buffer
	require.NoError(t, RenderWaterfall(&buf, tr, WaterfallOptions{BarWidth: 10, MaxNameWidth: 20}))
	lines := strings.Split(strings.TrimSuffix(buf.String(), "\n"), "\n")
	require.Len(t, lines, 18)
	assert.Equal(t, "troupe-head    POST /v1/chat/com...  -           100ms  |##########|", lines[2])
	assert.Equal(t, "troupe-head        ! troupe.stag...  0          8.00ms  |!         |  ERROR: replica thinker/0 unavailable", lines[4])
	assert.Equal(t, "troupe-worker            decode      -          22.0ms  |       ###|", lines[17])
}

// stageSpan is a `troupe.stage <name>` span of the stage at index id.
func stageSpan(spanID, stage string, id, from, to int) Span {
	s := synthetic(spanID, "r", "troupe.stage "+stage, from, to)
	s.Attributes["troupe.stage.id"] = strconv.Itoa(id)
	return s
}

// TestStagesInPipelineOrder: the stages of a streamed answer overlap, and
// a later stage may start first (the vocoder waits for codes while the
// thinker is still queued): the waterfall lists them in the pipeline's
// order, a stage's attempts by start time, and every other child where its
// start time puts it.
func TestStagesInPipelineOrder(t *testing.T) {
	tr := &Trace{TraceID: "0000000000000000000000000000000a", Spans: []Span{
		synthetic("r", "", "troupe.request", 0, 100),
		stageSpan("v", "vocoder", 2, 2, 99),
		stageSpan("k", "talker", 1, 3, 98),
		stageSpan("t2", "thinker", 0, 12, 60),
		stageSpan("t1", "thinker", 0, 4, 10),
		synthetic("a", "r", "admission", 1, 2),
		synthetic("w", "r", "write answer", 99, 100),
		synthetic("c", "t2", "troupe.stage.v1.StageService/Generate", 13, 59),
	}}
	var got []string
	for _, r := range orderSpans(tr.Spans) {
		got = append(got, strings.Repeat(".", r.depth)+r.span.Name+" "+r.span.SpanID)
	}
	assert.Equal(t, []string{
		"troupe.request r",
		".admission a",
		".troupe.stage thinker t1",
		".troupe.stage thinker t2",
		"..troupe.stage.v1.StageService/Generate c",
		".troupe.stage talker k",
		".troupe.stage vocoder v",
		".write answer w",
	}, got)

	var buf bytes.Buffer
	require.NoError(t, RenderWaterfall(&buf, tr, WaterfallOptions{}))
	var names []string
	for _, line := range strings.Split(strings.TrimSpace(buf.String()), "\n")[2:] {
		if f := strings.Fields(line); len(f) > 2 && f[1] == "troupe.stage" {
			names = append(names, f[2])
		}
	}
	assert.Equal(t, []string{"thinker", "thinker", "talker", "vocoder"}, names, buf.String())
}
