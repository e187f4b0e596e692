package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/realtime"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestHeadAPIOverTLS: with troupe certs' api.pem, troupe head
// --http-tls-cert serves the HTTP API over TLS: the official client,
// trusting ca.pem, gets a chat completion and a realtime session (wss);
// plain HTTP to the port and a client that does not trust the CA get
// nothing; half the flags are refused.
func TestHeadAPIOverTLS(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pki")
	require.NoError(t, runCerts(context.Background(), []string{"--out", dir}, os.Stdout))
	p := func(f string) string { return filepath.Join(dir, f) }
	assert.ErrorContains(t, runHead(context.Background(), []string{"--etcd-endpoints", "http://127.0.0.1:1", "--http-tls-cert", p("api.pem")}, os.Stdout),
		"--http-tls-cert and --http-tls-key go together")

	up := background(t, "up", runUp, "--http", "127.0.0.1:0", "--log-level", "error")
	etcd := up.wait(t, etcdRE)
	up.wait(t, regexp.MustCompile(`(Press Ctrl-C)`))
	h := background(t, "head", runHead, "--etcd-endpoints", etcd, "--http", "127.0.0.1:0", "--log-level", "error",
		"--http-tls-cert", p("api.pem"), "--http-tls-key", p("api-key.pem"))
	base := h.wait(t, regexp.MustCompile(`API on (https://\S+)\n`))

	ca, err := os.ReadFile(p("ca.pem"))
	require.NoError(t, err)
	pool := x509.NewCertPool()
	require.True(t, pool.AppendCertsFromPEM(ca))
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	require.Eventually(t, func() bool {
		resp, err := hc.Get(base + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, time.Minute, 20*time.Millisecond, "the head over TLS gets ready")

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	client := openai.NewClient(option.WithBaseURL(base+"/v1/"), option.WithAPIKey("unused"), option.WithHTTPClient(hc), option.WithMaxRetries(0))
	res, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "troupe-omni-sim",
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")}, MaxTokens: openai.Int(4)})
	require.NoError(t, err)
	assert.NotEmpty(t, res.Choices[0].Message.Content)

	conn, err := client.Realtime.Connect(ctx, realtime.RealtimeConnectionOptions{})
	require.NoError(t, err, "a realtime session over wss")
	defer conn.Abort()
	ev, err := conn.Recv(ctx)
	require.NoError(t, err)
	assert.Equal(t, "session.created", ev.Type)

	plain := &http.Client{Transport: &http.Transport{}, Timeout: 10 * time.Second}
	defer plain.CloseIdleConnections()
	if resp, err := plain.Get(strings.Replace(base, "https://", "http://", 1) + "/readyz"); err == nil {
		resp.Body.Close()
		assert.NotEqual(t, http.StatusOK, resp.StatusCode, "plain HTTP is not served on the TLS port")
	}
	untrusting := &http.Client{Transport: &http.Transport{}, Timeout: 10 * time.Second}
	defer untrusting.CloseIdleConnections()
	_, err = untrusting.Get(base + "/readyz")
	var unknown x509.UnknownAuthorityError
	assert.ErrorAs(t, err, &unknown, "the API's certificate is the cluster CA's")
}
