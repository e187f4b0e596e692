package membership

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"net"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// ErrAlreadyRegistered is wrapped by Register when a live holder owns the key.
var ErrAlreadyRegistered = errors.New("membership: already registered")

// AlreadyRegisteredError says who holds the key Register (or RegisterHead)
// wanted. It matches ErrAlreadyRegistered with errors.Is.
type AlreadyRegisteredError struct {
	Stage     string
	ReplicaID uint32
	Head      string // the head id, for RegisterHead; empty for a replica
	Addr      string // the holder's addr, as its record says
}

func (e *AlreadyRegisteredError) Error() string {
	if e.Head != "" {
		return fmt.Sprintf("membership: head %s already registered by %s", e.Head, e.Addr)
	}
	return fmt.Sprintf("membership: replica %s/%d already registered by %s", e.Stage, e.ReplicaID, e.Addr)
}

// Unwrap makes errors.Is(err, ErrAlreadyRegistered) hold.
func (e *AlreadyRegisteredError) Unwrap() error { return ErrAlreadyRegistered }

// DefaultTTL is the lease TTL when RegisterConfig.TTL is zero.
const DefaultTTL = 10 * time.Second

// closeRevokeTimeout bounds Close's revoke when etcd does not answer: the
// lease then expires on its own within its TTL.
const closeRevokeTimeout = 2 * time.Second

// RegisterConfig configures Register.
type RegisterConfig struct {
	Cluster string        // default DefaultCluster
	Member  Member        // Member.ReplicaID is used unless AutoID
	AutoID  bool          // take the smallest free id of the stage (ids start at 0)
	TTL     time.Duration // lease TTL, default 10s, at least 1s, rounded up to seconds
	Logger  *slog.Logger
	// Listener, when set, is the listener this process serves Member.Addr
	// on, opened without SO_REUSEPORT (as net.Listen does). Holding it
	// proves that no other live process serves that addr, so a valid
	// record of the same replica at the same addr, under a lease this
	// registration does not hold, is this replica's previous process,
	// killed before its lease expired: Register takes the record over
	// instead of refusing. The addr must reach the listener directly (see
	// listensOn). Ignored with AutoID.
	Listener net.Listener
}

// RegistrationEventType says what happened to a live registration.
type RegistrationEventType uint8

const (
	// LeaseLost: the keepalive ended (etcd unreachable for longer than the
	// TTL, or the lease revoked or expired). The record may be gone; the
	// registration is now trying to write it again.
	LeaseLost RegistrationEventType = iota + 1
	// Reregistered: the record is written again, under a new lease.
	Reregistered
	// ReregisterBlocked: another holder owns the id; retrying with backoff.
	ReregisterBlocked
	// Restored: someone else deleted or overwrote the record while the
	// lease lived; it is written back under the same lease.
	Restored
)

func (t RegistrationEventType) String() string {
	switch t {
	case LeaseLost:
		return "lease-lost"
	case Reregistered:
		return "reregistered"
	case ReregisterBlocked:
		return "reregister-blocked"
	case Restored:
		return "restored"
	}
	return "unknown"
}

// RegistrationEvent is one change of a registration's health.
type RegistrationEvent struct {
	Type  RegistrationEventType
	Lease clientv3.LeaseID // LeaseLost: the lost lease; Reregistered: the new one
	// Holder is the addr of the record that blocks a re-registration.
	Holder string
}

// Registration is a live registration of a replica: its record under a
// lease that is kept alive, and written again under a new lease when the old
// one is lost, until Close. Its methods may be called from any goroutine.
type Registration struct {
	*leased
	member Member // guarded by leased.mu once the keepalive runs

	beforeTakeOver func() // tests only: between the read and the takeover's txn
}

// Register writes the member record under a fresh lease, in a txn that
// succeeds only when the key is absent, and keeps the lease alive until
// Close. A key with a live holder fails at once with an
// *AlreadyRegisteredError; Register never overwrites and never waits for the
// holder. The one exception is this replica's previous process at the same
// addr (see RegisterConfig.Listener), whose record is taken over in a
// compare-and-swap. With AutoID it takes the smallest free id of the stage,
// retrying when a concurrent joiner takes the same id first.
//
// ctx bounds only the registration itself; the keepalive runs until Close.
func Register(ctx context.Context, cli *clientv3.Client, cfg RegisterConfig) (*Registration, error) {
	return register(ctx, cli, cfg, nil)
}

func register(ctx context.Context, cli *clientv3.Client, cfg RegisterConfig, beforeTakeOver func()) (*Registration, error) {
	if cli == nil {
		return nil, errors.New("membership: register: nil etcd client")
	}
	cluster := cfg.Cluster
	if cluster == "" {
		cluster = DefaultCluster
	}
	if err := ValidateCluster(cluster); err != nil {
		return nil, err
	}
	if err := cfg.Member.Validate(); err != nil {
		return nil, err
	}
	l, err := newLeased(cli, cfg.TTL, cfg.Logger)
	if err != nil {
		return nil, err
	}
	r := &Registration{leased: l, member: cfg.Member, beforeTakeOver: beforeTakeOver}
	r.member.Labels = maps.Clone(cfg.Member.Labels)

	grant, err := cli.Grant(ctx, r.ttlSecs)
	if err != nil {
		return nil, fmt.Errorf("membership: grant lease: %w", err)
	}
	lease := grant.ID
	revokeOnError := func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), closeRevokeTimeout)
		defer cancel()
		_, _ = cli.Revoke(rctx, lease)
	}
	if cfg.AutoID {
		err = r.claimFreeID(ctx, cluster, lease)
	} else {
		err = r.setID(cluster, cfg.Member.ReplicaID)
		if err == nil {
			err = r.claim(ctx, cluster, lease, cfg.Listener)
		}
	}
	if err != nil {
		revokeOnError()
		return nil, err
	}
	r.start(lease, grant.TTL, "addr", r.member.Addr)
	return r, nil
}

// Member returns the registered record, with its assigned replica id and
// the latest Update.
func (r *Registration) Member() Member {
	r.mu.Lock()
	defer r.mu.Unlock()
	m := r.member
	m.Labels = maps.Clone(r.member.Labels)
	return m
}

// Update changes the record with change and writes it under the current
// lease, waiting until etcd holds it, the registration stops, or ctx ends.
// Watchers see a Join with the new record. The stage and replica id cannot
// change, and the result must be valid; otherwise nothing changes. When
// etcd does not answer in time, Update returns an error but keeps the new
// record: it is written as soon as etcd answers (or by the next
// re-registration). Updates are applied in call order.
func (r *Registration) Update(ctx context.Context, change func(*Member)) error {
	want, pending, err := r.change(change)
	if err != nil {
		return err
	}
	if pending {
		r.wake()
	}
	return r.waitWritten(ctx, want)
}

// change applies change to the record and sets the value to write, in one
// critical section, so concurrent updates land in call order.
func (r *Registration) change(change func(*Member)) (want uint64, pending bool, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	m := r.member
	m.Labels = maps.Clone(r.member.Labels)
	change(&m)
	if m.Stage != r.member.Stage || m.ReplicaID != r.member.ReplicaID {
		return 0, false, fmt.Errorf("membership: update %s: stage and replica id cannot change (got %s/%d)", r.key, m.Stage, m.ReplicaID)
	}
	if err := m.Validate(); err != nil {
		return 0, false, fmt.Errorf("membership: update %s: %w", r.key, err)
	}
	if want, pending, err = r.setValueLocked(m); err == nil {
		r.member = m
	}
	return want, pending, err
}

func (r *Registration) setID(cluster string, id uint32) error {
	r.member.ReplicaID = id
	return r.setRecord(MemberKey(cluster, r.member.Stage, id), r.member)
}

// claimFreeID takes the smallest id of the stage that no key uses.
func (r *Registration) claimFreeID(ctx context.Context, cluster string, lease clientv3.LeaseID) error {
	prefix := StagePrefix(cluster, r.member.Stage)
	for attempt := 0; ; attempt++ {
		resp, err := r.cli.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithKeysOnly())
		if err != nil {
			return fmt.Errorf("membership: list %s: %w", prefix, err)
		}
		used := make(map[uint32]bool, len(resp.Kvs))
		for _, kv := range resp.Kvs {
			if _, id, err := ParseKey(cluster, string(kv.Key)); err == nil {
				used[id] = true
			}
		}
		id, ok := smallestFree(used)
		if !ok {
			return fmt.Errorf("membership: stage %s has no free replica id", r.member.Stage)
		}
		if err := r.setID(cluster, id); err != nil {
			return err
		}
		created, _, err := r.create(ctx, lease)
		if err != nil {
			return err
		}
		if created {
			return nil
		}
		// A concurrent joiner took the id between the list and the txn.
		r.lg.Debug("membership: replica id taken concurrently; retrying", "key", r.key, "attempt", attempt+1)
	}
}

func smallestFree(used map[uint32]bool) (uint32, bool) {
	for id := uint64(0); id <= math.MaxUint32; id++ {
		if !used[uint32(id)] {
			return uint32(id), true
		}
	}
	return 0, false
}
