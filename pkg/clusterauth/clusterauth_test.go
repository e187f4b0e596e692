package clusterauth_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/pkg/clusterauth"
)

func TestLoad(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte(content), 0o600))
		return p
	}
	t.Setenv(clusterauth.EnvVar, "")
	tok, err := clusterauth.Load("")
	require.NoError(t, err)
	assert.Empty(t, tok, "neither set: no token")

	t.Setenv(clusterauth.EnvVar, " from-the-environment \n")
	tok, err = clusterauth.Load("")
	require.NoError(t, err)
	assert.Equal(t, "from-the-environment", tok)

	tok, err = clusterauth.Load(write("tok", "0123456789abcdef0123\n"))
	require.NoError(t, err)
	assert.Equal(t, "0123456789abcdef0123", tok, "the file wins over the environment")

	_, err = clusterauth.Load(write("short", "short"))
	assert.ErrorContains(t, err, "at least 16")
	_, err = clusterauth.Load(write("empty", "\n"))
	assert.ErrorContains(t, err, "is empty")
	_, err = clusterauth.Load(filepath.Join(dir, "missing"))
	assert.ErrorContains(t, err, "--cluster-token-file")
	_, err = clusterauth.ServerOptions("short")
	assert.Error(t, err)

	a, b := clusterauth.NewToken(), clusterauth.NewToken()
	assert.Len(t, a, 64)
	assert.NotEqual(t, a, b)
	md, err := clusterauth.Credentials(a).GetRequestMetadata(context.Background())
	require.NoError(t, err)
	assert.Equal(t, map[string]string{"authorization": "Bearer " + a}, md)
	assert.False(t, clusterauth.Credentials(a).RequireTransportSecurity())
}
