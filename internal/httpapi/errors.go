package httpapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	"github.com/troupe-serving/troupe/orchestrator"
)

// OpenAI error types. The status code is what clients branch on; the type
// and code refine it for humans and for logs.
const (
	typeInvalidRequest = "invalid_request_error"
	typeAuthentication = "authentication_error"
	typeNotFound       = "not_found_error"
	typeServer         = "server_error"
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
	body, err := json.Marshal(v)
	if err != nil {
		// Only our own response types reach here; they always marshal.
		status = http.StatusInternalServerError
		body = []byte(`{"error":{"message":"internal error: cannot encode response","type":"server_error","param":null,"code":"internal_error"}}`)
	}
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Del("Content-Length")
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}

// retryAfterSeconds is the Retry-After sent with 503 when a stage has no
// replica: replicas join within seconds, and a client should not hammer.
const retryAfterSeconds = "1"

// fromBackend maps an error of the head to the client's answer. Errors of
// the request's own context are mapped by the caller (the client is gone,
// or the per-request timeout fired).
func fromBackend(err error) *apiError {
	var ae *apiError
	switch {
	case errors.As(err, &ae):
		return ae
	case errors.Is(err, orchestrator.ErrNoReplica):
		return &apiError{Status: http.StatusServiceUnavailable, Type: typeServer, Code: "no_replica",
			Message: err.Error(), RetryAfter: retryAfterSeconds}
	case errors.Is(err, orchestrator.ErrBadRequest):
		return &apiError{Status: http.StatusBadRequest, Type: typeInvalidRequest, Code: "invalid_request", Message: err.Error()}
	case errors.Is(err, orchestrator.ErrUnknownReplica):
		return &apiError{Status: http.StatusNotFound, Type: typeNotFound, Code: "unknown_replica", Message: err.Error()}
	case errors.Is(err, orchestrator.ErrStageFailed):
		return &apiError{Status: http.StatusBadGateway, Type: typeServer, Code: "stage_failed", Message: err.Error()}
	case errors.Is(err, context.DeadlineExceeded):
		return &apiError{Status: http.StatusGatewayTimeout, Type: typeServer, Code: "timeout", Message: "the request did not finish in time: " + err.Error()}
	default:
		return &apiError{Status: http.StatusInternalServerError, Type: typeServer, Code: "internal_error", Message: err.Error()}
	}
}
