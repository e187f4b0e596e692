package telemetry

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// recordingWriter keeps every write, and signals each on wrote.
type recordingWriter struct {
	mu     sync.Mutex
	writes []string
	wrote  chan struct{}
}

func newRecordingWriter() *recordingWriter {
	return &recordingWriter{wrote: make(chan struct{}, 1024)}
}

func (w *recordingWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	w.writes = append(w.writes, string(p))
	w.mu.Unlock()
	select {
	case w.wrote <- struct{}{}:
	default:
	}
	return len(p), nil
}

func (w *recordingWriter) all() (writes int, text string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.writes), strings.Join(w.writes, "")
}

func TestBufferedLoggerBatchesRecords(t *testing.T) {
	w := newRecordingWriter()
	log, flush := NewBufferedLogger(w, slog.LevelInfo, false)
	defer flush()
	start := time.Now()
	for i := range 3 {
		log.Info("request", "n", i)
	}
	n, _ := w.all()
	assert.Zero(t, n, "records are held")

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	select {
	case <-w.wrote:
	case <-ctx.Done():
		t.Fatal("held records were never written")
	}
	assert.GreaterOrEqual(t, time.Since(start), LogFlushInterval/2, "written by the timer, not at once")
	n, text := w.all()
	assert.Equal(t, 1, n, "three records, one write")
	assert.Equal(t, 3, strings.Count(text, "msg=request"))
	assert.Less(t, strings.Index(text, "n=0"), strings.Index(text, "n=2"), "in order")
}

func TestBufferedLoggerWritesWarningsAtOnce(t *testing.T) {
	w := newRecordingWriter()
	log, flush := NewBufferedLogger(w, slog.LevelInfo, true)
	defer flush()
	log.Info("before")
	log.With("component", "head").Warn("trouble")
	n, text := w.all()
	require.Equal(t, 1, n, "the warning, with the record before it, in one write")
	assert.Less(t, strings.Index(text, `"msg":"before"`), strings.Index(text, `"msg":"trouble"`))
	assert.Contains(t, text, `"component":"head"`)
}

func TestBufferedLoggerFlush(t *testing.T) {
	w := newRecordingWriter()
	log, flush := NewBufferedLogger(w, slog.LevelInfo, false)
	log.Info("held")
	flush()
	n, text := w.all()
	require.Equal(t, 1, n)
	assert.Contains(t, text, "msg=held")
	log.Info("after") // flushed loggers write through
	n, text = w.all()
	assert.Equal(t, 2, n)
	assert.Contains(t, text, "msg=after")
	flush() // twice is harmless
}

func TestBufferedLoggerFullBufferAndLargeRecords(t *testing.T) {
	w := newRecordingWriter()
	log, flush := NewBufferedLogger(w, slog.LevelInfo, false)
	line := strings.Repeat("x", 1000)
	var want int
	for want = 0; want*1000 < logBufferSize+10_000; want++ {
		log.Info("line", "v", line)
	}
	n, _ := w.all()
	assert.GreaterOrEqual(t, n, 1, "a full buffer is written without waiting for the timer")
	huge := strings.Repeat("y", 2*logBufferSize)
	log.Info("huge", "v", huge)
	flush()
	_, text := w.all()
	assert.Equal(t, want, strings.Count(text, "msg=line"), "nothing lost")
	assert.Contains(t, text, huge)
	assert.Less(t, strings.LastIndex(text, "msg=line"), strings.Index(text, "msg=huge"), "in order")
}

func TestBufferedLoggerConcurrent(t *testing.T) {
	var buf bytes.Buffer
	var mu sync.Mutex
	log, flush := NewBufferedLogger(writerFunc(func(p []byte) (int, error) {
		mu.Lock()
		defer mu.Unlock()
		return buf.Write(p)
	}), slog.LevelInfo, false)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 500 {
				log.Info("r", "g", g, "i", i)
			}
		})
	}
	wg.Wait()
	flush()
	mu.Lock()
	defer mu.Unlock()
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	require.Len(t, lines, 8*500)
	for _, l := range lines {
		require.True(t, strings.HasPrefix(l, "time="), "whole lines, never interleaved: %q", l)
	}
	assert.Contains(t, buf.String(), fmt.Sprintf("g=%d i=%d", 7, 499))
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }
