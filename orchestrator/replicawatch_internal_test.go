package orchestrator

import (
	"context"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// routedHead is a head whose router routes n replicas of stage 0 that
// nothing serves (their connections never connect), each known to the
// loop as attached, for checkLive. Its router is closed by cleanup.
func routedHead(tb testing.TB, n int) (*Head, []*router.Replica) {
	tb.Helper()
	h, err := New(nil, Config{
		Pipeline: DefaultPipeline(),
		Metrics:  prometheus.NewRegistry(),
		// Connections that stay CONNECTING (a dial that never ends, within
		// an hour's connect timeout): their state does not move under the
		// check, and no descriptor is spent on them.
		Dial: func(addr string) (*grpc.ClientConn, error) {
			return grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
				grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { <-ctx.Done(); return nil, ctx.Err() }),
				grpc.WithConnectParams(grpc.ConnectParams{MinConnectTimeout: time.Hour, Backoff: backoff.DefaultConfig}))
		},
	})
	require.NoError(tb, err)
	tb.Cleanup(h.router.Close)
	reps := make([]*router.Replica, n)
	h.fleet.begin()
	for i := range n {
		key := router.Key{Stage: 0, Replica: uint32(i + 1)}
		rep, err := h.router.Dial(router.ReplicaSpec{Key: key, StageName: "thinker", EngineIndex: i, Addr: fmt.Sprintf("127.0.0.1:%d", 1+i%1000)})
		require.NoError(tb, err)
		require.NoError(tb, h.router.Add(rep))
		h.fleet.known[key] = &tracked{key: key, index: i, routed: true, live: rowState{state: StateAttached}}
		h.fleet.publish(key)
		reps[i] = rep
	}
	h.fleet.flush()
	return h, reps
}

// TestCheckLivePublishesChangedStates: the loop's check publishes the
// replicas whose request-path state changed since its last look (so a
// watch, which follows publishes, sees them), and nothing when none did.
func TestCheckLivePublishesChangedStates(t *testing.T) {
	h, reps := routedHead(t, 50)
	check := func() { h.fleet.begin(); h.fleet.checkLive(); h.fleet.flush() } // as the loop runs it
	entry := h.fleet.journal.Load()
	check()
	assert.Same(t, entry, h.fleet.journal.Load(), "nothing changed: nothing published")

	reps[7].MarkDraining()
	reps[20].SetSleepState(stagepb.SleepState_SLEEP_STATE_WEIGHTS_OFFLOADED)
	check()
	select {
	case <-entry.done:
	default:
		t.Fatal("a changed state was not published")
	}
	assert.Equal(t, []router.Key{reps[7].Key, reps[20].Key}, entry.keys)
	got, ok := h.fleet.lookup(reps[7].Key)
	require.True(t, ok)
	assert.True(t, strings.HasPrefix(got.live.reason, "draining:"), "the view holds the state the check saw")
	next := h.fleet.journal.Load()
	check()
	assert.Same(t, next, h.fleet.journal.Load(), "a state is published once")
}

// BenchmarkCheckLive is the loop's check each liveCheckInterval, nothing
// changed, at the fleet's sizes.
func BenchmarkCheckLive(b *testing.B) {
	for _, n := range []int{1000, 10000} {
		b.Run(fmt.Sprintf("replicas=%d", n), func(b *testing.B) {
			h, _ := routedHead(b, n)
			for b.Loop() {
				h.fleet.begin()
				h.fleet.checkLive()
				h.fleet.flush()
			}
		})
	}
}
