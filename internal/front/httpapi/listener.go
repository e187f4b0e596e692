package httpapi

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strconv"
)

// NewListener wraps a listener so that the errors net/http answers by
// itself, before any handler runs (431 for headers over MaxHeaderBytes, 400
// for a missing or malformed Host or a bad header, 501 for an unknown
// transfer encoding), are sent in OpenAI's error shape like every other
// error, instead of net/http's plain text. Serve every NewHTTPServer
// through it.
func NewListener(l net.Listener) net.Listener { return errorListener{l} }

type errorListener struct{ net.Listener }

func (l errorListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &errorConn{Conn: c}, nil
}

// errorConn rewrites net/http's early error responses. net/http writes
// each of them to the connection in one Write, as
//
//	HTTP/1.1 <code> <reason>\r\n<earlyErrorHeaders><text>
//
// bypassing its buffered writer; a response of a handler always has a
// Date header, so it never looks like that.
type errorConn struct{ net.Conn }

// earlyErrorHeaders are the headers net/http sends with its own errors
// (net/http/server.go, conn.serve).
const earlyErrorHeaders = "\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n\r\n"

func (c *errorConn) Write(p []byte) (int, error) {
	rewritten, ok := rewriteEarlyError(p)
	if !ok {
		return c.Conn.Write(p)
	}
	if _, err := c.Conn.Write(rewritten); err != nil {
		return 0, err
	}
	return len(p), nil
}

// CloseWrite lets net/http half-close after a 431, as it does on a
// *net.TCPConn.
func (c *errorConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// rewriteEarlyError returns p in OpenAI's error shape when p is one of
// net/http's early errors.
func rewriteEarlyError(p []byte) ([]byte, bool) {
	rest, ok := bytes.CutPrefix(p, []byte("HTTP/1.1 "))
	if !ok {
		return nil, false
	}
	// The status line ends at the first CRLF, where an early error's
	// headers begin. Looking no further keeps a large answer (a WAV in
	// base64) from being scanned on its way out.
	end := bytes.Index(rest, []byte("\r\n"))
	if end < 3 || !bytes.HasPrefix(rest[end:], []byte(earlyErrorHeaders)) {
		return nil, false
	}
	statusLine, text := rest[:end], rest[end+len(earlyErrorHeaders):]
	status, err := strconv.Atoi(string(statusLine[:3]))
	if err != nil || status < 400 {
		return nil, false
	}
	e := &apiError{Status: status, Type: typeInvalidRequest}
	switch status {
	case http.StatusRequestHeaderFieldsTooLarge:
		e.Code, e.Message = "headers_too_large", "the request's header fields are too large"
	case http.StatusNotImplemented:
		e.Code, e.Message = "not_implemented", "unsupported transfer encoding"
	default:
		e.Code, e.Message = "bad_request", "malformed request"
		// "400 Bad Request: missing required Host header"
		if _, detail, ok := bytes.Cut(text, []byte(": ")); ok && len(detail) > 0 {
			e.Message = "malformed request: " + string(detail)
		}
	}
	body, err := json.Marshal(errorBody{Error: detailOf(e)})
	if err != nil {
		return nil, false
	}
	body = append(body, '\n')
	var b bytes.Buffer
	fmt.Fprintf(&b, "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n", status, http.StatusText(status), len(body))
	b.Write(body)
	return b.Bytes(), true
}
