//go:build unix

package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/realtime"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// haproxyConfig is deploy/haproxy/haproxy.cfg's balancing of two heads,
// on loopback: round robin, the server's name in X-Troupe-Head.
const haproxyConfig = `global
    maxconn 256
defaults
    mode http
    timeout connect 1s
    timeout client 1m
    timeout server 1m
    timeout tunnel 1m
frontend api
    bind 127.0.0.1:%s
    default_backend heads
backend heads
    balance roundrobin
    server head-a %s
    server head-b %s
    http-response set-header X-Troupe-Head %%[srv_name]
`

// startHAProxy runs haproxy in the foreground in front of heads a and b,
// and returns its base URL once it answers. The test skips without
// haproxy on PATH.
func startHAProxy(t *testing.T, ctx context.Context, a, b *head) string {
	t.Helper()
	bin, err := exec.LookPath("haproxy")
	if err != nil {
		t.Skip("haproxy is not on PATH")
	}
	port := freePort(t)
	cfg := filepath.Join(t.TempDir(), "haproxy.cfg")
	require.NoError(t, os.WriteFile(cfg, fmt.Appendf(nil, haproxyConfig, port,
		strings.TrimPrefix(a.base, "http://"), strings.TrimPrefix(b.base, "http://")), 0o600))
	cmd := exec.Command(bin, "-db", "-f", cfg)
	cmd.SysProcAttr = sysProcAttr()
	out := newLineLog()
	cmd.Stdout, cmd.Stderr = out, out
	require.NoError(t, cmd.Start())
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		select {
		case <-exited:
		case <-time.After(wait):
			t.Errorf("e2e: haproxy (pid %d) not reaped %s after SIGKILL", cmd.Process.Pid, wait)
		}
		if t.Failed() {
			t.Logf("--- haproxy\n%s", out.tail(40))
		}
	})
	base := "http://127.0.0.1:" + port
	eventually(ctx, t, "haproxy answers", func() (bool, string, error) {
		resp, err := http.Get(base + "/healthz")
		if err != nil {
			return false, err.Error(), nil
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, resp.Status, nil
	})
	return base
}

// completedTurns is each head's troupe_realtime_turns_total{status=completed}.
func completedTurns(ctx context.Context, t *testing.T, heads ...*head) []float64 {
	t.Helper()
	var out []float64
	for _, h := range heads {
		m, err := h.scrape(ctx)
		require.NoError(t, err)
		out = append(out, mustValue(t, m, "troupe_realtime_turns_total", map[string]string{"status": "completed"}))
	}
	return out
}

// TestRealtimeBehindHAProxy: with two heads behind HAProxy balancing round
// robin, a realtime session opened through the balancer stays on the head
// it opened across several turns (the WebSocket is one connection, which
// HAProxy tunnels to one server), while plain requests between the turns
// go to both heads; each turn sees the conversation before it. Proven
// with the official client and each head's /metrics.
func TestRealtimeBehindHAProxy(t *testing.T) {
	requireBinary(t)
	ctx := testCtx(t)
	etcd := startEtcd(t)
	pipeline := thinkerOnly(t)
	a := startHead(t, etcd, "--pipeline", pipeline, "--head-id", "head-a")
	b := startHead(t, etcd, "--pipeline", pipeline, "--head-id", "head-b")
	w := startWorker(t, etcd, "thinker")
	a.waitState(ctx, t, "thinker", w.replica, "attached")
	b.waitState(ctx, t, "thinker", w.replica, "attached")
	base := startHAProxy(t, ctx, a, b)

	client := openai.NewClient(option.WithBaseURL(base+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	conn, err := client.Realtime.Connect(ctx, realtime.RealtimeConnectionOptions{})
	require.NoError(t, err)
	t.Cleanup(conn.Abort)
	ev, err := conn.Recv(ctx)
	require.NoError(t, err)
	require.Equal(t, "session.created", ev.Type, "%s", ev.RawJSON())
	require.NoError(t, conn.Send(ctx, realtime.RealtimeClientEventParamOfSessionUpdate(realtime.RealtimeSessionCreateRequestParam{OutputModalities: []string{"text"}})))

	before := completedTurns(ctx, t, a, b)
	var home = -1 // the index of the session's head
	servedBy := map[string]bool{}
	history := []openai.ChatCompletionMessageParamUnion{}
	for i := range 3 {
		say := fmt.Sprintf("Turn %d, say something.", i)
		require.NoError(t, conn.Send(ctx, realtime.RealtimeClientEventParamOfConversationItemCreate(realtime.RealtimeConversationItemUserMessageParam{
			Content: []realtime.RealtimeConversationItemUserMessageContentParam{{Type: "input_text", Text: openai.String(say)}}})))
		require.NoError(t, conn.Send(ctx, realtime.RealtimeClientEventUnionParam{OfResponseCreate: &realtime.ResponseCreateEventParam{}}))
		var text strings.Builder
		for {
			ev, err := conn.Recv(ctx)
			require.NoError(t, err)
			require.NotEqual(t, "error", ev.Type, "%s", ev.RawJSON())
			if ev.Type == "response.output_text.delta" {
				text.WriteString(ev.AsResponseTextDeltaEvent().Delta)
			}
			if ev.Type == "response.done" {
				require.Equal(t, realtime.RealtimeResponseStatus("completed"), ev.AsResponseDoneEvent().Response.Status, "%s", ev.RawJSON())
				break
			}
		}
		history = append(history, openai.UserMessage(say))
		// The turn ran on one head, the same every turn.
		after := completedTurns(ctx, t, a, b)
		grew := -1
		for k := range after {
			switch after[k] - before[k] {
			case 0:
			case 1:
				require.Equal(t, -1, grew, "one head ran turn %d: %v → %v", i, before, after)
				grew = k
			default:
				t.Fatalf("turn %d: head %d counted %v turns", i, k, after[k]-before[k])
			}
		}
		require.NotEqual(t, -1, grew, "a head counted turn %d", i)
		if home == -1 {
			home = grew
		}
		assert.Equal(t, home, grew, "turn %d ran on the session's head", i)
		before = after

		// The turn answered what a chat request with the same
		// conversation answers; the chat requests through the balancer
		// go round robin, to both heads.
		for range 2 {
			var resp *http.Response
			res, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: modelName, Messages: history}, option.WithResponseInto(&resp))
			require.NoError(t, err)
			servedBy[resp.Header.Get("X-Troupe-Head")] = true
			assert.Equal(t, res.Choices[0].Message.Content, text.String(), "turn %d sees the conversation before it", i)
		}
		history = append(history, openai.AssistantMessage(text.String()))
	}
	assert.Equal(t, map[string]bool{"head-a": true, "head-b": true}, servedBy, "the balancer spreads plain requests")
	m, err := []*head{a, b}[home].scrape(ctx)
	require.NoError(t, err)
	assert.Equal(t, 1.0, mustValue(t, m, "troupe_realtime_sessions_active", nil), "the session is still open on its head")
}
