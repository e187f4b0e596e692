package jaeger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
)

// ErrTraceNotFound is returned by FetchTrace when Jaeger does not
// know the trace (HTTP 404).
var ErrTraceNotFound = errors.New("jaeger: trace not found")

// maxTraceBytes bounds the answer read from Jaeger.
const maxTraceBytes = 64 << 20

// ParseTraceID accepts a trace id as 1 to 32 hex digits (Jaeger pads short
// ids with leading zeros) or a whole traceparent header value
// ("00-<trace-id>-<span-id>-<flags>", as troupe's responses carry), and
// returns it as 32 lowercase hex digits. The all-zero id is invalid.
func ParseTraceID(s string) (string, error) {
	s = strings.TrimSpace(s)
	if parts := strings.Split(s, "-"); len(parts) == 4 {
		if len(parts[1]) != 32 {
			return "", fmt.Errorf("jaeger: traceparent %q: the trace id must have 32 hex digits", s)
		}
		s = parts[1]
	}
	if s == "" || len(s) > 32 {
		return "", fmt.Errorf("jaeger: trace id %q: want 1 to 32 hex digits", s)
	}
	for _, c := range s {
		if !strings.ContainsRune("0123456789abcdefABCDEF", c) {
			return "", fmt.Errorf("jaeger: trace id %q: %q is not a hex digit", s, c)
		}
	}
	id := strings.Repeat("0", 32-len(s)) + strings.ToLower(s)
	if strings.Trim(id, "0") == "" {
		return "", fmt.Errorf("jaeger: trace id %q is all zeros", s)
	}
	return id, nil
}

// TraceURL is the api_v3 URL of trace id (already parsed) under the
// Jaeger query base URL (for example http://localhost:16686, or one with
// the query service's base path).
func TraceURL(base, id string) (string, error) {
	u, err := url.Parse(strings.TrimSpace(base))
	if err != nil {
		return "", fmt.Errorf("jaeger: URL %q: %w", base, err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return "", fmt.Errorf("jaeger: URL %q: want http(s)://host:port", base)
	}
	u.Path = strings.TrimRight(u.Path, "/") + "/api/v3/traces/" + id
	u.RawPath, u.RawQuery, u.Fragment = "", "", ""
	return u.String(), nil
}

// FetchTrace gets trace id from the Jaeger query service at base
// through GET /api/v3/traces/{id} (Jaeger v2; the answer is OTLP JSON) and
// parses it. A trace Jaeger does not hold gives an error wrapping
// ErrTraceNotFound. client nil means http.DefaultClient; ctx bounds the call.
func FetchTrace(ctx context.Context, client *http.Client, base, id string) (*Trace, error) {
	if client == nil {
		client = http.DefaultClient
	}
	id, err := ParseTraceID(id)
	if err != nil {
		return nil, err
	}
	target, err := TraceURL(base, id)
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
	if err != nil {
		return nil, fmt.Errorf("jaeger: %w", err)
	}
	req.Header.Set("Accept", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("jaeger: query: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxTraceBytes+1))
	if err != nil {
		return nil, fmt.Errorf("jaeger: read the answer: %w", err)
	}
	if len(body) > maxTraceBytes {
		return nil, fmt.Errorf("jaeger: the answer exceeds %d MiB", maxTraceBytes>>20)
	}
	switch {
	case resp.StatusCode == http.StatusNotFound:
		return nil, fmt.Errorf("%w: %s", ErrTraceNotFound, id)
	case resp.StatusCode < 200 || resp.StatusCode > 299:
		return nil, fmt.Errorf("jaeger: answered %s: %s", resp.Status, jaegerErrorMessage(body))
	}
	return ParseOTLPJSON(body)
}

// jaegerErrorMessage extracts the message of api_v3's error JSON
// ({"error":{"httpCode":400,"message":"..."}}), or a prefix of the body.
func jaegerErrorMessage(body []byte) string {
	var e struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	if json.Unmarshal(body, &e) == nil && e.Error.Message != "" {
		return e.Error.Message
	}
	msg := strings.TrimSpace(string(body))
	if len(msg) > 200 {
		msg = msg[:200] + "..."
	}
	return msg
}
