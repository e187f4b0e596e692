package telemetry

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func decodeLines(t *testing.T, buf *bytes.Buffer) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		var m map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &m), line)
		out = append(out, m)
	}
	return out
}

func TestLoggerStampsTraceIDs(t *testing.T) {
	var buf bytes.Buffer
	log := NewLogger(&buf, slog.LevelInfo, true).With("component", "head")
	ctx := remoteParent(false) // unsampled spans are correlated too

	log.InfoContext(ctx, "routed", "stage", "thinker")
	log.InfoContext(context.Background(), "no span")
	log.DebugContext(ctx, "below the level")
	log.WithGroup("req").InfoContext(ctx, "grouped", "id", "r1")

	lines := decodeLines(t, &buf)
	require.Len(t, lines, 3, "the debug line must be filtered")
	assert.Equal(t, "routed", lines[0]["msg"])
	assert.Equal(t, "4bf92f350102030405060708090a0b0c", lines[0][LogKeyTraceID])
	assert.Equal(t, "00f067aa0ba902b7", lines[0][LogKeySpanID])
	assert.Equal(t, "head", lines[0]["component"])
	assert.Equal(t, "thinker", lines[0]["stage"])

	assert.NotContains(t, lines[1], LogKeyTraceID)
	assert.NotContains(t, lines[1], LogKeySpanID)

	group, ok := lines[2]["req"].(map[string]any)
	require.True(t, ok, "group req missing: %v", lines[2])
	assert.Equal(t, "r1", group["id"])
	assert.Equal(t, "4bf92f350102030405060708090a0b0c", group[LogKeyTraceID])
}

func TestLoggerText(t *testing.T) {
	var buf bytes.Buffer
	var level slog.LevelVar
	level.Set(slog.LevelWarn)
	log := NewLogger(&buf, &level, false)
	log.InfoContext(remoteParent(true), "hidden")
	level.Set(slog.LevelInfo)
	log.InfoContext(remoteParent(true), "shown")
	out := buf.String()
	assert.NotContains(t, out, "hidden")
	assert.Contains(t, out, "msg=shown trace_id=4bf92f350102030405060708090a0b0c span_id=00f067aa0ba902b7")
}

func TestTraceLogAttrs(t *testing.T) {
	ctx := remoteParent(true)
	traceID, spanID, ok := TraceLogAttrs(TraceparentHeader(ctx))
	require.True(t, ok)
	assert.True(t, traceID.Equal(slog.String(LogKeyTraceID, "4bf92f350102030405060708090a0b0c")), "%v", traceID)
	assert.True(t, spanID.Equal(slog.String(LogKeySpanID, "00f067aa0ba902b7")), "%v", spanID)
	for _, bad := range []string{"", "01-4bf92f350102030405060708090a0b0c-00f067aa0ba902b7-01", "00-4bf92f350102030405060708090a0b0c-00f067aa0ba902b7-01-x", "00-4bf92f350102030405060708090a0b0c_00f067aa0ba902b7-01"} {
		_, _, ok := TraceLogAttrs(bad)
		assert.False(t, ok, bad)
	}

	// A record that ends with them is written as it is: the ids once.
	var buf bytes.Buffer
	log := NewLogger(&buf, slog.LevelInfo, false)
	log.LogAttrs(ctx, slog.LevelInfo, "given", slog.Int("n", 1), traceID, spanID)
	// Not last: the handler adds its own, as for any record.
	log.LogAttrs(ctx, slog.LevelInfo, "not last", traceID, spanID, slog.Int("n", 1))
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	require.Len(t, lines, 2)
	assert.True(t, strings.HasSuffix(lines[0], " msg=given n=1 trace_id=4bf92f350102030405060708090a0b0c span_id=00f067aa0ba902b7"), lines[0])
	assert.Equal(t, 2, strings.Count(lines[1], "trace_id="), lines[1])
}

// BenchmarkLogger is a log line with a span in its context, through the
// handler that adds the trace ids.
func BenchmarkLogger(b *testing.B) {
	log := NewLogger(io.Discard, slog.LevelInfo, false)
	ctx := remoteParent(false)
	b.ReportAllocs()
	for b.Loop() {
		log.LogAttrs(ctx, slog.LevelInfo, "routed", slog.String("stage", "thinker"))
	}
}
