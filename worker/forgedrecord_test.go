package worker_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/troupe-serving/troupe/pkg/clusterauth"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/tlsconfig"
	"github.com/troupe-serving/troupe/pkg/tlsconfig/tlsconfigtest"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/sim"
)

// tokenSniffer records the authorization metadata of every unary call a
// server receives: what a forged record's listener would collect.
type tokenSniffer struct {
	mu   sync.Mutex
	seen []string
}

func (s *tokenSniffer) intercept(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	s.mu.Lock()
	s.seen = append(s.seen, md.Get("authorization")...)
	s.mu.Unlock()
	return h(ctx, req)
}

func (s *tokenSniffer) got() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.seen...)
}

// TestForgedRecordGetsNoTokenUnderMutualTLS: a record forged in etcd points
// the head at a listener of the attacker's. A head dialling as `troupe
// head` does with mutual TLS (the cluster CA, its certificate, the token
// as per-RPC credentials) sends it nothing: the handshake fails, on a
// plaintext listener and on one whose certificate another CA signed,
// before any metadata leaves. With the token alone (plaintext) the same
// listener collects it: the threat model in docs/security.md.
func TestForgedRecordGetsNoTokenUnderMutualTLS(t *testing.T) {
	token := clusterauth.NewToken()
	ca := tlsconfigtest.NewCA(t, "troupe")
	headFiles := ca.Issue(t, "head")
	rogueTLS, err := tlsconfig.Server(tlsconfigtest.NewCA(t, "rogue").Issue(t, "rogue"))
	require.NoError(t, err)

	rogue := func(t *testing.T, cfg worker.Config) (*running, *tokenSniffer) {
		sniff := &tokenSniffer{}
		cfg.Stage, cfg.Engine = "thinker", newSim(t, sim.Config{})
		cfg.ServerOptions = []grpc.ServerOption{grpc.ChainUnaryInterceptor(sniff.intercept)}
		r := start(t, cfg)
		r.waitRegistered(t)
		return r, sniff
	}
	health := func(t *testing.T, addr string, creds grpc.DialOption) error {
		conn, err := grpc.NewClient(addr, creds, clusterauth.DialOption(token))
		require.NoError(t, err)
		t.Cleanup(func() { _ = conn.Close() })
		ctx, cancel := context.WithTimeout(testCtx(t), 10*time.Second)
		defer cancel()
		_, err = stagepb.NewStageServiceClient(conn).Health(ctx, &stagepb.HealthRequest{})
		return err
	}
	headCreds, err := tlsconfig.ClientCredentials(headFiles)
	require.NoError(t, err)

	for name, cfg := range map[string]worker.Config{"plaintext": {}, "another CA": {TLS: rogueTLS}} {
		t.Run(name, func(t *testing.T) {
			r, sniff := rogue(t, cfg)
			require.Error(t, health(t, r.Advertise(), grpc.WithTransportCredentials(headCreds)), "the handshake fails")
			assert.Empty(t, sniff.got(), "the token never left the head")
		})
	}

	t.Run("token alone", func(t *testing.T) {
		r, sniff := rogue(t, worker.Config{})
		require.NoError(t, health(t, r.Advertise(), grpc.WithTransportCredentials(insecure.NewCredentials())))
		assert.Equal(t, []string{"Bearer " + token}, sniff.got(), "without TLS a forged record's listener collects the token")
	})
}
