package httpapi

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/troupe-serving/troupe/orchestrator"
)

// watchKeepalive is how long a watch of /v1/replicas stays silent before
// it sends a keepalive line, so that proxies with an idle timeout (nginx's
// proxy_read_timeout is 60 s) keep the stream.
const watchKeepalive = 15 * time.Second

// maxReplicaWatches bounds the watches of /v1/replicas a server serves at
// once: each holds a goroutine pair and a mark of every row it follows (a
// megabyte at 10,000 replicas), and its start reads every row. Dashboards
// and controllers need a few.
const maxReplicaWatches = 64

// replicaEvent is one line of GET /v1/replicas?watch=true.
type replicaEvent struct {
	// Type is "replica" (Replica is a row), "synced" (every row as it was
	// when the watch began has been sent) or "keepalive".
	Type    string                      `json:"type"`
	Replica *orchestrator.ReplicaStatus `json:"replica,omitempty"`
}

// watchReplicas serves GET /v1/replicas?watch=true[&stage=]: a stream of
// JSON lines (application/x-ndjson), first every row as it is, then
// "synced", then each row again whenever its state, reason, addresses,
// engine index, joined_at or lease_lost_until change (not its load or
// in-flight figures, which change with every request). The stream ends
// when the client goes, when a write stalls past the server's
// WriteStallTimeout, or when the server drains.
func (s *Server) watchReplicas(w http.ResponseWriter, r *http.Request, stage int) {
	if s.watches.Add(1) > maxReplicaWatches {
		s.watches.Add(-1)
		w.Header().Set("Retry-After", "1")
		s.reject(w, r, &apiError{Status: http.StatusTooManyRequests, Type: typeRateLimit, Code: "too_many_watches",
			Message: fmt.Sprintf("the head already serves %d watches of /v1/replicas, its limit; close one, or poll", maxReplicaWatches)})
		return
	}
	defer s.watches.Add(-1)
	watch, rows := s.b.WatchReplicas(stage)
	h := w.Header()
	h.Set("Content-Type", "application/x-ndjson")
	h.Set("Cache-Control", "no-store")
	// Buffering proxies (nginx) would hold the lines back.
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	out := &lineWriter{w: bufio.NewWriterSize(w, 32<<10), rc: http.NewResponseController(w), timeout: s.cfg.WriteStallTimeout}
	// ctx ends with the request or at the server's drain; the goroutine
	// that cancels it on drain ends before the handler returns.
	ctx, cancel := context.WithCancel(r.Context())
	drainWatched := make(chan struct{})
	defer func() { cancel(); <-drainWatched }()
	go func() {
		defer close(drainWatched)
		select {
		case <-s.drained:
			cancel()
		case <-ctx.Done():
		}
	}()
	err := out.rows(rows)
	if err == nil {
		err = out.send(replicaEvent{Type: "synced"})
	}
	for err == nil {
		next, wait := context.WithTimeout(ctx, watchKeepalive)
		rows, werr := watch.Next(next)
		wait()
		switch {
		case werr == nil:
			err = out.rows(rows)
		case ctx.Err() != nil:
			return // the client went, or the server drains
		default: // silent for watchKeepalive
			err = out.send(replicaEvent{Type: "keepalive"})
		}
	}
	if !errors.Is(err, context.Canceled) {
		s.log.DebugContext(r.Context(), "httpapi: replica watch ended", "request_id", requestIDFrom(r.Context()), "err", err)
	}
}

// lineWriter writes a watch's JSON lines, each batch in one flush, every
// write and flush bounded by timeout.
type lineWriter struct {
	w       *bufio.Writer
	rc      *http.ResponseController
	timeout time.Duration
}

func (l *lineWriter) rows(rows []orchestrator.ReplicaStatus) error {
	for i := range rows {
		if err := l.write(replicaEvent{Type: "replica", Replica: &rows[i]}); err != nil {
			return err
		}
	}
	return l.flush()
}

func (l *lineWriter) send(ev replicaEvent) error {
	if err := l.write(ev); err != nil {
		return err
	}
	return l.flush()
}

func (l *lineWriter) write(ev replicaEvent) error {
	line, err := json.Marshal(ev)
	if err != nil {
		return fmt.Errorf("httpapi: encode replica event: %w", err)
	}
	// A write that fills the buffer goes to the connection: it needs the
	// deadline too.
	_ = l.rc.SetWriteDeadline(time.Now().Add(l.timeout))
	if _, err := l.w.Write(append(line, '\n')); err != nil {
		return fmt.Errorf("httpapi: write replica event: %w", err)
	}
	return nil
}

func (l *lineWriter) flush() error {
	_ = l.rc.SetWriteDeadline(time.Now().Add(l.timeout))
	if err := l.w.Flush(); err != nil {
		return fmt.Errorf("httpapi: write replica event: %w", err)
	}
	if err := l.rc.Flush(); err != nil {
		return fmt.Errorf("httpapi: flush replica event: %w", err)
	}
	return nil
}
