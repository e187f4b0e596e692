package e2e

import (
	"encoding/json"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestMembersLists: `troupe members` shows every registered replica, as an
// aligned table and as JSON, with its address and the lease time left.
func TestMembersLists(t *testing.T) {
	if testing.Short() {
		t.Skip("process test; skipped with -short")
	}
	etcd := startEtcd(t)
	w0 := startWorker(t, etcd, "thinker", "--lease-ttl", "7s")
	w1 := startWorker(t, etcd, "talker", "--lease-ttl", "7s")

	out, err := exec.CommandContext(testCtx(t), troupeBin, "members", "--etcd-endpoints", etcd).CombinedOutput()
	require.NoError(t, err, "%s", out)
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	require.GreaterOrEqual(t, len(lines), 3, "%s", out)
	header := strings.ToLower(lines[0])
	for _, col := range []string{"stage", "replica", "addr", "ttl", "age"} {
		assert.Contains(t, header, col)
	}
	assert.Contains(t, string(out), w0.addr)
	assert.Contains(t, string(out), w1.addr)

	out, err = exec.CommandContext(testCtx(t), troupeBin, "members", "--etcd-endpoints", etcd, "--json").Output()
	require.NoError(t, err)
	var listing struct {
		Cluster string           `json:"cluster"`
		Members []map[string]any `json:"members"`
	}
	require.NoError(t, json.Unmarshal(out, &listing), "%s", out)
	assert.Equal(t, "default", listing.Cluster)
	rows := listing.Members
	require.Len(t, rows, 2, "%s", out)
	stages := map[string]bool{}
	for _, r := range rows {
		stages[r["stage"].(string)] = true
		assert.Contains(t, []string{w0.addr, w1.addr}, r["addr"])
	}
	assert.Equal(t, map[string]bool{"thinker": true, "talker": true}, stages)
}
