//go:build unix

package e2e

import (
	"bytes"
	"debug/buildinfo"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"os/exec"
	"regexp"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// runTroupe runs the binary to its end (bounded by the test's context) and
// returns what it printed and its exit status.
func runTroupe(t *testing.T, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	requireBinary(t)
	cmd := exec.CommandContext(testCtx(t), troupeBin, args...)
	cmd.Env = cleanEnv()
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &exit):
		code = exit.ExitCode()
	default:
		t.Fatalf("e2e: run troupe %v: %v", args, err)
	}
	return out.String(), errOut.String(), code
}

// TestCLIHelp: every command's --help (and `troupe help CMD`) exits 0 and
// shows its positional arguments; a stray argument is refused, not
// ignored.
func TestCLIHelp(t *testing.T) {
	requireBinary(t)
	commands := map[string]string{ // command → its synopsis
		"up": "troupe up [flags]", "etcd": "troupe etcd [flags]", "head": "troupe head [flags]",
		"worker": "troupe worker [flags]", "members": "troupe members [flags]",
		"healthcheck": "troupe healthcheck [flags] URL|grpc://HOST:PORT[/SERVICE]",
		"trace":       "troupe trace [flags] TRACE_ID", "version": "troupe version",
		"help": "troupe help [COMMAND]",
	}
	for name, synopsis := range commands {
		for _, args := range [][]string{{name, "--help"}, {name, "-h"}, {"help", name}} {
			stdout, stderr, code := runTroupe(t, args...)
			assert.Equal(t, 0, code, "troupe %v: %s", args, stderr)
			assert.True(t, strings.HasPrefix(stdout, "usage: "+synopsis+"\n"), "troupe %v printed:\n%s", args, stdout)
		}
	}
	stdout, _, code := runTroupe(t, "help", "worker")
	require.Equal(t, 0, code)
	assert.Contains(t, stdout, "-max-message-bytes", "the flags are listed")
	assert.Contains(t, stdout, "TROUPE_<FLAG>")

	for _, args := range [][]string{{}, {"--help"}, {"help"}} {
		stdout, stderr, code := runTroupe(t, args...)
		want := 0
		if len(args) == 0 {
			want, stdout = 2, stderr // no command is a usage error
		}
		assert.Equal(t, want, code, "troupe %v", args)
		assert.Contains(t, stdout, "usage: troupe <command>", "troupe %v", args)
	}
	_, stderr, code := runTroupe(t, "help", "frobnicate")
	assert.Equal(t, 2, code)
	assert.Contains(t, stderr, `unknown command "frobnicate"`)

	// Stray arguments: refused at once (up would otherwise start a server).
	for _, args := range [][]string{{"up", "extra"}, {"head", "extra"}, {"worker", "--stage", "thinker", "extra"},
		{"etcd", "--data-dir", t.TempDir(), "extra"}, {"members", "extra"}, {"version", "extra"},
		{"healthcheck", "http://127.0.0.1:1/", "extra"}, {"trace", "abc", "def"}, {"help", "up", "head"}} {
		stdout, stderr, code := runTroupe(t, args...)
		assert.Equal(t, 2, code, "troupe %v: %s%s", args, stdout, stderr)
		assert.NotContains(t, stdout, "troupe is up", "troupe %v", args)
	}
	assert.Equal(t, "trace", doubledPrefix("troupe trace: trace: telemetry: x"), "the check itself")
	_, stderr, _ = runTroupe(t, "up", "extra")
	assert.Contains(t, stderr, `unexpected arguments ["extra"]`)
}

// TestCLIVersion: `troupe version` reports the module version and the
// VCS revision that go build stamped into the binary (as the binary's own
// build info holds them: a build with -buildvcs=false, or from a git
// worktree, has no revision, and says so).
func TestCLIVersion(t *testing.T) {
	stdout, stderr, code := runTroupe(t, "version")
	require.Equal(t, 0, code, stderr)
	bi, err := buildinfo.ReadFile(troupeBin)
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(stdout), "\n")
	assert.Equal(t, "troupe "+bi.Main.Version, lines[0])
	assert.Contains(t, lines, "  module:   github.com/troupe-serving/troupe "+bi.Main.Version)
	assert.Contains(t, lines, "  go:       "+bi.GoVersion)
	revision := "  revision: unknown (built without VCS information)"
	for _, s := range bi.Settings {
		if s.Key == "vcs.revision" {
			revision = "  revision: " + s.Value
		}
	}
	assert.Equal(t, revision, strings.TrimSuffix(lines[2], " (modified)"))
	t.Logf("troupe version:\n%s", stdout)

	again, _, _ := runTroupe(t, "--version")
	assert.Equal(t, stdout, again)
}

// prefixRE finds the words that prefix an error ("trace: ").
var prefixRE = regexp.MustCompile(`\b([a-z]+): `)

// doubledPrefix returns a prefix said twice in a row ("trace: trace:",
// "listen: listen tcp"), or "".
func doubledPrefix(s string) string {
	for _, m := range prefixRE.FindAllStringSubmatchIndex(s, -1) {
		word, rest := s[m[2]:m[3]], s[m[1]:]
		if strings.HasPrefix(rest, word+":") || strings.HasPrefix(rest, word+" ") {
			return word
		}
	}
	return ""
}

// TestCLIErrorPrefixes: a failing command names itself once, then the
// package that failed, never the same word twice.
func TestCLIErrorPrefixes(t *testing.T) {
	requireBinary(t)
	etcd := startEtcd(t)
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer busy.Close()
	dead := deadAddr(t)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"trace", "0123456789abcdef0123456789abcdef", "--jaeger", "http://" + dead, "--timeout", "5s"}, "troupe trace: jaeger: query: "},
		{[]string{"healthcheck", "http://" + dead + "/"}, "troupe healthcheck: Get "},
		{[]string{"healthcheck", "grpc://" + dead}, "troupe healthcheck: grpc://"},
		{[]string{"members", "--etcd-endpoints", "http://" + dead, "--etcd-dial-timeout", "1s"}, "troupe members: membership: "},
		{[]string{"worker", "--etcd-endpoints", etcd, "--stage", "thinker", "--listen", busy.Addr().String()}, "troupe worker: listen tcp " + busy.Addr().String()},
		{[]string{"head", "--etcd-endpoints", etcd, "--http", busy.Addr().String()}, "troupe head: listen tcp " + busy.Addr().String()},
	} {
		_, stderr, code := runTroupe(t, tc.args...)
		assert.Equal(t, 1, code, "troupe %v: %s", tc.args, stderr)
		assert.Contains(t, stderr, tc.want, "troupe %v", tc.args)
		assert.Empty(t, doubledPrefix(stderr), "troupe %v: %s", tc.args, stderr)
	}
}

// TestUpPortConflict: `troupe up` on a port in use fails with the
// listener's error and does not claim to have stopped what never ran.
func TestUpPortConflict(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer busy.Close()
	stdout, stderr, code := runTroupe(t, "up", "--http", busy.Addr().String())
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "troupe up: listen tcp "+busy.Addr().String()+": bind: address already in use")
	assert.NotContains(t, stdout, "stopped")
	assert.NotContains(t, stdout, "troupe is up")
}

var (
	upReplicasRE = regexp.MustCompile(`^\s+replicas:\s+(http://\S+)`)
	upMetricsRE  = regexp.MustCompile(`^\s+metrics:\s+(http://\S+)`)
	upMembersRE  = regexp.MustCompile(`^\s+(\S+ members --etcd-endpoints .*)$`)
)

// TestUpBannerIsTrue: whatever the flags, every URL the banner of `troupe
// up` prints answers 200, and its `troupe members` line, pasted, lists the
// replicas it started.
func TestUpBannerIsTrue(t *testing.T) {
	requireBinary(t)
	for _, tc := range []struct {
		name string
		args []string
		key  string
	}{
		{"admin listener, key, cluster", []string{"--http", "127.0.0.1:0", "--admin-http", "127.0.0.1:0", "--api-key", "k", "--cluster", "c1"}, "k"},
		{"all interfaces", []string{"--http", "0.0.0.0:0", "--replicas", "2"}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			up := startProc(t, "up", nil, append([]string{"up", "--log-level", "warn"}, tc.args...)...)
			up.waitLine(t, up.stdout, upReadyRE)
			api := up.waitLine(t, up.stdout, upAPIRE)[1]
			replicas := up.waitLine(t, up.stdout, upReplicasRE)[1]
			metrics := up.waitLine(t, up.stdout, upMetricsRE)[1]
			members := up.waitLine(t, up.stdout, upMembersRE)[1]

			get := func(url string) int {
				req, err := http.NewRequestWithContext(testCtx(t), http.MethodGet, url, nil)
				require.NoError(t, err)
				if tc.key != "" {
					req.Header.Set("Authorization", "Bearer "+tc.key)
				}
				resp, err := http.DefaultClient.Do(req)
				require.NoError(t, err, url)
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				return resp.StatusCode
			}
			for _, url := range []string{api + "/v1/models", replicas, metrics} {
				assert.Equal(t, http.StatusOK, get(url), url)
			}
			assert.NotContains(t, api, "0.0.0.0", "a URL a client can dial")

			// Pasted as printed: the binary was started by its path, so
			// the line names it.
			fields := strings.Fields(members)
			require.Equal(t, troupeBin, fields[0])
			out, err := exec.CommandContext(testCtx(t), fields[0], fields[1:]...).CombinedOutput()
			require.NoError(t, err, "%s: %s", members, out)
			for _, stage := range []string{"thinker", "talker", "vocoder"} {
				assert.Contains(t, string(out), stage, "%s lists the replicas", members)
			}

			up.signal(t, syscall.SIGINT)
			require.Equal(t, 0, up.exitCode(t, wait))
			assert.Contains(t, up.stdout.String(), "troupe up: stopped")
		})
	}
}

// TestUpLargePrompt: `troupe up --max-body-bytes` sets the gRPC limits of
// its head and workers, so a prompt far above gRPC's 4 MiB default reaches
// the engine; one longer than the engine's context is a 400, not a 5xx.
func TestUpLargePrompt(t *testing.T) {
	requireBinary(t)
	up := startProc(t, "up", nil, "up", "--http", "127.0.0.1:0", "--pipeline", thinkerOnly(t), "--max-body-bytes", "24MiB", "--log-level", "warn")
	up.waitLine(t, up.stdout, upReadyRE)
	api := up.waitLine(t, up.stdout, upAPIRE)[1]
	post := func(prompt string) (int, string) {
		body, err := json.Marshal(map[string]any{"model": modelName, "prompt": prompt, "max_tokens": 2})
		require.NoError(t, err)
		req, err := http.NewRequestWithContext(testCtx(t), http.MethodPost, api+"/v1/completions", bytes.NewReader(body))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		answer, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, string(answer)
	}
	code, answer := post(strings.Repeat("x", 20<<20)) // one word: two tokens
	assert.Equal(t, http.StatusOK, code, "%.300s", answer)
	code, answer = post(strings.Repeat("a ", 3<<20))
	assert.Equal(t, http.StatusBadRequest, code, "%.300s", answer)
	assert.Contains(t, answer, `"code":"context_length_exceeded"`)
}
