package tlsconfig_test

import (
	"crypto/tls"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/troupe-serving/troupe/pkg/tlsconfig"
	"github.com/troupe-serving/troupe/pkg/tlsconfig/tlsconfigtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// handshake runs one TLS exchange over loopback: the client sends a byte,
// the server echoes it. It returns the server's and the client's error.
func handshake(t *testing.T, server, client *tls.Config) (serverErr, clientErr error) {
	t.Helper()
	ln, err := tls.Listen("tcp", "127.0.0.1:0", server)
	require.NoError(t, err)
	defer ln.Close()
	done := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			done <- err
			return
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(20 * time.Second))
		if err := c.(*tls.Conn).Handshake(); err != nil {
			done <- err
			return
		}
		_, err = io.CopyN(c, c, 1)
		done <- err
	}()
	c, err := tls.Dial("tcp", ln.Addr().String(), client)
	if err == nil {
		_ = c.SetDeadline(time.Now().Add(20 * time.Second))
		if _, err = c.Write([]byte{'x'}); err == nil {
			_, err = io.ReadFull(c, make([]byte, 1))
		}
		c.Close()
	}
	return <-done, err
}

func TestMutualTLS(t *testing.T) {
	ca := tlsconfigtest.NewCA(t, "troupe-ca")
	srvFiles := ca.Issue(t, "worker")
	cliFiles := ca.Issue(t, "head")
	srv, err := tlsconfig.Server(srvFiles)
	require.NoError(t, err)
	require.Equal(t, tls.RequireAndVerifyClientCert, srv.ClientAuth)

	t.Run("same CA", func(t *testing.T) {
		cli, err := tlsconfig.Client(cliFiles)
		require.NoError(t, err)
		serr, cerr := handshake(t, srv, cli)
		require.NoError(t, serr)
		require.NoError(t, cerr)
	})
	t.Run("client cert from another CA is refused", func(t *testing.T) {
		rogue := tlsconfigtest.NewCA(t, "rogue-ca").Issue(t, "intruder")
		// It trusts the right CA for the server, but its own cert is foreign.
		cli, err := tlsconfig.Client(tlsconfig.Files{Cert: rogue.Cert, Key: rogue.Key, CA: cliFiles.CA})
		require.NoError(t, err)
		serr, cerr := handshake(t, srv, cli)
		require.Error(t, serr)
		assert.Contains(t, serr.Error(), "certificate")
		require.Error(t, cerr)
	})
	t.Run("client without a cert is refused", func(t *testing.T) {
		cli, err := tlsconfig.Client(tlsconfig.Files{CA: cliFiles.CA})
		require.NoError(t, err)
		serr, cerr := handshake(t, srv, cli)
		require.Error(t, serr)
		require.Error(t, cerr)
	})
	t.Run("server cert from another CA is refused", func(t *testing.T) {
		other := tlsconfigtest.NewCA(t, "other-ca").Issue(t, "head")
		cli, err := tlsconfig.Client(other)
		require.NoError(t, err)
		_, cerr := handshake(t, srv, cli)
		require.Error(t, cerr)
		assert.Contains(t, cerr.Error(), "certificate")
	})
}

func TestServerTLSWithoutClientAuth(t *testing.T) {
	ca := tlsconfigtest.NewCA(t, "ca")
	f := ca.Issue(t, "worker")
	srv, err := tlsconfig.Server(tlsconfig.Files{Cert: f.Cert, Key: f.Key})
	require.NoError(t, err)
	assert.Equal(t, tls.NoClientCert, srv.ClientAuth)
	cli, err := tlsconfig.Client(tlsconfig.Files{CA: f.CA})
	require.NoError(t, err)
	serr, cerr := handshake(t, srv, cli)
	require.NoError(t, serr)
	require.NoError(t, cerr)
}

func TestDisabledAndBadInput(t *testing.T) {
	var none tlsconfig.Files
	assert.False(t, none.Enabled())
	s, err := tlsconfig.Server(none)
	assert.NoError(t, err)
	assert.Nil(t, s)
	c, err := tlsconfig.Client(none)
	assert.NoError(t, err)
	assert.Nil(t, c)
	creds, err := tlsconfig.ServerCredentials(none)
	require.NoError(t, err)
	assert.Equal(t, "insecure", creds.Info().SecurityProtocol)

	f := tlsconfigtest.NewCA(t, "ca").Issue(t, "x")
	_, err = tlsconfig.Server(tlsconfig.Files{Cert: f.Cert})
	assert.ErrorContains(t, err, "needs both --tls-cert and --tls-key")
	_, err = tlsconfig.Server(tlsconfig.Files{CA: f.CA})
	assert.ErrorContains(t, err, "needs both --tls-cert and --tls-key")
	_, err = tlsconfig.Client(tlsconfig.Files{Key: f.Key, CA: f.CA})
	assert.ErrorContains(t, err, "needs both --tls-cert and --tls-key")
	_, err = tlsconfig.Server(tlsconfig.Files{Cert: f.Cert, Key: f.Cert})
	assert.ErrorContains(t, err, "load server key pair")
	_, err = tlsconfig.Server(tlsconfig.Files{Cert: f.Cert, Key: f.Key, CA: filepath.Join(t.TempDir(), "missing.pem")})
	assert.ErrorContains(t, err, "read CA bundle")
	junk := filepath.Join(t.TempDir(), "junk.pem")
	require.NoError(t, os.WriteFile(junk, []byte("not pem"), 0o600))
	_, err = tlsconfig.Client(tlsconfig.Files{CA: junk})
	assert.ErrorContains(t, err, "no PEM certificate")
	_, err = tlsconfig.ClientCredentials(tlsconfig.Files{CA: junk})
	assert.Error(t, err)

	creds, err = tlsconfig.ClientCredentials(f)
	require.NoError(t, err)
	assert.Equal(t, "tls", creds.Info().SecurityProtocol)
}
