package membership

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"math/rand/v2"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// ErrAlreadyRegistered is wrapped by Register when a live holder owns the key.
var ErrAlreadyRegistered = errors.New("membership: already registered")

// AlreadyRegisteredError says who holds the key Register wanted. It
// matches ErrAlreadyRegistered with errors.Is.
type AlreadyRegisteredError struct {
	Stage     string
	ReplicaID uint32
	Addr      string // the holder's addr, as its record says
}

func (e *AlreadyRegisteredError) Error() string {
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

// Registration is a live registration: a record under a lease that is kept
// alive, and written again under a new lease when the old one is lost,
// until Close. Its methods may be called from any goroutine.
type Registration struct {
	cli     *clientv3.Client
	key     string
	member  Member
	value   string
	ttlSecs int64
	lg      *slog.Logger

	events chan RegistrationEvent // written by run only; closed when run ends
	stop   context.CancelFunc     // stops run
	done   chan struct{}          // closed when run has ended

	mu    sync.Mutex
	lease clientv3.LeaseID // the lease the record is (or is being) written under
	stale clientv3.LeaseID // a lost lease that may still hold the record

	closeOnce sync.Once
	closeErr  error
}

// Register writes the member record under a fresh lease, in a txn that
// succeeds only when the key is absent, and keeps the lease alive until
// Close. A key with a live holder fails at once with an
// *AlreadyRegisteredError; Register never overwrites and never waits for the
// holder. With AutoID it takes the smallest free id of the stage, retrying
// when a concurrent joiner takes the same id first.
//
// ctx bounds only the registration itself; the keepalive runs until Close.
func Register(ctx context.Context, cli *clientv3.Client, cfg RegisterConfig) (*Registration, error) {
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
	ttl := cfg.TTL
	if ttl == 0 {
		ttl = DefaultTTL
	}
	if ttl < time.Second {
		return nil, fmt.Errorf("membership: lease TTL %v is below 1s", ttl)
	}
	lg := cfg.Logger
	if lg == nil {
		lg = slog.Default()
	}
	r := &Registration{
		cli:     cli,
		member:  cfg.Member,
		ttlSecs: int64(math.Ceil(ttl.Seconds())),
		lg:      lg,
		events:  make(chan RegistrationEvent, 16),
		done:    make(chan struct{}),
	}
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
			var ok bool
			var holder string
			ok, holder, err = r.create(ctx, lease)
			if err == nil && !ok {
				err = &AlreadyRegisteredError{Stage: r.member.Stage, ReplicaID: r.member.ReplicaID, Addr: holder}
			}
		}
	}
	if err != nil {
		revokeOnError()
		return nil, err
	}
	r.lease = lease
	runCtx, stop := context.WithCancel(context.Background())
	r.stop = stop
	go r.run(runCtx, lease)
	lg.Info("membership: registered", "key", r.key, "addr", r.member.Addr,
		"lease", fmt.Sprintf("%x", int64(lease)), "ttl", time.Duration(grant.TTL)*time.Second)
	return r, nil
}

// Member returns the registered record, with its assigned replica id.
func (r *Registration) Member() Member {
	m := r.member
	m.Labels = maps.Clone(r.member.Labels)
	return m
}

// Key returns the etcd key of the record.
func (r *Registration) Key() string { return r.key }

// Lease returns the lease the record is currently written under.
func (r *Registration) Lease() clientv3.LeaseID {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.lease
}

// Events reports lease losses and re-registrations. It is buffered; when
// the reader falls behind, new events are dropped rather than delaying the
// keepalive. It is closed once the registration has stopped (after Close,
// or when the etcd client is closed).
func (r *Registration) Events() <-chan RegistrationEvent { return r.events }

// Close stops the keepalive and revokes the lease, so the record is gone at
// once and watchers see the leave. The revoke is bounded by ctx and by 2s;
// when etcd does not answer, Close returns an error and the record goes
// when the lease expires. Only the first call does anything.
func (r *Registration) Close(ctx context.Context) error {
	r.closeOnce.Do(func() {
		r.stop()
		<-r.done
		r.mu.Lock()
		leases := []clientv3.LeaseID{r.lease, r.stale}
		r.mu.Unlock()
		rctx, cancel := context.WithTimeout(ctx, closeRevokeTimeout)
		defer cancel()
		var errs []error
		for _, l := range leases {
			if l == clientv3.NoLease {
				continue
			}
			if _, err := r.cli.Revoke(rctx, l); err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound) {
				errs = append(errs, err)
			}
		}
		if err := errors.Join(errs...); err != nil {
			r.closeErr = fmt.Errorf("membership: revoke lease of %s (the record goes when it expires, within %ds): %w", r.key, r.ttlSecs, err)
			return
		}
		r.lg.Info("membership: deregistered", "key", r.key)
	})
	return r.closeErr
}

func (r *Registration) setID(cluster string, id uint32) error {
	r.member.ReplicaID = id
	r.key = MemberKey(cluster, r.member.Stage, id)
	b, err := json.Marshal(r.member)
	if err != nil {
		return fmt.Errorf("membership: encode record: %w", err)
	}
	r.value = string(b)
	return nil
}

// create writes the record under lease if the key is absent. When it is
// not, it returns the holder's addr.
func (r *Registration) create(ctx context.Context, lease clientv3.LeaseID) (ok bool, holder string, err error) {
	resp, err := r.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(r.key), "=", 0)).
		Then(clientv3.OpPut(r.key, r.value, clientv3.WithLease(lease))).
		Else(clientv3.OpGet(r.key)).
		Commit()
	if err != nil {
		return false, "", fmt.Errorf("membership: register %s: %w", r.key, err)
	}
	if resp.Succeeded {
		return true, "", nil
	}
	return false, holderAddr(resp.Responses), nil
}

// holderAddr reads the addr from the Get answered in a txn's else branch.
func holderAddr(resps []*etcdserverpb.ResponseOp) string {
	for _, op := range resps {
		rr := op.GetResponseRange()
		if rr == nil || len(rr.Kvs) == 0 {
			continue
		}
		var m Member
		if err := json.Unmarshal(rr.Kvs[0].Value, &m); err == nil && m.Addr != "" {
			return m.Addr
		}
		return "an unreadable record"
	}
	return "an unknown holder" // deleted between the compare and the get: cannot happen in one txn
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

// run keeps the lease alive and re-registers when it is lost, until ctx
// ends. It is the only sender on r.events and closes it on return.
func (r *Registration) run(ctx context.Context, lease clientv3.LeaseID) {
	defer close(r.done)
	defer close(r.events)
	ttl := time.Duration(r.ttlSecs) * time.Second
	// A keepalive that ends at once, again and again (the client's lease
	// stream halted for good), must not turn into a hot re-register loop.
	again := newBackoff(500*time.Millisecond, 30*time.Second)
	for {
		started := time.Now()
		r.keepAlive(ctx, lease)
		if ctx.Err() != nil {
			return
		}
		if r.cli.Ctx().Err() != nil {
			r.lg.Error("membership: etcd client closed; registration stops", "key", r.key)
			return
		}
		r.lg.Warn("membership: lease lost; re-registering", "key", r.key, "lease", fmt.Sprintf("%x", int64(lease)))
		r.emit(RegistrationEvent{Type: LeaseLost, Lease: lease})
		r.mu.Lock()
		r.stale = lease
		r.mu.Unlock()
		if time.Since(started) >= ttl {
			again.reset(500 * time.Millisecond)
		} else if !again.sleep(ctx) {
			return
		}
		next, ok := r.reregister(ctx, lease)
		if !ok {
			return
		}
		lease = next
	}
}

// keepAlive returns when the lease is no longer refreshed or ctx ends.
// Meanwhile it checks the record every third of the TTL: one deleted or
// overwritten by someone else (an operator's etcdctl, a stray script) is
// written back, since the head stops routing to a replica whose record is
// gone. (A watch on the key would notice sooner, but a watch stream on the
// same client was seen to hold back the lease's keepalive answers.)
func (r *Registration) keepAlive(ctx context.Context, lease clientv3.LeaseID) {
	kac, err := r.cli.KeepAlive(ctx, lease)
	if err != nil {
		return
	}
	check := time.NewTicker(max(time.Duration(r.ttlSecs)*time.Second/3, 500*time.Millisecond))
	defer check.Stop()
	// Drain: the client closes kac when the lease expires, is revoked, or
	// no answer came within the TTL. It may miss closing kac when the
	// client is closed while KeepAlive runs (clientv3 v3.7), hence the
	// other two cases.
	for {
		select {
		case _, ok := <-kac:
			if !ok {
				return
			}
		case <-check.C:
			r.checkRecord(ctx, lease)
		case <-ctx.Done():
			return
		case <-r.cli.Ctx().Done():
			return
		}
	}
}

// checkRecord reads the record and guards it.
func (r *Registration) checkRecord(ctx context.Context, lease clientv3.LeaseID) {
	gctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	got, err := r.cli.Get(gctx, r.key)
	cancel()
	switch {
	case err != nil:
		return // etcd unreachable: the keepalive tells
	case len(got.Kvs) == 0:
		r.guard(ctx, lease, []*clientv3.Event{{Type: clientv3.EventTypeDelete, Kv: &mvccpb.KeyValue{Key: []byte(r.key)}}})
	default:
		r.guard(ctx, lease, []*clientv3.Event{{Type: clientv3.EventTypePut, Kv: got.Kvs[0]}})
	}
}

// guard writes the record back when an event shows it deleted, or
// overwritten without a lease or under this registration's lease (by an
// operator, say). A record under another live lease is another holder's
// and is left alone, as Register leaves it. A deletion by
// the lease's own expiry fails to restore (the lease is gone), and the
// keepalive then ends as usual.
func (r *Registration) guard(ctx context.Context, lease clientv3.LeaseID, events []*clientv3.Event) {
	for _, ev := range events {
		var cond clientv3.Cmp
		switch {
		case ev.Type == clientv3.EventTypeDelete:
			cond = clientv3.Compare(clientv3.CreateRevision(r.key), "=", 0)
		case ev.Kv.Lease != 0 && clientv3.LeaseID(ev.Kv.Lease) != lease:
			// Another holder under its own lease: never overwritten (see
			// Register); if our lease goes, re-registration waits for it.
			r.lg.Error("membership: record taken over by another lease while ours lives; not overwriting it", "key", r.key, "holder_lease", fmt.Sprintf("%x", ev.Kv.Lease))
			continue
		case string(ev.Kv.Value) != r.value || clientv3.LeaseID(ev.Kv.Lease) != lease:
			cond = clientv3.Compare(clientv3.ModRevision(r.key), "=", ev.Kv.ModRevision)
		default:
			continue // our own write
		}
		what := map[bool]string{true: "deleted", false: "overwritten"}[ev.Type == clientv3.EventTypeDelete]
		actx, cancel := context.WithTimeout(ctx, 5*time.Second)
		resp, err := r.cli.Txn(actx).If(cond).Then(clientv3.OpPut(r.key, r.value, clientv3.WithLease(lease))).Commit()
		cancel()
		switch {
		case err != nil:
			r.lg.Debug("membership: could not restore record", "key", r.key, "err", err)
		case resp.Succeeded:
			r.lg.Warn("membership: record "+what+" by someone else while the lease lived; restored", "key", r.key)
			r.emit(RegistrationEvent{Type: Restored, Lease: lease})
		}
	}
}

// reregister writes the record again under a new lease, retrying with
// backoff until it succeeds or ctx ends. It takes the key over when the
// old lease still holds it (for example after etcd restarted and restored
// the lease); it never overwrites another holder.
func (r *Registration) reregister(ctx context.Context, old clientv3.LeaseID) (clientv3.LeaseID, bool) {
	// The first try is at once and the backoff stays short: while the
	// record is gone, heads keep routing to this replica only for a grace.
	wait := newBackoff(100*time.Millisecond, time.Second)
	var lastWarn time.Time
	warn := func(msg string, args ...any) {
		if time.Since(lastWarn) < 30*time.Second {
			r.lg.Debug(msg, args...)
			return
		}
		lastWarn = time.Now()
		r.lg.Warn(msg, args...)
	}
	attemptTimeout := max(time.Duration(r.ttlSecs)*time.Second, 5*time.Second)
	for {
		if lease, ok, holder, err := r.reregisterOnce(ctx, old, attemptTimeout); err == nil && ok {
			r.lg.Info("membership: re-registered", "key", r.key, "lease", fmt.Sprintf("%x", int64(lease)))
			r.emit(RegistrationEvent{Type: Reregistered, Lease: lease})
			return lease, true
		} else if err == nil {
			warn("membership: replica id held by another record; retrying", "key", r.key, "holder", holder)
			r.emit(RegistrationEvent{Type: ReregisterBlocked, Holder: holder})
		} else if ctx.Err() == nil {
			warn("membership: re-register failed; retrying", "key", r.key, "err", err)
		}
		if r.cli.Ctx().Err() != nil {
			r.lg.Error("membership: etcd client closed; registration stops", "key", r.key)
			return clientv3.NoLease, false
		}
		if !wait.sleep(ctx) {
			return clientv3.NoLease, false
		}
	}
}

func (r *Registration) reregisterOnce(ctx context.Context, old clientv3.LeaseID, timeout time.Duration) (lease clientv3.LeaseID, ok bool, holder string, err error) {
	actx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	grant, err := r.cli.Grant(actx, r.ttlSecs)
	if err != nil {
		return 0, false, "", fmt.Errorf("grant lease: %w", err)
	}
	lease = grant.ID
	r.mu.Lock()
	r.lease = lease // Close revokes it even if we stop half-way
	r.mu.Unlock()
	put := clientv3.OpPut(r.key, r.value, clientv3.WithLease(lease))
	resp, err := r.cli.Txn(actx).
		If(clientv3.Compare(clientv3.CreateRevision(r.key), "=", 0)).
		Then(put).
		Else(clientv3.OpTxn(
			[]clientv3.Cmp{clientv3.Compare(clientv3.LeaseValue(r.key), "=", int64(old))},
			[]clientv3.Op{put},
			[]clientv3.Op{clientv3.OpGet(r.key)},
		)).
		Commit()
	if err == nil {
		ok = resp.Succeeded
		if !ok {
			inner := resp.Responses[0].GetResponseTxn()
			ok = inner.GetSucceeded()
			if !ok {
				holder = holderAddr(inner.GetResponses())
			}
		}
	}
	if err != nil || !ok {
		r.revoke(ctx, lease)
		if err != nil {
			return 0, false, "", fmt.Errorf("write record: %w", err)
		}
		return 0, false, holder, nil
	}
	// The record is ours under the new lease: drop the old one, which may
	// still be alive on the server (it no longer holds the key).
	r.revoke(ctx, old)
	r.mu.Lock()
	r.stale = clientv3.NoLease
	r.mu.Unlock()
	return lease, true, "", nil
}

// revoke is a best-effort revoke bounded by closeRevokeTimeout.
func (r *Registration) revoke(ctx context.Context, lease clientv3.LeaseID) {
	rctx, cancel := context.WithTimeout(ctx, closeRevokeTimeout)
	defer cancel()
	_, _ = r.cli.Revoke(rctx, lease)
}

// emit sends without blocking: a slow reader loses events, the keepalive
// never waits.
func (r *Registration) emit(ev RegistrationEvent) {
	select {
	case r.events <- ev:
	default:
		r.lg.Debug("membership: registration event dropped; reader is behind", "type", ev.Type.String())
	}
}

// backoff is an exponential backoff with full jitter between d/2 and d.
type backoff struct {
	next, max time.Duration
}

func newBackoff(initial, maxDelay time.Duration) *backoff {
	return &backoff{next: initial, max: maxDelay}
}

// sleep waits the next delay; false when ctx ended first.
func (b *backoff) sleep(ctx context.Context) bool {
	d := b.next/2 + rand.N(b.next/2+1)
	b.next = min(b.next*2, b.max)
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

func (b *backoff) reset(initial time.Duration) { b.next = initial }
