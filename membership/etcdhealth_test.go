package membership_test

import (
	"bytes"
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/membership/membershiptest"
)

// lockedBuffer is a log sink safe for the monitor's goroutine.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestEtcdOutageIsVisible: while etcd is down, MonitorEtcd reports it
// (OnChange false, one warning) and the watcher's last contact stops
// advancing; once etcd is back, both recover and the recovery is logged.
func TestEtcdOutageIsVisible(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	w := membership.NewWatcher(cli, membership.WatchConfig{Logger: quietLogger()})
	startWatcher(t, w)

	var logs lockedBuffer
	changes := make(chan bool, 16)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		membership.MonitorEtcd(ctx, cli, membership.HealthConfig{
			Interval: 100 * time.Millisecond, Who: "test",
			Logger:   slog.New(slog.NewTextHandler(&logs, nil)),
			OnChange: func(up bool) { changes <- up },
		})
	}()
	t.Cleanup(func() { cancel(); <-done })
	next := func() bool {
		select {
		case up := <-changes:
			return up
		case <-time.After(wait):
			t.Fatal("no change reported")
			return false
		}
	}
	require.True(t, next(), "up at first")
	require.Eventually(t, func() bool { return time.Since(w.LastContact()) < 3*time.Second }, wait, 10*time.Millisecond)

	e.Stop()
	require.False(t, next(), "down while etcd is stopped")
	assert.Contains(t, logs.String(), "etcd unreachable")
	require.Eventually(t, func() bool { return time.Since(w.LastContact()) > 5*time.Second }, wait, 50*time.Millisecond,
		"the watch hears nothing: its lag grows")

	e.Restart(t)
	require.True(t, next(), "up again")
	assert.Contains(t, logs.String(), "etcd reachable again")
	assert.Contains(t, logs.String(), "down_for=")
	require.Eventually(t, func() bool { return time.Since(w.LastContact()) < 3*time.Second }, wait, 10*time.Millisecond,
		"the watch hears from etcd again")
	select {
	case up := <-changes:
		t.Fatalf("a change without a transition: %v", up)
	default:
	}
}
