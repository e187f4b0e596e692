package membership

import (
	"encoding/json"
	"testing"
)

// FuzzDecodeMember feeds arbitrary keys and records to the head's decoder:
// it returns an error or a record that validates and matches its key,
// never panics.
func FuzzDecodeMember(f *testing.F) {
	good := `{"stage":"thinker","replica_id":0,"addr":"127.0.0.1:7000","engine":"sim","num_speculative_tokens":0,"version":"v","started_at":"2026-01-01T00:00:00Z"}`
	for _, seed := range []struct{ key, value string }{
		{"/troupe/default/members/thinker/0", good},
		{"/troupe/default/members/thinker/0", `{"stage":"thinker","replica_id":0,"addr":"[::1]:1","labels":{"a":"b"}}`},
		{"/troupe/default/members/thinker/0", `{"stage":"thinker","replica_id":0,"addr":"10.0.0.1:7000","metrics_addr":"10.0.0.1:9100"}`},
		{"/troupe/default/members/thinker/0", `{"stage":"thinker","replica_id":0,"addr":"10.0.0.1:7000","metrics_addr":"unix:/x"}`},
		{"/troupe/default/members/thinker/0", `{"stage":"thinker","replica_id":0,"addr":"unix:/tmp/x"}`},
		{"/troupe/default/members/thinker/0", `{"stage":"thinker","replica_id":0,"addr":"[bad"}`},
		{"/troupe/default/members/thinker/4294967296", good},
		{"/troupe/default/members/thinker/0/x", good},
		{"/troupe/default/members//0", `{}`},
		{"/troupe/default/members/talker/1", `{"stage":"talker","replica_id":1,"addr":"h:65536","num_speculative_tokens":-1}`},
		{"/troupe/other/members/thinker/0", `null`},
	} {
		f.Add(seed.key, []byte(seed.value))
	}
	f.Fuzz(func(t *testing.T, key string, value []byte) {
		m, err := DecodeMember(DefaultCluster, key, value)
		if err != nil {
			return
		}
		if verr := m.Validate(); verr != nil {
			t.Fatalf("decoded a record that does not validate: %v", verr)
		}
		if MemberKey(DefaultCluster, m.Stage, m.ReplicaID) != key {
			t.Fatalf("record %s/%d decoded at key %q", m.Stage, m.ReplicaID, key)
		}
		again, err := json.Marshal(m)
		if err != nil {
			t.Fatalf("decoded record does not encode: %v", err)
		}
		if _, err := DecodeMember(DefaultCluster, key, again); err != nil {
			t.Fatalf("re-encoded record refused: %v (%s)", err, again)
		}
	})
}
