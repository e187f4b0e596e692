package httpapi

import (
	"fmt"
	"io"
	"net/http"
	"time"
)

// Deadlines of a request body (see Config.BodyIdleTimeout): the defaults
// of Config.BodyIdleTimeout and Config.BodyMinRate, and the bound of the
// whole request, NewHTTPServer's ReadTimeout.
const (
	DefaultBodyIdleTimeout = 10 * time.Second
	DefaultBodyMinRate     = 8 << 10 // bytes per second
	DefaultBodyReadTimeout = 60 * time.Second
)

// pacedBody is a request body whose every Read has a deadline (set on the
// connection through http.ResponseController, so a blocked Read fails at
// it), the earliest of:
//   - idle after the Read starts: a client may pause at most that long;
//   - start + idle + n/rate, n the bytes received so far: after the first
//     idle period the body's average rate since the request began must be
//     at least rate bytes per second, however large it is (a body trickled
//     a byte every few seconds is cut once idle has passed); rate <= 0:
//     no rate;
//   - start + total: the whole request, as the server's ReadTimeout.
//
// A Read that misses its deadline fails with os.ErrDeadlineExceeded
// (Server.readBody answers 408). After the body's end no deadline is set:
// net/http lifts it for its background read, which must never time out
// while a response streams.
type pacedBody struct {
	io.ReadCloser
	rc    *http.ResponseController
	start time.Time
	idle  time.Duration
	rate  int64
	total time.Duration
	n     int64
	ended bool
}

func (b *pacedBody) Read(p []byte) (int, error) {
	if !b.ended {
		_ = b.rc.SetReadDeadline(b.deadline(time.Now()))
	}
	n, err := b.ReadCloser.Read(p)
	b.n += int64(n)
	if err != nil {
		b.ended = true
	}
	return n, err
}

// deadline is the next Read's deadline at now.
func (b *pacedBody) deadline(now time.Time) time.Time {
	d := now.Add(b.idle)
	if end := b.start.Add(b.total); end.Before(d) {
		d = end
	}
	if b.rate > 0 {
		paced := b.start.Add(b.idle + time.Duration(float64(b.n)/float64(b.rate)*float64(time.Second)))
		if paced.Before(d) {
			d = paced
		}
	}
	return d
}

// paced wraps r's body in a pacedBody whose deadlines count from start;
// a request without a body keeps its own.
func (s *Server) paced(w http.ResponseWriter, r *http.Request, start time.Time) io.ReadCloser {
	if r.Body == nil || r.Body == http.NoBody || r.ContentLength == 0 {
		return r.Body
	}
	return &pacedBody{ReadCloser: r.Body, rc: http.NewResponseController(w), start: start,
		idle: s.cfg.BodyIdleTimeout, rate: s.cfg.BodyMinRate, total: DefaultBodyReadTimeout}
}

// slowBodyMessage is the message of a 408 body_too_slow.
func (s *Server) slowBodyMessage() string {
	msg := fmt.Sprintf("the request body arrived too slowly: each part must come within %v", s.cfg.BodyIdleTimeout)
	if s.cfg.BodyMinRate > 0 {
		msg += fmt.Sprintf(" and, after that, at %d bytes per second or more on average", s.cfg.BodyMinRate)
	}
	return msg + fmt.Sprintf(", the whole request within %v", DefaultBodyReadTimeout)
}
