package httpapi

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// OpenAI error types. The status code is what clients branch on; the type
// and code refine it for humans and for logs.
const (
	typeInvalidRequest = "invalid_request_error"
	typeAuthentication = "authentication_error"
	typePermission     = "permission_error"
	typeNotFound       = "not_found_error"
	typeServer         = "server_error"
	typeRateLimit      = "rate_limit_error"
)

// apiError is an error answered to the client in OpenAI's error shape:
// {"error":{"message","type","param","code"}}.
type apiError struct {
	Status  int    // HTTP status
	Message string // shown to the client
	Type    string
	Param   string // the offending request field, "" when none
	Code    string
	// RetryAfter, when set, is sent as the Retry-After header (seconds).
	RetryAfter string
}

func (e *apiError) Error() string {
	return fmt.Sprintf("httpapi: %d %s: %s", e.Status, e.Code, e.Message)
}

// badRequest is a 400 for the request field param ("" when it is the whole
// body).
func badRequest(param, code, format string, args ...any) *apiError {
	return &apiError{Status: http.StatusBadRequest, Type: typeInvalidRequest, Param: param, Code: code, Message: fmt.Sprintf(format, args...)}
}

func notFound(param, code, format string, args ...any) *apiError {
	return &apiError{Status: http.StatusNotFound, Type: typeNotFound, Param: param, Code: code, Message: fmt.Sprintf(format, args...)}
}

// errorBody is the JSON written for an apiError.
type errorBody struct {
	Error errorDetail `json:"error"`
}

type errorDetail struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

// writeError answers e. It must be called before anything else was written.
func writeError(w http.ResponseWriter, e *apiError) {
	if e.RetryAfter != "" {
		w.Header().Set("Retry-After", e.RetryAfter)
	}
	writeJSON(w, e.Status, errorBody{Error: detailOf(e)})
}

func detailOf(e *apiError) errorDetail {
	d := errorDetail{Message: e.Message, Type: e.Type}
	if e.Param != "" {
		d.Param = &e.Param
	}
	if e.Code != "" {
		d.Code = &e.Code
	}
	return d
}

// writeJSON answers v with status.
func writeJSON(w http.ResponseWriter, status int, v any) {
	buf := jsonBuffers.Get().(*bytes.Buffer)
	defer putJSONBuffer(buf)
	if a, ok := v.(jsonAppender); ok {
		buf.Write(append(a.appendJSON(buf.AvailableBuffer()), '\n'))
	} else if err := json.NewEncoder(buf).Encode(v); err != nil { // Encode adds the newline
		// Only our own response types reach here; they always marshal.
		status = http.StatusInternalServerError
		buf.Reset()
		buf.WriteString(`{"error":{"message":"internal error: cannot encode response","type":"server_error","param":null,"code":"internal_error"}}` + "\n")
	}
	h := w.Header()
	h.Set("Content-Type", "application/json")
	// A length, not chunks: the answer is whole, and a large one (audio)
	// would otherwise go out framed in chunks.
	h.Set("Content-Length", strconv.Itoa(buf.Len()))
	w.WriteHeader(status)
	_, _ = w.Write(buf.Bytes())
}

// jsonBuffers pools the buffers responses are encoded into: an answer
// with audio is hundreds of kilobytes, which a fresh buffer per response
// would allocate (and clear) every time.
var jsonBuffers = sync.Pool{New: func() any { return new(bytes.Buffer) }}

// maxPooledJSONBuffer: larger buffers (a minutes-long WAV) go to the
// garbage collector rather than stay pinned in the pool.
const maxPooledJSONBuffer = 4 << 20

func putJSONBuffer(buf *bytes.Buffer) {
	if buf.Cap() > maxPooledJSONBuffer {
		return
	}
	buf.Reset()
	jsonBuffers.Put(buf)
}

// retryAfterSeconds is the Retry-After sent with 503 when a stage has no
// replica: replicas join within seconds, and a client should not hammer.
const retryAfterSeconds = "1"

// fromBackend maps an error of the head to the client's answer. Errors of
// the request's own context are mapped by the caller (the client is gone,
// or the per-request timeout fired). The message shown is the head's
// client message (orchestrator.Error.Message), never err.Error(), which is
// for the log and may name a replica's address.
func fromBackend(err error, requestID string) *apiError {
	var ae *apiError
	if errors.As(err, &ae) {
		return ae
	}
	msg := "internal error; the head's log has the details"
	var oe *orchestrator.Error
	if errors.As(err, &oe) {
		msg = oe.Message
	}
	var asleep *orchestrator.AsleepError
	switch {
	case errors.As(err, &asleep):
		// No Retry-After: nothing changes by itself while every replica sleeps.
		return &apiError{Status: http.StatusServiceUnavailable, Type: typeServer, Code: "stage_asleep",
			Message: msg + ": " + asleepHint(asleep)}
	case errors.Is(err, orchestrator.ErrNoReplica):
		return &apiError{Status: http.StatusServiceUnavailable, Type: typeServer, Code: "no_replica",
			Message: msg + "; retry shortly", RetryAfter: retryAfterSeconds}
	case errors.Is(err, orchestrator.ErrDeadlineUnmeetable):
		// Answered before the request runs: a retry after the load eases,
		// or with a longer target, may be served.
		return &apiError{Status: http.StatusTooManyRequests, Type: typeRateLimit, Code: "deadline_unmeetable",
			Message: msg, RetryAfter: retryAfterSeconds}
	case errors.Is(err, orchestrator.ErrDeadlineMissed):
		// Stopped at the target before any first output was written: shed,
		// as the load or the replica's pace did not allow the target.
		return &apiError{Status: http.StatusServiceUnavailable, Type: typeServer, Code: "deadline_missed",
			Message: msg, RetryAfter: retryAfterSeconds}
	case errors.Is(err, orchestrator.ErrConflict):
		return &apiError{Status: http.StatusConflict, Type: typeInvalidRequest, Code: "conflict", Message: msg}
	case errors.Is(err, orchestrator.ErrBadRequest):
		if e := partRefused(err, msg); e != nil {
			return e
		}
		code, param := "invalid_request", ""
		switch {
		case oe == nil:
		case oe.Reason == stagepb.ReasonContextLengthExceeded:
			code = "context_length_exceeded"
		case oe.Reason == stagepb.ReasonInvalidVoice:
			code, param = "invalid_value", "audio.voice"
		}
		return &apiError{Status: http.StatusBadRequest, Type: typeInvalidRequest, Code: code, Param: param, Message: msg}
	case errors.Is(err, orchestrator.ErrInputTooLarge):
		return &apiError{Status: http.StatusRequestEntityTooLarge, Type: typeInvalidRequest, Code: "request_too_large", Message: msg}
	case errors.Is(err, orchestrator.ErrUnknownReplica):
		return &apiError{Status: http.StatusNotFound, Type: typeNotFound, Code: "unknown_replica", Message: msg}
	case errors.Is(err, orchestrator.ErrStageFailed):
		return &apiError{Status: http.StatusBadGateway, Type: typeServer, Code: "stage_failed",
			Message: msg + " (request id " + requestID + ")"}
	case errors.Is(err, context.DeadlineExceeded):
		return &apiError{Status: http.StatusGatewayTimeout, Type: typeServer, Code: "timeout",
			Message: "the request did not finish within the head's request timeout"}
	default:
		return &apiError{Status: http.StatusInternalServerError, Type: typeServer, Code: "internal_error", Message: msg + " (request id " + requestID + ")"}
	}
}

// deadlineHeader carries a request's own targets (docs/api.md).
const deadlineHeader = "X-Troupe-Deadline"

// deadlineOf reads the request's X-Troupe-Deadline header, e.g.
// "ttft=500ms,ttfa=800ms,rtf=1"; absent: no targets of its own. A header
// that does not parse is a 400 invalid_deadline.
func deadlineOf(r *http.Request) (orchestrator.Targets, *apiError) {
	v := r.Header.Get(deadlineHeader)
	if v == "" {
		return orchestrator.Targets{}, nil
	}
	t, err := orchestrator.ParseTargets(v)
	if err != nil {
		return orchestrator.Targets{}, &apiError{Status: http.StatusBadRequest, Type: typeInvalidRequest, Code: "invalid_deadline",
			Message: "invalid " + deadlineHeader + " header: " + strings.TrimPrefix(err.Error(), "orchestrator: ") + ` (want e.g. "ttft=500ms,ttfa=800ms,rtf=1")`}
	}
	return t, nil
}

// asleepHint tells the client of a stage whose replicas all sleep how to
// wake one, through the admin route.
func asleepHint(e *orchestrator.AsleepError) string {
	ids := make([]string, len(e.Replicas))
	for i, id := range e.Replicas {
		ids[i] = strconv.FormatUint(uint64(id), 10)
	}
	noun := "replica"
	if len(ids) > 1 {
		noun = "replicas"
	}
	return fmt.Sprintf("every replica of it is asleep (%s %s); wake one with POST /v1/replicas/%d/%d/wake_up",
		noun, strings.Join(ids, ", "), e.Stage, e.Replicas[0])
}
