package membership_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/membership"
)

func TestKeys(t *testing.T) {
	require.Equal(t, "/troupe/default/members/", membership.MembersPrefix("default"))
	require.Equal(t, "/troupe/c1/members/talker/", membership.StagePrefix("c1", "talker"))
	require.Equal(t, "/troupe/c1/members/talker/12", membership.MemberKey("c1", "talker", 12))
}

func TestParseKey(t *testing.T) {
	for _, tc := range []struct {
		key     string
		stage   string
		replica uint32
		wantErr string
	}{
		{key: "/troupe/default/members/thinker/0", stage: "thinker", replica: 0},
		{key: "/troupe/default/members/talker-v2/4294967295", stage: "talker-v2", replica: 4294967295},
		{key: "/troupe/other/members/thinker/0", wantErr: "is not under"},
		{key: "/troupe/default/members/thinker", wantErr: "malformed key"},
		{key: "/troupe/default/members/thinker/", wantErr: "malformed replica id"},
		{key: "/troupe/default/members/thinker/-1", wantErr: "malformed replica id"},
		{key: "/troupe/default/members/thinker/4294967296", wantErr: "malformed replica id"},
		{key: "/troupe/default/members/thinker/1/2", wantErr: "malformed key"},
		{key: "/troupe/default/members/bad stage/1", wantErr: "malformed key"},
		{key: "/troupe/default/members//1", wantErr: "malformed key"},
	} {
		t.Run(tc.key, func(t *testing.T) {
			stage, replica, err := membership.ParseKey("default", tc.key)
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.stage, stage)
			require.Equal(t, tc.replica, replica)
			require.Equal(t, tc.key, membership.MemberKey("default", stage, replica), "round trip")
		})
	}
}

func TestDecodeMember(t *testing.T) {
	const key = "/troupe/default/members/thinker/3"
	started := time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)
	for _, tc := range []struct {
		name    string
		key     string
		value   string
		want    membership.Member
		wantErr string
	}{
		{
			name:  "full",
			key:   key,
			value: `{"stage":"thinker","replica_id":3,"addr":"10.0.0.1:7000","engine":"sim","num_speculative_tokens":2,"version":"v1","started_at":"2025-01-02T03:04:05Z","model":"m","labels":{"zone":"a"}}`,
			want: membership.Member{Stage: "thinker", ReplicaID: 3, Addr: "10.0.0.1:7000", Engine: "sim", NumSpeculativeTokens: 2,
				Version: "v1", StartedAt: started, Model: "m", Labels: map[string]string{"zone": "a"}},
		},
		{
			name:  "minimal, unknown fields ignored",
			key:   key,
			value: `{"stage":"thinker","replica_id":3,"addr":"h:1","future":true}`,
			want:  membership.Member{Stage: "thinker", ReplicaID: 3, Addr: "h:1"},
		},
		{name: "bad json", key: key, value: `{`, wantErr: "bad record"},
		{name: "empty", key: key, value: ``, wantErr: "bad record"},
		{name: "wrong type", key: key, value: `{"stage":"thinker","replica_id":"3","addr":"h:1"}`, wantErr: "bad record"},
		{name: "stage mismatch", key: key, value: `{"stage":"talker","replica_id":3,"addr":"h:1"}`, wantErr: "names talker/3"},
		{name: "id mismatch", key: key, value: `{"stage":"thinker","replica_id":4,"addr":"h:1"}`, wantErr: "names thinker/4"},
		{name: "no addr", key: key, value: `{"stage":"thinker","replica_id":3}`, wantErr: "empty addr"},
		{name: "spec tokens", key: key, value: `{"stage":"thinker","replica_id":3,"addr":"h:1","num_speculative_tokens":65}`, wantErr: "out of range"},
		{name: "bad key", key: "/troupe/default/members/thinker/x", value: `{}`, wantErr: "malformed replica id"},
		{
			name:  "sleep state",
			key:   key,
			value: `{"stage":"thinker","replica_id":3,"addr":"h:1","sleep_state":"discard_all"}`,
			want:  membership.Member{Stage: "thinker", ReplicaID: 3, Addr: "h:1", SleepState: "discard_all"},
		},
		{
			name:  "metrics addr",
			key:   key,
			value: `{"stage":"thinker","replica_id":3,"addr":"h:1","metrics_addr":"h:9100"}`,
			want:  membership.Member{Stage: "thinker", ReplicaID: 3, Addr: "h:1", MetricsAddr: "h:9100"},
		},
		{name: "bad metrics addr", key: key, value: `{"stage":"thinker","replica_id":3,"addr":"h:1","metrics_addr":"h"}`, wantErr: "metrics_addr"},
		{name: "unknown sleep state", key: key, value: `{"stage":"thinker","replica_id":3,"addr":"h:1","sleep_state":"dozing"}`, wantErr: `unknown sleep state "dozing"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, err := membership.DecodeMember("default", tc.key, []byte(tc.value))
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				require.Equal(t, membership.Member{}, m)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, m)
		})
	}
}

func TestEventTypeStrings(t *testing.T) {
	require.Equal(t, "join", membership.Join.String())
	require.Equal(t, "leave", membership.Leave.String())
	require.Equal(t, "lease-lost", membership.LeaseLost.String())
	require.Equal(t, "reregistered", membership.Reregistered.String())
	require.Equal(t, "reregister-blocked", membership.ReregisterBlocked.String())
}

// TestMemberAddrMustBeHostPort: the head dials addr over TCP, so anything
// else is refused when the record is decoded.
func TestMemberAddrMustBeHostPort(t *testing.T) {
	for addr, ok := range map[string]bool{
		"127.0.0.1:7000": true, "thinker-0:7000": true, "[::1]:7000": true, "gpu-3.internal:443": true,
		"unix:/tmp/sock": false, "[bad": false, "127.0.0.1": false, "127.0.0.1:0": false, "127.0.0.1:70000": false,
		":7000": false, "dns:///x:1": false, "a b:1": false, "host:port": false,
	} {
		err := membership.Member{Stage: "thinker", Addr: addr}.Validate()
		if ok {
			assert.NoError(t, err, addr)
		} else {
			assert.Error(t, err, addr)
		}
	}
}

func TestDecodeHead(t *testing.T) {
	const key = "/troupe/default/heads/h-1"
	started := time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)
	require.Equal(t, key, membership.HeadKey("default", "h-1"))
	for _, tc := range []struct {
		name, key, value string
		want             membership.Head
		wantErr          string
	}{
		{
			name:  "full",
			key:   key,
			value: `{"id":"h-1","addr":"10.0.0.1:8000","version":"v1","started_at":"2025-01-02T03:04:05Z","future":1}`,
			want:  membership.Head{ID: "h-1", Addr: "10.0.0.1:8000", Version: "v1", StartedAt: started},
		},
		{name: "bad json", key: key, value: `{`, wantErr: "bad head record"},
		{name: "id mismatch", key: key, value: `{"id":"h-2","addr":"h:1"}`, wantErr: `names "h-2"`},
		{name: "no addr", key: key, value: `{"id":"h-1"}`, wantErr: "empty addr"},
		{name: "bad key", key: "/troupe/default/heads/a/b", value: `{"id":"a/b","addr":"h:1"}`, wantErr: "malformed head key"},
		{name: "other prefix", key: "/troupe/default/members/thinker/0", value: `{}`, wantErr: "malformed head key"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, err := membership.DecodeHead("default", tc.key, []byte(tc.value))
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				require.Equal(t, membership.Head{}, h)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, h)
		})
	}
}

// TestRecordLimits: every field of a record is bounded, and an oversized
// record is refused before it is parsed.
func TestRecordLimits(t *testing.T) {
	const key = "/troupe/default/members/thinker/0"
	rec := func(field, value string) []byte {
		return []byte(fmt.Sprintf(`{"stage":"thinker","replica_id":0,"addr":"10.0.0.1:7000",%q:%q}`, field, value))
	}
	_, err := membership.DecodeMember("default", key, rec("version", strings.Repeat("v", membership.MaxFieldLen)))
	require.NoError(t, err, "at the limit")
	for field, max := range map[string]int{"version": membership.MaxFieldLen, "engine": membership.MaxFieldLen, "model": membership.MaxModelLen} {
		_, err := membership.DecodeMember("default", key, rec(field, strings.Repeat("x", max+1)))
		assert.ErrorContains(t, err, field+" of", field)
	}
	_, err = membership.DecodeMember("default", key, rec("version", strings.Repeat("v", 1400<<10)))
	assert.ErrorContains(t, err, "at most 16384", "1.4 MB refused by size, unparsed")
	labels := map[string]string{}
	for i := range membership.MaxLabels + 1 {
		labels[fmt.Sprint("k", i)] = "v"
	}
	assert.ErrorContains(t, membership.Member{Stage: "t", Addr: "h:1", Labels: labels}.Validate(), "labels")
	assert.ErrorContains(t, membership.Member{Stage: "t", Addr: "h:1", Labels: map[string]string{"k": strings.Repeat("v", membership.MaxLabelLen+1)}}.Validate(), "label")
	_, err = membership.DecodeHead("default", "/troupe/default/heads/h", []byte(fmt.Sprintf(`{"id":"h","addr":"h:1","version":%q}`, strings.Repeat("v", 200))))
	assert.ErrorContains(t, err, "version of 200 bytes")
}
