package telemetry

import (
	"fmt"
	"io"
	"log/slog"
	"sync"
	"time"
)

// LogFlushInterval is how long a buffered logger holds a record at most.
const LogFlushInterval = 100 * time.Millisecond

// logBufferSize is written out as soon as it is filled: at thousands of
// requests a second, the request log fills it about every 50 ms.
const logBufferSize = 64 << 10

// NewBufferedLogger is NewLogger writing to w in batches, so that a busy
// head does not pay one write system call per request log line, as nginx's
// access log need not (docs/architecture.md, "The per-request hot path").
// A record is written at most LogFlushInterval after it was logged; one at
// Warn or above is written at once, with every record before it. flush
// writes what is held, and must be called before the process exits
// (records logged after it are written unbuffered). The logger and flush
// may be used concurrently.
func NewBufferedLogger(w io.Writer, level slog.Leveler, json bool) (log *slog.Logger, flush func()) {
	b := &logBuffer{w: w}
	return slog.New(traceHandler{inner: formatHandler(b, level, json), flush: b.flushNow}), b.close
}

// logBuffer is an io.Writer that holds what it is given until its timer
// fires, it is full, or it is flushed. The records of a failed write are
// dropped: a logger has nowhere to report it, buffered or not.
type logBuffer struct {
	mu     sync.Mutex
	w      io.Writer
	buf    []byte
	timer  *time.Timer // armed while buf holds records
	closed bool        // write through
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return b.w.Write(p)
	}
	if len(b.buf)+len(p) > logBufferSize {
		if err := b.writeOutLocked(); err != nil {
			return 0, err
		}
		if len(p) > logBufferSize {
			return b.w.Write(p)
		}
	}
	if len(b.buf) == 0 {
		if b.timer == nil {
			b.timer = time.AfterFunc(LogFlushInterval, b.flushNow)
		} else {
			b.timer.Reset(LogFlushInterval)
		}
	}
	b.buf = append(b.buf, p...)
	return len(p), nil
}

// flushNow writes what is held.
func (b *logBuffer) flushNow() {
	b.mu.Lock()
	defer b.mu.Unlock()
	_ = b.writeOutLocked()
}

// close writes what is held and makes later writes unbuffered.
func (b *logBuffer) close() {
	b.mu.Lock()
	defer b.mu.Unlock()
	_ = b.writeOutLocked()
	b.closed = true
	if b.timer != nil {
		b.timer.Stop()
	}
}

func (b *logBuffer) writeOutLocked() error {
	if len(b.buf) == 0 {
		return nil
	}
	_, err := b.w.Write(b.buf)
	b.buf = b.buf[:0]
	if err != nil {
		return fmt.Errorf("telemetry: log write: %w", err)
	}
	return nil
}
