//go:build unix

package e2e

import (
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var (
	// The README's quick-start request: its URL path and its body.
	readmeCurlRE = regexp.MustCompile(`(?s)curl -s http://127\.0\.0\.1:8000(/v1/\S+) \\.*?-d '([^']*)'`)
	// The banner `troupe up` prints once it is ready (cmd/troupe/up.go).
	upAPIRE   = regexp.MustCompile(`^\s+API:\s+(http://\S+)/v1 `)
	upEtcdRE  = regexp.MustCompile(`^\s+etcd:\s+\S+ \(data dir (\S+), removed at exit\)$`)
	upTryRE   = regexp.MustCompile(`^\s+-d '([^']*)'$`)
	upReadyRE = regexp.MustCompile(`^Press Ctrl-C to stop\.$`)
)

// TestQuickStart follows the README's quick start as a new user would:
// `troupe up`, wait for the banner, send the README's curl request, then
// Ctrl-C. Everything must stop cleanly: exit 0, no process left, the
// temporary etcd data dir gone.
func TestQuickStart(t *testing.T) {
	requireBinary(t)
	ctx := testCtx(t)
	readme, err := os.ReadFile(filepath.Join("..", "..", "README.md"))
	require.NoError(t, err)
	curl := readmeCurlRE.FindSubmatch(readme)
	require.NotNil(t, curl, "the README's quick start has a curl request")
	path, body := string(curl[1]), string(curl[2])

	// Its own TMPDIR, so the temporary data dir can be looked for after.
	tmp := t.TempDir()
	addr := "127.0.0.1:" + freePort(t)
	up := startProc(t, "up", []string{"TMPDIR=" + tmp}, "up", "--http", addr)
	up.waitLine(t, up.stdout, upReadyRE)
	base := up.waitLine(t, up.stdout, upAPIRE)[1]
	require.Equal(t, "http://"+addr, base, "the banner shows the API address")
	dataDir := up.waitLine(t, up.stdout, upEtcdRE)[1]
	require.DirExists(t, dataDir)
	require.True(t, strings.HasPrefix(dataDir, tmp+string(filepath.Separator)), "data dir %s in TMPDIR %s", dataDir, tmp)
	assert.Equal(t, body, up.waitLine(t, up.stdout, upTryRE)[1], "the banner suggests the README's request")

	client := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(client.CloseIdleConnections)
	res, err := postChat(ctx, client, base, []byte(body))
	require.NoError(t, err, "POST %s %s", path, body)
	require.Equal(t, "/v1/chat/completions", path)
	assert.Equal(t, "chat.completion", res.Object)
	assert.Equal(t, modelName, res.Model)
	assert.Equal(t, "assistant", res.Choices[0].Message.Role)
	assert.NotEmpty(t, res.Choices[0].Message.Content, "a completion")
	assert.Contains(t, []string{"stop", "length"}, res.Choices[0].FinishReason)
	assert.Positive(t, res.Usage.CompletionTokens)
	assert.LessOrEqual(t, res.Usage.CompletionTokens, 8, "max_tokens 8")
	client.CloseIdleConnections()

	up.signal(t, syscall.SIGINT)
	require.Equal(t, 0, up.exitCode(t, wait), "Ctrl-C is a clean exit")
	assert.Contains(t, up.stdout.String(), "troupe up: stopped")
	assert.True(t, up.groupGone(), "no process of troupe up is left")
	assert.NoDirExists(t, dataDir, "the temporary data dir is removed")
	left, err := filepath.Glob(filepath.Join(tmp, "troupe-up-*"))
	require.NoError(t, err)
	assert.Empty(t, left)
}
