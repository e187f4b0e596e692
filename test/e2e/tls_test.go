package e2e

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/pkg/tlsconfig/tlsconfigtest"
)

// TestMutualTLSBetweenHeadAndWorker: with --tls-cert/--tls-key/--tls-ca on
// both sides the head attaches the worker and serves through it; a head
// whose certificate comes from another CA is refused by the worker, so it
// never routes to it.
func TestMutualTLSBetweenHeadAndWorker(t *testing.T) {
	if testing.Short() {
		t.Skip("process test; skipped with -short")
	}
	ca := tlsconfigtest.NewCA(t, "troupe-ca")
	wf, hf := ca.Issue(t, "worker"), ca.Issue(t, "head")
	stranger := tlsconfigtest.NewCA(t, "other-ca").Issue(t, "intruder")
	tlsArgs := func(cert, key, caFile string) []string {
		return []string{"--tls-cert", cert, "--tls-key", key, "--tls-ca", caFile}
	}

	etcd := startEtcd(t)
	pipeline := thinkerOnly(t)
	good := startHead(t, etcd, append([]string{"--pipeline", pipeline}, tlsArgs(hf.Cert, hf.Key, hf.CA)...)...)
	// The intruder trusts our CA (so it would accept the worker) but shows a
	// certificate the worker does not trust.
	bad := startHead(t, etcd, append([]string{"--pipeline", pipeline}, tlsArgs(stranger.Cert, stranger.Key, hf.CA)...)...)
	w := startWorker(t, etcd, "thinker", tlsArgs(wf.Cert, wf.Key, wf.CA)...)

	ctx := testCtx(t)
	good.waitState(ctx, t, "thinker", w.replica, "attached")
	res, err := good.chat(ctx, userPrompt(modelName, "over mutual TLS", 4))
	require.NoError(t, err)
	assert.Equal(t, 4, res.Usage.CompletionTokens)

	row, ok, err := bad.replica(ctx, "thinker", w.replica)
	require.NoError(t, err)
	require.True(t, ok, "the intruder sees the member record in etcd")
	assert.Equal(t, "unhealthy", row.State, "but its probe is refused, so it never attaches")
	_, err = bad.chat(ctx, userPrompt(modelName, "let me in", 4))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "503")
}
