package main

import (
	"context"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/tlsconfig"
)

// TestCertsThenSecuredCluster: `troupe certs` writes what a head and a
// worker need for mutual TLS plus the cluster token; a head and a worker
// started with them serve a request, and a caller with the CA's trust but
// neither a client certificate nor the token is refused.
func TestCertsThenSecuredCluster(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pki")
	require.NoError(t, runCerts(context.Background(), []string{"--out", dir}, os.Stdout))
	for _, f := range []string{"ca.pem", "ca-key.pem", "head.pem", "head-key.pem", "worker.pem", "worker-key.pem", "api.pem", "api-key.pem", "cluster-token"} {
		st, err := os.Stat(filepath.Join(dir, f))
		require.NoError(t, err, f)
		if f == "cluster-token" || filepath.Ext(f) == ".pem" && len(f) > 8 && f[len(f)-8:] == "-key.pem" {
			assert.Equal(t, os.FileMode(0o600), st.Mode().Perm(), f)
		}
	}
	before, err := os.ReadFile(filepath.Join(dir, "cluster-token"))
	require.NoError(t, err)
	require.NoError(t, runCerts(context.Background(), []string{"--out", dir}, os.Stdout))
	after, err := os.ReadFile(filepath.Join(dir, "cluster-token"))
	require.NoError(t, err)
	assert.Equal(t, before, after, "a second run keeps what exists")

	a := background(t, "up", runUp, "--http", "127.0.0.1:0", "--log-level", "error")
	etcd := a.wait(t, etcdRE)
	a.wait(t, regexp.MustCompile(`(Press Ctrl-C)`))
	pipeline := filepath.Join(t.TempDir(), "pipeline.yaml")
	require.NoError(t, os.WriteFile(pipeline, []byte("model: troupe-omni-sim\nstages:\n  - name: thinker\n"), 0o600))
	p := func(f string) string { return filepath.Join(dir, f) }
	b := background(t, "head", runHead, "--etcd-endpoints", etcd, "--cluster", "sec", "--pipeline", pipeline, "--http", "127.0.0.1:0", "--log-level", "error",
		"--tls-ca", p("ca.pem"), "--tls-cert", p("head.pem"), "--tls-key", p("head-key.pem"), "--cluster-token-file", p("cluster-token"))
	base := b.wait(t, headRE)
	w := background(t, "worker", runWorker, "--etcd-endpoints", etcd, "--cluster", "sec", "--stage", "thinker", "--log-level", "error",
		"--tls-ca", p("ca.pem"), "--tls-cert", p("worker.pem"), "--tls-key", p("worker-key.pem"), "--cluster-token-file", p("cluster-token"))
	line := w.wait(t, workRE)
	addr := regexp.MustCompile(`addr (\S+)`).FindStringSubmatch(line)[1]

	probe := &http.Client{Transport: &http.Transport{}, Timeout: 5 * time.Second}
	defer probe.CloseIdleConnections()
	require.Eventually(t, func() bool {
		resp, err := probe.Get(base + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, 60*time.Second, 20*time.Millisecond)
	got := chat(t, base, `{"model":"troupe-omni-sim","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`)
	assert.NotEmpty(t, got.Choices[0].Message.Content)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	creds, err := tlsconfig.ClientCredentials(tlsconfig.Files{CA: p("ca.pem")})
	require.NoError(t, err)
	for _, c := range []grpc.DialOption{grpc.WithTransportCredentials(creds), grpc.WithTransportCredentials(insecure.NewCredentials())} {
		conn, err := grpc.NewClient(addr, c)
		require.NoError(t, err)
		_, err = stagepb.NewStageServiceClient(conn).Drain(ctx, &stagepb.DrainRequest{})
		assert.Error(t, err)
		assert.NotEqual(t, codes.OK, status.Code(err))
		conn.Close()
	}
}
