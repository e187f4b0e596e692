package main

import (
	"bytes"
	"errors"
	"net"
	"runtime/debug"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/troupe-serving/troupe/orchestrator"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestVersionText(t *testing.T) {
	bi := &debug.BuildInfo{
		GoVersion: "go1.26.8",
		Main:      debug.Module{Path: "github.com/troupe-serving/troupe", Version: "v0.3.1-0.20260102030405-0123456789ab+dirty"},
		Settings: []debug.BuildSetting{
			{Key: "vcs", Value: "git"},
			{Key: "vcs.revision", Value: "0123456789abcdef0123456789abcdef01234567"},
			{Key: "vcs.time", Value: "2026-01-02T03:04:05Z"},
			{Key: "vcs.modified", Value: "true"},
		},
	}
	assert.Equal(t, `troupe v0.3.1-0.20260102030405-0123456789ab+dirty
  module:   github.com/troupe-serving/troupe v0.3.1-0.20260102030405-0123456789ab+dirty
  revision: 0123456789abcdef0123456789abcdef01234567 (modified)
  time:     2026-01-02T03:04:05Z
  go:       go1.26.8
`, versionText(bi.Main.Version, bi))

	bi.Settings = nil
	out := versionText("v1.0.0", bi) // set by -ldflags -X main.version
	assert.True(t, strings.HasPrefix(out, "troupe v1.0.0\n"), out)
	assert.Contains(t, out, "revision: unknown (built without VCS information)")
}

// TestRunExitCodes: help is success, usage errors are 2, failures 1.
func TestRunExitCodes(t *testing.T) {
	var out, errOut bytes.Buffer
	for _, name := range []string{"up", "etcd", "head", "worker", "members", "healthcheck", "trace", "version", "help"} {
		out.Reset()
		require.Equal(t, 0, run([]string{name, "--help"}, &out, &errOut), name)
		assert.True(t, strings.HasPrefix(out.String(), "usage: troupe "+name), out.String())
	}
	out.Reset()
	require.Equal(t, 0, run([]string{"help", "healthcheck"}, &out, &errOut))
	assert.True(t, strings.HasPrefix(out.String(), "usage: troupe healthcheck [flags] URL|grpc://HOST:PORT[/SERVICE]\n"), out.String())

	assert.Equal(t, 2, run([]string{"up", "extra"}, &out, &errOut), "a stray argument is refused before anything starts")
	assert.Equal(t, 2, run([]string{"version", "extra"}, &out, &errOut))
	assert.Equal(t, 2, run([]string{"up", "--no-such-flag"}, &out, &errOut))

	errOut.Reset()
	assert.Equal(t, 1, run([]string{"healthcheck", "--timeout", "2s", "http://127.0.0.1:1/"}, &out, &errOut))
	assert.True(t, strings.HasPrefix(errOut.String(), "troupe healthcheck: Get "), errOut.String())
}

func TestWithPrefix(t *testing.T) {
	assert.Equal(t, "worker: listen tcp x: in use", withPrefix("worker", errors.New("worker: listen tcp x: in use")))
	assert.Equal(t, "trace: jaeger: down", withPrefix("trace", errors.New("jaeger: down")))
	assert.Equal(t, "up: upstream: x", withPrefix("up", errors.New("upstream: x")), "a longer word is another package")
}

func TestBanner(t *testing.T) {
	var out bytes.Buffer
	printBanner(&out, banner{
		pipeline: orchestrator.DefaultPipeline(), api: "http://127.0.0.1:8000", admin: "http://127.0.0.1:8001",
		etcdURLs: []string{"http://127.0.0.1:2379"}, cluster: "c1", dataDir: "/tmp/d", temporary: true, auth: true, self: "troupe",
	})
	s := out.String()
	assert.Contains(t, s, "  API:      http://127.0.0.1:8000/v1 (the base URL for OpenAI clients)\n")
	assert.Contains(t, s, "  replicas: http://127.0.0.1:8001/v1/replicas (admin listener) (with the API key) (?watch=true follows them)\n")
	assert.Contains(t, s, "  metrics:  http://127.0.0.1:8001/metrics (admin listener)\n")
	assert.Contains(t, s, "\n  troupe members --etcd-endpoints http://127.0.0.1:2379 --cluster c1\n")
	assert.Contains(t, s, "  curl -s http://127.0.0.1:8000/v1/chat/completions \\\n    -H \"Authorization: Bearer $TROUPE_API_KEY\" \\\n    -H 'Content-Type: application/json' \\\n")

	for addr, want := range map[string]string{"0.0.0.0:8000": "http://127.0.0.1:8000", "[::]:8000": "http://[::1]:8000", "10.0.0.2:80": "http://10.0.0.2:80"} {
		a, err := net.ResolveTCPAddr("tcp", addr)
		require.NoError(t, err)
		assert.Equal(t, want, baseURL(a))
	}
}
