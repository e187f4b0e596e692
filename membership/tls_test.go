package membership_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"

	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/membership/embedetcd"
	"github.com/troupe-serving/troupe/membership/membershiptest"
	"github.com/troupe-serving/troupe/pkg/tlsconfig/tlsconfigtest"
)

// TestDialMutualTLS: a TLS etcd with client certificate auth admits a
// client whose certificate chains to its CA, and refuses one without a
// certificate or with one from another CA, within the dial bound.
func TestDialMutualTLS(t *testing.T) {
	ca := tlsconfigtest.NewCA(t, "etcd-ca")
	server := ca.Issue(t, "etcd")
	client := ca.Issue(t, "head")
	stranger := tlsconfigtest.NewCA(t, "other-ca").Issue(t, "intruder")

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	srv, err := embedetcd.Start(ctx, embedetcd.Config{
		DataDir:          t.TempDir(),
		ListenClientURLs: []string{"https://127.0.0.1:0"},
		ListenPeerURLs:   []string{"http://127.0.0.1:0"},
		ClientCertFile:   server.Cert,
		ClientKeyFile:    server.Key,
		ClientCAFile:     server.CA,
		UnsafeNoFsync:    true,
		Logger:           zap.NewNop(),
	})
	require.NoError(t, err)
	defer srv.Close()

	cfg := membership.ClientConfig{Endpoints: srv.ClientURLs(), CACert: client.CA, Cert: client.Cert, Key: client.Key, DialTimeout: 10 * time.Second}
	cli, err := membership.Dial(ctx, cfg)
	require.NoError(t, err)
	_, err = cli.Put(ctx, membership.KeyRoot+"tls-check", "ok")
	require.NoError(t, err)
	require.NoError(t, cli.Close())

	for name, bad := range map[string]membership.ClientConfig{
		"no client certificate":       {Endpoints: srv.ClientURLs(), CACert: client.CA},
		"certificate from another CA": {Endpoints: srv.ClientURLs(), CACert: client.CA, Cert: stranger.Cert, Key: stranger.Key},
	} {
		bad.DialTimeout = 2 * time.Second
		cli, err := membership.Dial(ctx, bad)
		if cli != nil {
			cli.Close()
		}
		assert.Error(t, err, name)
	}
}

func TestEmbedTLSConfigErrors(t *testing.T) {
	ca := tlsconfigtest.NewCA(t, "ca")
	f := ca.Issue(t, "etcd")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for name, tc := range map[string]struct {
		cfg  embedetcd.Config
		want string
	}{
		"https without cert": {embedetcd.Config{ListenClientURLs: []string{"https://127.0.0.1:0"}}, "need a certificate and key"},
		"cert on http":       {embedetcd.Config{ListenClientURLs: []string{"http://127.0.0.1:0"}, ClientCertFile: f.Cert, ClientKeyFile: f.Key}, "needs https://"},
		"cert without key":   {embedetcd.Config{ListenClientURLs: []string{"https://127.0.0.1:0"}, ClientCertFile: f.Cert}, "both a certificate and a key"},
		"CA alone":           {embedetcd.Config{ListenClientURLs: []string{"https://127.0.0.1:0"}, ClientCAFile: f.CA}, "needs a server certificate"},
	} {
		tc.cfg.DataDir = t.TempDir()
		tc.cfg.ListenPeerURLs = []string{"http://127.0.0.1:0"}
		srv, err := embedetcd.Start(ctx, tc.cfg)
		if srv != nil {
			srv.Close()
		}
		require.Error(t, err, name)
		assert.Contains(t, err.Error(), tc.want, name)
	}
}

// TestDialWithAuth: with etcd auth on, the user and password (separately,
// or as "user:password" as etcdctl accepts) get in; a wrong password is
// refused with a clear error.
func TestDialWithAuth(t *testing.T) {
	e := membershiptest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	admin := e.Client(t)
	_, err := admin.UserAdd(ctx, "root", "s3cret")
	require.NoError(t, err)
	_, err = admin.UserGrantRole(ctx, "root", "root")
	require.NoError(t, err)
	_, err = admin.AuthEnable(ctx)
	require.NoError(t, err)

	for name, cfg := range map[string]membership.ClientConfig{
		"separate":      {Username: "root", Password: "s3cret"},
		"user:password": {Username: "root:s3cret"},
	} {
		cfg.Endpoints = e.Endpoints()
		cli, err := membership.Dial(ctx, cfg)
		require.NoError(t, err, name)
		_, err = cli.Put(ctx, membership.KeyRoot+"auth-check", name)
		assert.NoError(t, err, name)
		require.NoError(t, cli.Close())
	}

	cli, err := membership.Dial(ctx, membership.ClientConfig{Endpoints: e.Endpoints(), Username: "root", Password: "wrong", DialTimeout: 15 * time.Second})
	if cli != nil {
		cli.Close()
	}
	require.Error(t, err)
	assert.Contains(t, err.Error(), "membership:")
	assert.Contains(t, err.Error(), "authentication failed")
}
