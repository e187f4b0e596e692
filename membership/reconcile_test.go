package membership_test

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	v3 "go.etcd.io/etcd/client/v3"

	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/membership/membershiptest"
)

// TestReconcileRepairsSilentDrift: the watch loses a join and a leave
// without any error; only the periodic re-list can notice, and it must
// deliver both.
func TestReconcileRepairsSilentDrift(t *testing.T) {
	e := membershiptest.Start(t)
	cli := dial(t, e.Endpoints())
	w := membership.NewWatcher(cli, membership.WatchConfig{ReconcileInterval: 300 * time.Millisecond, Logger: quietLogger()})
	var dropped atomic.Int64
	membership.SetDropWatchEvent(w, func(ev *v3.Event) bool {
		dropped.Add(1)
		return true // every watch event is lost: only lists see anything
	})
	wa := startWatcher(t, w)

	r := register(t, cli, membership.RegisterConfig{Member: member("thinker", 3, "127.0.0.1:7003"), Logger: quietLogger()})
	joined := wa.next(t)
	assert.Equal(t, membership.Join, joined.Type)
	assert.Equal(t, r.Key(), joined.Key)

	assert.NoError(t, r.Close(testCtx(t)))
	left := wa.next(t)
	assert.Equal(t, membership.Leave, left.Type)
	assert.Equal(t, r.Key(), left.Key)
	assert.Positive(t, dropped.Load(), "the events came by reconcile, not by the watch")
}
