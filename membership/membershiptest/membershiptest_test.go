package membershiptest_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"

	"github.com/troupe-serving/troupe/membership/membershiptest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestStartPutRestart(t *testing.T) {
	t0 := time.Now()
	e := membershiptest.Start(t)
	t.Logf("start took %v", time.Since(t0))
	cli := e.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	put, err := cli.Put(ctx, "/k", "v1")
	require.NoError(t, err)
	w := cli.Watch(ctx, "/k", clientv3.WithRev(put.Header.Revision+1))

	before := e.Endpoints()
	t0 = time.Now()
	e.Stop()
	t.Logf("stop took %v", time.Since(t0))
	t0 = time.Now()
	e.Restart(t)
	t.Logf("restart took %v", time.Since(t0))
	require.Equal(t, before, e.Endpoints(), "restart keeps the client URL")

	// The same client reconnects; the data survived.
	resp, err := cli.Get(ctx, "/k")
	require.NoError(t, err)
	require.Len(t, resp.Kvs, 1)
	require.Equal(t, "v1", string(resp.Kvs[0].Value))
	_, err = cli.Put(ctx, "/k", "v2")
	require.NoError(t, err)
	for wr := range w {
		require.NoError(t, wr.Err())
		if len(wr.Events) > 0 {
			require.Equal(t, "v2", string(wr.Events[0].Kv.Value))
			break
		}
	}
}

func TestTwoServersSideBySide(t *testing.T) {
	a, b := membershiptest.Start(t), membershiptest.Start(t)
	require.NotEqual(t, a.Endpoints(), b.Endpoints())
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err := a.Client(t).Put(ctx, "/only-a", "x")
	require.NoError(t, err)
	resp, err := b.Client(t).Get(ctx, "/only-a")
	require.NoError(t, err)
	require.Empty(t, resp.Kvs)
}
