package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/membership"
)

// listedMembers: an awake replica under a 10s lease with 7s left, one
// asleep at level 2, and one without a lease whose record names no sleep
// state (an older worker's).
func listedMembers(now time.Time) []membership.Listed[membership.Member] {
	return []membership.Listed[membership.Member]{
		{Key: "/troupe/default/members/thinker/0", Lease: 0x1f, TTL: 10 * time.Second, TTLLeft: 7 * time.Second,
			Record: membership.Member{Stage: "thinker", ReplicaID: 0, Addr: "10.0.0.1:7000", Engine: "sim", Version: "v1", SleepState: "awake", StartedAt: now.Add(-time.Minute)}},
		{Key: "/troupe/default/members/thinker/1", Lease: 0x20, TTL: 10 * time.Second, TTLLeft: 3 * time.Second,
			Record: membership.Member{Stage: "thinker", ReplicaID: 1, Addr: "10.0.0.2:7000", Engine: "sim", Version: "v1", SleepState: "discard_all", StartedAt: now.Add(-time.Minute)}},
		{Key: "/troupe/default/members/talker/0", TTL: -1, TTLLeft: -1,
			Record: membership.Member{Stage: "talker", ReplicaID: 0, Addr: "10.0.0.3:7000"}},
	}
}

// TestMembersTable: LEASE TTL is the lease's granted TTL and EXPIRES IN
// the time it has left; SLEEP is the record's sleep state.
func TestMembersTable(t *testing.T) {
	now := time.Date(2025, 1, 1, 0, 1, 0, 0, time.UTC)
	var out bytes.Buffer
	require.NoError(t, writeMembersTable(&out, listedMembers(now), now))
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	require.Len(t, lines, 4, out.String())
	assert.Regexp(t, `^STAGE +REPLICA +ADDR +ENGINE +VERSION +SLEEP +LEASE TTL +EXPIRES IN +AGE$`, lines[0])
	assert.Regexp(t, `^thinker +0 +10\.0\.0\.1:7000 +sim +v1 +awake +10s +7s +1m0s$`, lines[1])
	assert.Regexp(t, `^thinker +1 +10\.0\.0\.2:7000 +sim +v1 +discard_all +10s +3s +1m0s$`, lines[2])
	assert.Regexp(t, `^talker +0 +10\.0\.0\.3:7000 +- +- +- +- +- +-$`, lines[3])
}

// TestMembersJSON: --json says what the table says.
func TestMembersJSON(t *testing.T) {
	now := time.Date(2025, 1, 1, 0, 1, 0, 0, time.UTC)
	var out bytes.Buffer
	heads := []membership.Listed[membership.Head]{{Key: "/troupe/default/heads/a", Lease: 0x21, TTL: 10 * time.Second, TTLLeft: 9 * time.Second,
		Record: membership.Head{ID: "a", Addr: "10.0.0.9:8000"}}}
	require.NoError(t, writeMembersJSON(&out, "default", listedMembers(now), heads, now))
	var got struct {
		Members []map[string]any `json:"members"`
		Heads   []map[string]any `json:"heads"`
	}
	require.NoError(t, json.Unmarshal(out.Bytes(), &got), out.String())
	require.Len(t, got.Members, 3)
	for i, want := range []struct {
		sleep          string
		ttl, expiresIn float64
	}{{"awake", 10, 7}, {"discard_all", 10, 3}, {"", -1, -1}} {
		m := got.Members[i]
		if want.sleep == "" {
			assert.NotContains(t, m, "sleep_state", "member %d", i)
		} else {
			assert.Equal(t, want.sleep, m["sleep_state"], "member %d", i)
		}
		assert.Equal(t, want.ttl, m["lease_ttl_seconds"], "member %d", i)
		assert.Equal(t, want.expiresIn, m["lease_expires_in_seconds"], "member %d", i)
	}
	require.Len(t, got.Heads, 1)
	assert.Equal(t, 10.0, got.Heads[0]["lease_ttl_seconds"])
	assert.Equal(t, 9.0, got.Heads[0]["lease_expires_in_seconds"])
}
