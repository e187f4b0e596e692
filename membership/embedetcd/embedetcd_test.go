package embedetcd

import (
	"context"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"
	"go.uber.org/zap"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestStartServeClose(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	srv, err := Start(ctx, Config{
		DataDir:          t.TempDir(),
		ListenClientURLs: []string{"http://127.0.0.1:0"},
		UnsafeNoFsync:    true,
		Logger:           zap.NewNop(),
	})
	require.NoError(t, err)
	defer srv.Close()
	urls := srv.ClientURLs()
	require.Len(t, urls, 1)
	u, err := url.Parse(urls[0])
	require.NoError(t, err)
	require.NotEqual(t, "0", u.Port(), "the bound port is reported")

	cli, err := clientv3.New(clientv3.Config{Endpoints: urls, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	require.NoError(t, err)
	defer cli.Close()
	_, err = cli.Put(ctx, "/k", "v")
	require.NoError(t, err)
	// An open watch must not hold Close up.
	_ = cli.Watch(ctx, "/k")
	done := make(chan struct{})
	go func() { srv.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("Close did not return")
	}
	srv.Close() // idempotent
}

func TestStartRejectsBadConfig(t *testing.T) {
	ctx := context.Background()
	_, err := Start(ctx, Config{})
	require.EqualError(t, err, "embedetcd: data dir is required")
	_, err = Start(ctx, Config{DataDir: t.TempDir(), ListenClientURLs: []string{"tcp://127.0.0.1:2379"}})
	require.ErrorContains(t, err, "want http://host:port")
	_, err = Start(ctx, Config{DataDir: t.TempDir(), ListenClientURLs: []string{"http://127.0.0.1:x"}})
	require.Error(t, err)
}

func TestDefaults(t *testing.T) {
	for in, want := range map[string]string{
		"http://127.0.0.1:2379": "http://127.0.0.1:2380",
		"http://127.0.0.1:0":    "http://127.0.0.1:0",
		"https://[::1]:3379":    "https://[::1]:3380",
	} {
		u, err := url.Parse(in)
		require.NoError(t, err)
		got, err := nextPort(*u)
		require.NoError(t, err)
		require.Equal(t, want, got)
	}
	host, err := os.Hostname()
	require.NoError(t, err)
	ls := []url.URL{{Scheme: "http", Host: "0.0.0.0:2379"}, {Scheme: "http", Host: "10.1.2.3:2379"}}
	adv := advertised(ls)
	require.Equal(t, "http://"+host+":2379", adv[0].String())
	require.Equal(t, "http://10.1.2.3:2379", adv[1].String())
	require.Equal(t, "0.0.0.0:2379", ls[0].Host, "listen URLs are not changed")
}
