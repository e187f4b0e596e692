package jaeger

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParseTraceID(t *testing.T) {
	good := map[string]string{
		"4bf92f3577b34da6a3ce929d0e0e4736": "4bf92f3577b34da6a3ce929d0e0e4736",
		"4BF92F3577B34DA6A3CE929D0E0E4736": "4bf92f3577b34da6a3ce929d0e0e4736",
		"a3ce929d0e0e4736":                 "0000000000000000a3ce929d0e0e4736",
		" 1 ":                              "00000000000000000000000000000001",
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01": "4bf92f3577b34da6a3ce929d0e0e4736",
	}
	for in, want := range good {
		got, err := ParseTraceID(in)
		require.NoError(t, err, in)
		assert.Equal(t, want, got, in)
	}
	for _, in := range []string{
		"", "xyz", "4bf92f3577b34da6a3ce929d0e0e47361", "00000000000000000000000000000000",
		"00-4bf92f35-00f067aa0ba902b7-01", "4bf92f35-77b3-4da6-a3ce-929d0e0e4736", "../../etc",
	} {
		_, err := ParseTraceID(in)
		assert.Error(t, err, "%q must be rejected", in)
	}
}

func TestTraceURL(t *testing.T) {
	id := "4bf92f3577b34da6a3ce929d0e0e4736"
	for base, want := range map[string]string{
		"http://localhost:16686":          "http://localhost:16686/api/v3/traces/" + id,
		"http://localhost:16686/":         "http://localhost:16686/api/v3/traces/" + id,
		"https://ops.example/jaeger/?x=1": "https://ops.example/jaeger/api/v3/traces/" + id,
	} {
		got, err := TraceURL(base, id)
		require.NoError(t, err, base)
		assert.Equal(t, want, got)
	}
	for _, base := range []string{"localhost:16686", "ftp://h/", "http://", "::"} {
		_, err := TraceURL(base, id)
		assert.Error(t, err, base)
	}
}

// fakeJaeger answers api_v3 trace requests like Jaeger: the recorded trace
// for its id, 404 with api_v3's error JSON for others.
func fakeJaeger(t *testing.T, body []byte, id string) (*httptest.Server, *[]string) {
	t.Helper()
	var (
		mu    sync.Mutex
		paths []string
	)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		paths = append(paths, r.URL.Path)
		mu.Unlock()
		switch {
		case r.URL.Path == "/api/v3/traces/"+id:
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write(body)
		case strings.HasPrefix(r.URL.Path, "/api/v3/traces/"):
			http.Error(w, `{"error":{"httpCode":404,"message":"trace not found"}}`, http.StatusNotFound)
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(srv.Close)
	return srv, &paths
}

func TestFetchTrace(t *testing.T) {
	body := readFixture(t)
	srv, paths := fakeJaeger(t, body, fixtureTraceID)
	ctx := context.Background()

	tr, err := FetchTrace(ctx, srv.Client(), srv.URL, fixtureTraceID)
	require.NoError(t, err)
	assert.Equal(t, fixtureTraceID, tr.TraceID)
	assert.Len(t, tr.Spans, 16)

	// A traceparent works as the id; so does an upper-case id.
	_, err = FetchTrace(ctx, srv.Client(), srv.URL+"/", "00-"+strings.ToUpper(fixtureTraceID)+"-00f067aa0ba902b7-01")
	require.NoError(t, err)

	_, err = FetchTrace(ctx, srv.Client(), srv.URL, "0123456789abcdef0123456789abcdef")
	require.ErrorIs(t, err, ErrTraceNotFound)

	_, err = FetchTrace(ctx, srv.Client(), srv.URL, "not-hex")
	require.Error(t, err)
	assert.NotErrorIs(t, err, ErrTraceNotFound)

	assert.Equal(t, []string{
		"/api/v3/traces/" + fixtureTraceID,
		"/api/v3/traces/" + fixtureTraceID,
		"/api/v3/traces/0123456789abcdef0123456789abcdef",
	}, *paths, "a malformed id never reaches Jaeger")
}

func TestFetchTraceServerError(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, `{"error":{"httpCode":500,"message":"storage unavailable"}}`, http.StatusInternalServerError)
	}))
	defer srv.Close()
	_, err := FetchTrace(context.Background(), srv.Client(), srv.URL, fixtureTraceID)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "500 Internal Server Error: storage unavailable")

	// Nobody listening: a connection error, not "not found".
	url := srv.URL
	srv.Close()
	_, err = FetchTrace(context.Background(), nil, url, fixtureTraceID)
	require.Error(t, err)
	assert.NotErrorIs(t, err, ErrTraceNotFound)
}
