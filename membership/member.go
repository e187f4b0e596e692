// Package membership is troupe's etcd side: the Member record, the key
// schema, worker registration under a lease, and the head's watch.
//
// Keys are /troupe/<cluster>/members/<stage>/<replica-id>; the value is the
// JSON Member. Nothing outside this package talks to etcd about membership.
package membership

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// DefaultCluster is the cluster name used when none is given.
const DefaultCluster = "default"

// Member is the record a replica writes under its lease.
type Member struct {
	Stage                string            `json:"stage"`
	ReplicaID            uint32            `json:"replica_id"`
	Addr                 string            `json:"addr"`
	Engine               string            `json:"engine"`
	NumSpeculativeTokens int               `json:"num_speculative_tokens"`
	Version              string            `json:"version"`
	StartedAt            time.Time         `json:"started_at"`
	Model                string            `json:"model,omitempty"`
	Labels               map[string]string `json:"labels,omitempty"`
	// SleepState is the engine's sleep state as the worker last set it
	// (a stagepb sleep state name: awake, weights_offloaded, discard_all;
	// empty: not reported). The worker updates it on every sleep and wake
	// up, so every head learns it from the same record.
	SleepState string `json:"sleep_state,omitempty"`
	// MetricsAddr is the host:port of the worker's own /metrics
	// (--metrics-listen), empty when it serves none. Optional: records
	// written before it existed decode without it. The head lists it in
	// GET /v1/replicas/sd for Prometheus to scrape the replica directly.
	MetricsAddr string `json:"metrics_addr,omitempty"`
}

// Limits of a record. A record is copied into every head's /v1/replicas,
// series labels and logs: an unbounded field (a 1.4 MB version string)
// would make every /metrics scrape megabytes. DecodeMember and DecodeHead
// refuse a larger value before parsing it.
const (
	MaxRecordBytes = 16 << 10 // a whole record's JSON
	MaxAddrLen     = 261      // a 255-byte host name, ':' and a port
	MaxFieldLen    = 128      // engine, version, sleep_state
	MaxModelLen    = 256
	MaxLabels      = 32
	MaxLabelKeyLen = 63
	MaxLabelLen    = 256 // a label's value
)

// Validate reports what is wrong with a record, if anything.
func (m Member) Validate() error {
	switch {
	case !validName(m.Stage):
		return fmt.Errorf("membership: invalid stage name %q", m.Stage)
	case m.Addr == "":
		return errors.New("membership: empty addr")
	case len(m.Addr) > MaxAddrLen:
		return fmt.Errorf("membership: addr of %d bytes, at most %d", len(m.Addr), MaxAddrLen)
	case len(m.Engine) > MaxFieldLen:
		return fmt.Errorf("membership: engine of %d bytes, at most %d", len(m.Engine), MaxFieldLen)
	case len(m.Version) > MaxFieldLen:
		return fmt.Errorf("membership: version of %d bytes, at most %d", len(m.Version), MaxFieldLen)
	case len(m.Model) > MaxModelLen:
		return fmt.Errorf("membership: model of %d bytes, at most %d", len(m.Model), MaxModelLen)
	case len(m.Labels) > MaxLabels:
		return fmt.Errorf("membership: %d labels, at most %d", len(m.Labels), MaxLabels)
	}
	for k, v := range m.Labels {
		if len(k) == 0 || len(k) > MaxLabelKeyLen || len(v) > MaxLabelLen {
			return fmt.Errorf("membership: label %.64q: keys 1 to %d bytes, values at most %d", k, MaxLabelKeyLen, MaxLabelLen)
		}
	}
	if err := validAddr(m.Addr); err != nil {
		return err
	}
	if m.MetricsAddr != "" {
		if len(m.MetricsAddr) > MaxAddrLen {
			return fmt.Errorf("membership: metrics_addr of %d bytes, at most %d", len(m.MetricsAddr), MaxAddrLen)
		}
		if err := validAddr(m.MetricsAddr); err != nil {
			return fmt.Errorf("membership: metrics_addr: %w", err)
		}
	}
	switch {
	case m.NumSpeculativeTokens < 0 || m.NumSpeculativeTokens > stagepb.MaxSpeculativeTokens:
		return fmt.Errorf("membership: num_speculative_tokens %d out of range 0..%d", m.NumSpeculativeTokens, stagepb.MaxSpeculativeTokens)
	}
	if m.SleepState != "" {
		if _, err := stagepb.ParseSleepState(m.SleepState); err != nil {
			return fmt.Errorf("membership: sleep_state: %w", err)
		}
	}
	return nil
}

// validAddr accepts host:port with a non-empty host and a port in
// 1..65535: the form the head dials over TCP. Schemes (unix:, dns:///)
// would make the head dial something else than a replica's TCP address.
func validAddr(addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("membership: addr %q is not host:port: %w", addr, err)
	}
	if host == "" || strings.ContainsAny(host, "/:@ ") && !isIPv6(host) {
		return fmt.Errorf("membership: addr %q: invalid host %q", addr, host)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return fmt.Errorf("membership: addr %q: port must be 1..65535", addr)
	}
	return nil
}

func isIPv6(host string) bool {
	ip := net.ParseIP(host)
	return ip != nil && ip.To4() == nil
}

// validName accepts names that are safe as one etcd key segment.
func validName(s string) bool {
	if s == "" || len(s) > 128 {
		return false
	}
	for _, r := range s {
		ok := r == '-' || r == '_' || r == '.' || (r >= 'a' && r <= 'z') || (r >= 'A' && r <= 'Z') || (r >= '0' && r <= '9')
		if !ok {
			return false
		}
	}
	return true
}

// ValidateCluster reports whether a cluster name is usable in keys.
func ValidateCluster(cluster string) error {
	if !validName(cluster) {
		return fmt.Errorf("membership: invalid cluster name %q", cluster)
	}
	return nil
}

// KeyRoot is the etcd prefix of every key troupe writes: a cluster's
// records live under KeyRoot<cluster>/ (see MembersPrefix, HeadsPrefix).
const KeyRoot = "/troupe/"

// MembersPrefix is the prefix under which every member of a cluster lives.
func MembersPrefix(cluster string) string { return KeyRoot + cluster + "/members/" }

// StagePrefix is the prefix of one stage's members.
func StagePrefix(cluster, stage string) string { return MembersPrefix(cluster) + stage + "/" }

// MemberKey is the key of one replica.
func MemberKey(cluster, stage string, replica uint32) string {
	return StagePrefix(cluster, stage) + strconv.FormatUint(uint64(replica), 10)
}

// ParseKey splits a member key into its stage and replica id.
func ParseKey(cluster, key string) (stage string, replica uint32, err error) {
	rest, ok := strings.CutPrefix(key, MembersPrefix(cluster))
	if !ok {
		return "", 0, fmt.Errorf("membership: key %q is not under %q", key, MembersPrefix(cluster))
	}
	stage, id, ok := strings.Cut(rest, "/")
	if !ok || !validName(stage) || strings.Contains(id, "/") {
		return "", 0, fmt.Errorf("membership: malformed key %q", key)
	}
	n, err := strconv.ParseUint(id, 10, 32)
	if err != nil {
		return "", 0, fmt.Errorf("membership: malformed replica id in key %q: %w", key, err)
	}
	return stage, uint32(n), nil
}

// DecodeMember parses and checks a record against the key it was found at.
func DecodeMember(cluster, key string, value []byte) (Member, error) {
	stage, replica, err := ParseKey(cluster, key)
	if err != nil {
		return Member{}, err
	}
	if len(value) > MaxRecordBytes {
		return Member{}, fmt.Errorf("membership: record at %q has %d bytes, at most %d", key, len(value), MaxRecordBytes)
	}
	var m Member
	if err := json.Unmarshal(value, &m); err != nil {
		return Member{}, fmt.Errorf("membership: bad record at %q: %w", key, err)
	}
	if m.Stage != stage || m.ReplicaID != replica {
		return Member{}, fmt.Errorf("membership: record at %q names %s/%d", key, m.Stage, m.ReplicaID)
	}
	if err := m.Validate(); err != nil {
		return Member{}, fmt.Errorf("membership: bad record at %q: %w", key, err)
	}
	return m, nil
}

// EventType says whether a replica joined or left.
type EventType uint8

const (
	Join EventType = iota + 1
	Leave
)

func (t EventType) String() string {
	switch t {
	case Join:
		return "join"
	case Leave:
		return "leave"
	}
	return "unknown"
}

// Event is one membership change. For a Leave, Member is the last record
// seen for the key. Events for one key are delivered in revision order; a
// Join for a key that is already joined means its record changed.
type Event struct {
	Type     EventType
	Key      string
	Member   Member
	Revision int64
}
