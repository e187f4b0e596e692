package membership

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// leased keeps one record in etcd under a lease: the keepalive, the
// re-registration when the lease is lost, updates of the value, and Close.
// A replica's Registration and a head's HeadRegistration are both leased
// records; only their keys, values and first write differ.
//
// After the first write, the run goroutine is the only writer of the key:
// an update changes the value in memory and wakes run, which writes the
// latest value under the current lease, so a re-registration can never
// write an older value after a newer one.
type leased struct {
	cli     *clientv3.Client
	key     string
	ttlSecs int64
	lg      *slog.Logger

	events chan RegistrationEvent // written by run only; closed when run ends
	stop   context.CancelFunc     // stops run
	done   chan struct{}          // closed when run has ended
	dirty  chan struct{}          // capacity 1: the value changed, run writes it

	mu           sync.Mutex
	value        string           // the record as it should be in etcd
	version      uint64           // bumped by every change of value
	written      uint64           // the version etcd holds (under lease)
	writtenValue string           // the value of version written
	wrote        chan struct{}    // closed and replaced whenever written changes
	lease        clientv3.LeaseID // the lease the record is (or is being) written under
	stale        clientv3.LeaseID // a lost lease that may still hold the record

	// answered is when etcd last confirmed the lease (its grant or write,
	// or a keepalive answer), in Unix nanoseconds; see LastKeepAlive.
	answered atomic.Int64

	closeOnce sync.Once
	closeErr  error
}

// newLeased prepares a record; nothing is written until create.
func newLeased(cli *clientv3.Client, ttl time.Duration, lg *slog.Logger) (*leased, error) {
	if ttl == 0 {
		ttl = DefaultTTL
	}
	if ttl < time.Second {
		return nil, fmt.Errorf("membership: lease TTL %v is below 1s", ttl)
	}
	if lg == nil {
		lg = slog.Default()
	}
	return &leased{
		cli:     cli,
		ttlSecs: int64(math.Ceil(ttl.Seconds())),
		lg:      lg,
		events:  make(chan RegistrationEvent, 16),
		done:    make(chan struct{}),
		dirty:   make(chan struct{}, 1),
		wrote:   make(chan struct{}),
		version: 1,
	}, nil
}

// setRecord sets the key and the first value, before anything is written.
func (r *leased) setRecord(key string, record any) error {
	b, err := json.Marshal(record)
	if err != nil {
		return fmt.Errorf("membership: encode record: %w", err)
	}
	r.key, r.value = key, string(b)
	return nil
}

// start begins the keepalive of a record just created under lease.
func (r *leased) start(lease clientv3.LeaseID, grantedTTL int64, attrs ...any) {
	r.lease = lease
	r.written, r.writtenValue = r.version, r.value
	r.answered.Store(time.Now().UnixNano())
	runCtx, stop := context.WithCancel(context.Background())
	r.stop = stop
	go r.run(runCtx, lease)
	r.lg.Info("membership: registered", append([]any{"key", r.key}, append(attrs,
		"lease", fmt.Sprintf("%x", int64(lease)), "ttl", time.Duration(grantedTTL)*time.Second)...)...)
}

// LastKeepAlive is when etcd last confirmed the registration's lease: its
// grant, or the latest keepalive answer (the client asks every third of
// the TTL). Healthy, it is within about a third of the TTL of now; a lease
// silent for the whole TTL has expired in etcd.
func (r *leased) LastKeepAlive() time.Time { return time.Unix(0, r.answered.Load()) }

// Key returns the etcd key of the record.
func (r *leased) Key() string { return r.key }

// Lease returns the lease the record is currently written under.
func (r *leased) Lease() clientv3.LeaseID {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.lease
}

// Events reports lease losses and re-registrations. It is buffered; when
// the reader falls behind, new events are dropped rather than delaying the
// keepalive. It is closed once the registration has stopped (after Close,
// or when the etcd client is closed).
func (r *leased) Events() <-chan RegistrationEvent { return r.events }

// Close stops the keepalive and revokes the lease, so the record is gone at
// once and watchers see the leave. The revoke is bounded by ctx and by 2s;
// when etcd does not answer, Close returns an error and the record goes
// when the lease expires. Only the first call does anything.
func (r *leased) Close(ctx context.Context) error {
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

// setValueLocked replaces the value; r.mu must be held. It returns the
// version to wait for and whether etcd does not hold it yet, in which case
// the caller wakes run once it released r.mu.
func (r *leased) setValueLocked(record any) (want uint64, pending bool, err error) {
	b, err := json.Marshal(record)
	if err != nil {
		return 0, false, fmt.Errorf("membership: encode record: %w", err)
	}
	if string(b) != r.value {
		r.value = string(b)
		r.version++
	}
	return r.version, r.written < r.version, nil
}

// waitWritten waits until etcd holds version want (or a newer one), the
// registration stops, or ctx ends.
func (r *leased) waitWritten(ctx context.Context, want uint64) error {
	for {
		r.mu.Lock()
		written, wrote := r.written, r.wrote
		r.mu.Unlock()
		if written >= want {
			return nil
		}
		select {
		case <-wrote:
		case <-r.done:
			return fmt.Errorf("membership: update %s: the registration has stopped", r.key)
		case <-ctx.Done():
			return fmt.Errorf("membership: update %s: not written yet (it will be once etcd answers): %w", r.key, ctx.Err())
		}
	}
}

// current returns the value to write and its version.
func (r *leased) current() (string, uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.value, r.version
}

// markWritten records that etcd holds version v, whose value is value.
func (r *leased) markWritten(v uint64, value string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if v <= r.written {
		return
	}
	r.written, r.writtenValue = v, value
	close(r.wrote)
	r.wrote = make(chan struct{})
}

// create writes value under lease if the key is absent. When it is not, it
// returns the holder's addr.
func (r *leased) create(ctx context.Context, lease clientv3.LeaseID) (ok bool, holder string, err error) {
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
// Replica and head records both name it "addr".
func holderAddr(resps []*etcdserverpb.ResponseOp) string {
	for _, op := range resps {
		rr := op.GetResponseRange()
		if rr == nil || len(rr.Kvs) == 0 {
			continue
		}
		return recordAddr(rr.Kvs[0].Value)
	}
	return "an unknown holder" // deleted between the compare and the get: cannot happen in one txn
}

// recordAddr is the addr a record names, as a refusal reports it.
func recordAddr(value []byte) string {
	var rec struct {
		Addr string `json:"addr"`
	}
	if err := json.Unmarshal(value, &rec); err == nil && rec.Addr != "" {
		return rec.Addr
	}
	return "an unreadable record"
}

// run keeps the lease alive and re-registers when it is lost, until ctx
// ends. It is the only sender on r.events and closes it on return.
func (r *leased) run(ctx context.Context, lease clientv3.LeaseID) {
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
			again.Reset()
		} else if !sleep(ctx, again) {
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
// Meanwhile it writes updated values and guards the record: one deleted or
// overwritten by someone else (an operator's etcdctl) is written back, since
// the head stops routing to a replica whose record is gone. The guard is a
// watch on the key plus one read once the watch is created (and after it
// breaks), so that at rest a record costs etcd its keepalives alone. A watch
// that holds back or breaks delays only the guard: the keepalive's own
// deadline (below) still ends a lease that goes unanswered.
func (r *leased) keepAlive(ctx context.Context, lease clientv3.LeaseID) {
	kac, err := r.cli.KeepAlive(ctx, lease)
	if err != nil {
		return
	}
	// An update that arrived during a re-registration may be newer than
	// what it wrote.
	if _, v := r.current(); v > r.writtenVersion() {
		r.wake()
	}
	// Watch blocks until the client's watch stream is up, which it is not
	// while etcd is down: it is opened off this loop, which must keep
	// draining the keepalive and watching its deadline.
	wctx, stopWatch := context.WithCancel(ctx)
	var opening sync.WaitGroup
	defer opening.Wait()
	defer stopWatch()
	opened := make(chan clientv3.WatchChan, 1)
	var guarded clientv3.WatchChan // nil until watching, and while a re-watch waits
	stopGuard := context.CancelFunc(func() {})
	rewatch := time.NewTimer(0)
	defer rewatch.Stop()
	rewatchWait := newBackoff(500*time.Millisecond, max(time.Duration(r.ttlSecs)*time.Second/3, 500*time.Millisecond))
	retry := time.NewTimer(time.Hour)
	retry.Stop()
	defer retry.Stop()
	wait := newBackoff(100*time.Millisecond, 5*time.Second)
	write := func() {
		err := r.write(ctx, lease)
		if errors.Is(err, errNotOurs) {
			// Deleted or overwritten: restore it (never over another live
			// holder), which writes the latest value.
			r.checkRecord(ctx, lease)
			if _, v := r.current(); v <= r.writtenVersion() {
				err = nil
			}
		}
		switch {
		case err == nil:
			wait.Reset()
		case ctx.Err() == nil:
			r.lg.Warn("membership: update of the record failed; retrying", "key", r.key, "err", err)
			retry.Reset(wait.NextBackOff())
		}
	}
	// Drain: the client closes kac when the lease expires, is revoked, or
	// no answer came within the TTL. It may miss closing kac when the
	// client is closed while KeepAlive runs (clientv3 v3.7), hence the
	// other two cases, and it can fail to close it while a write is
	// pending with etcd down, hence our own deadline: no answer for
	// twice the TTL (and a second) is a lost lease.
	// A lease that in fact lived is taken over by the re-registration.
	silence := 2*time.Duration(r.ttlSecs)*time.Second + time.Second
	deadline := time.NewTimer(silence)
	defer deadline.Stop()
	for {
		select {
		case _, ok := <-kac:
			if !ok {
				return
			}
			r.answered.Store(time.Now().UnixNano())
			deadline.Reset(silence)
		case <-deadline.C:
			r.lg.Warn("membership: no keepalive answer for twice the TTL; treating the lease as lost", "key", r.key)
			return
		case <-r.dirty:
			write()
		case <-retry.C:
			write()
		case <-rewatch.C:
			// Watch from now, then (once created) read and guard what the
			// read shows: a change before the watch is in the read, a
			// change after it comes through the watch. A watch from a
			// past revision would wait for etcd's resync of slow
			// watchers, of which a registration storm makes thousands.
			gctx, cancel := context.WithCancel(wctx)
			stopGuard = cancel
			opening.Go(func() { opened <- r.cli.Watch(gctx, r.key, clientv3.WithCreatedNotify()) })
		case guarded = <-opened:
		case wresp, ok := <-guarded:
			if !ok || wresp.Err() != nil {
				// Compacted, cancelled by etcd, or the client's watch
				// ended: watch and read anew, backed off.
				stopGuard()
				guarded = nil
				rewatch.Reset(rewatchWait.NextBackOff())
				continue
			}
			if wresp.Created {
				if !r.checkRecord(ctx, lease) && ctx.Err() == nil {
					// etcd unreachable: the keepalive tells; watch
					// and read anew, backed off.
					stopGuard()
					guarded = nil
					rewatch.Reset(rewatchWait.NextBackOff())
				}
				continue
			}
			rewatchWait.Reset()
			if len(wresp.Events) > 0 {
				r.guard(ctx, lease, wresp.Events)
			}
		case <-ctx.Done():
			return
		case <-r.cli.Ctx().Done():
			return
		}
	}
}

// wake asks run to write the latest value; a pending wake-up is enough.
func (r *leased) wake() {
	select {
	case r.dirty <- struct{}{}:
	default:
	}
}

func (r *leased) writtenVersion() uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.written
}

// errNotOurs: the key is absent or not under our lease.
var errNotOurs = errors.New("membership: record not under our lease")

// write puts the latest value under lease if the key is still ours.
func (r *leased) write(ctx context.Context, lease clientv3.LeaseID) error {
	value, v := r.current()
	if v <= r.writtenVersion() {
		return nil
	}
	wctx, cancel := context.WithTimeout(ctx, max(time.Duration(r.ttlSecs)*time.Second, 5*time.Second))
	defer cancel()
	resp, err := r.cli.Txn(wctx).
		If(clientv3.Compare(clientv3.LeaseValue(r.key), "=", int64(lease))).
		Then(clientv3.OpPut(r.key, value, clientv3.WithLease(lease))).
		Commit()
	if err != nil {
		return fmt.Errorf("membership: update %s: %w", r.key, err)
	}
	if !resp.Succeeded {
		return errNotOurs
	}
	r.markWritten(v, value)
	r.lg.Debug("membership: record updated", "key", r.key)
	return nil
}

// checkRecord reads the record and guards it; false when etcd did not
// answer.
func (r *leased) checkRecord(ctx context.Context, lease clientv3.LeaseID) bool {
	gctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	got, err := r.cli.Get(gctx, r.key)
	cancel()
	switch {
	case err != nil:
		return false // etcd unreachable: the keepalive tells
	case len(got.Kvs) == 0:
		r.guard(ctx, lease, []*clientv3.Event{{Type: clientv3.EventTypeDelete, Kv: &mvccpb.KeyValue{Key: []byte(r.key)}}})
	default:
		r.guard(ctx, lease, []*clientv3.Event{{Type: clientv3.EventTypePut, Kv: got.Kvs[0]}})
	}
	return true
}

// guard writes the record back when an event shows it deleted, or
// overwritten without a lease or under this registration's lease (by an
// operator, say). A record under another live lease is another holder's
// and is left alone, as Register leaves it. A deletion by
// the lease's own expiry fails to restore (the lease is gone), and the
// keepalive then ends as usual.
func (r *leased) guard(ctx context.Context, lease clientv3.LeaseID, events []*clientv3.Event) {
	value, version := r.current()
	r.mu.Lock()
	ours := r.writtenValue
	r.mu.Unlock()
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
		case string(ev.Kv.Value) == value && clientv3.LeaseID(ev.Kv.Lease) == lease:
			r.markWritten(version, value) // our own latest write
			continue
		case string(ev.Kv.Value) == ours && clientv3.LeaseID(ev.Kv.Lease) == lease:
			r.wake() // our own older write; an update is on its way
			continue
		default:
			cond = clientv3.Compare(clientv3.ModRevision(r.key), "=", ev.Kv.ModRevision)
		}
		what := map[bool]string{true: "deleted", false: "overwritten"}[ev.Type == clientv3.EventTypeDelete]
		actx, cancel := context.WithTimeout(ctx, 5*time.Second)
		resp, err := r.cli.Txn(actx).If(cond).Then(clientv3.OpPut(r.key, value, clientv3.WithLease(lease))).Commit()
		cancel()
		switch {
		case err != nil:
			r.lg.Debug("membership: could not restore record", "key", r.key, "err", err)
		case resp.Succeeded:
			r.markWritten(version, value)
			r.lg.Warn("membership: record "+what+" by someone else while the lease lived; restored", "key", r.key)
			r.emit(RegistrationEvent{Type: Restored, Lease: lease})
		}
	}
}

// reregister writes the record again under a new lease, retrying with
// backoff until it succeeds or ctx ends. It takes the key over when the
// old lease still holds it (for example after etcd restarted and restored
// the lease); it never overwrites another holder.
func (r *leased) reregister(ctx context.Context, old clientv3.LeaseID) (clientv3.LeaseID, bool) {
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
			r.answered.Store(time.Now().UnixNano())
			r.lg.Info("membership: re-registered", "key", r.key, "lease", fmt.Sprintf("%x", int64(lease)))
			r.emit(RegistrationEvent{Type: Reregistered, Lease: lease})
			return lease, true
		} else if err == nil {
			warn("membership: key held by another record; retrying", "key", r.key, "holder", holder)
			r.emit(RegistrationEvent{Type: ReregisterBlocked, Holder: holder})
		} else if ctx.Err() == nil {
			warn("membership: re-register failed; retrying", "key", r.key, "err", err)
		}
		if r.cli.Ctx().Err() != nil {
			r.lg.Error("membership: etcd client closed; registration stops", "key", r.key)
			return clientv3.NoLease, false
		}
		if !sleep(ctx, wait) {
			return clientv3.NoLease, false
		}
	}
}

func (r *leased) reregisterOnce(ctx context.Context, old clientv3.LeaseID, timeout time.Duration) (lease clientv3.LeaseID, ok bool, holder string, err error) {
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
	value, version := r.current()
	put := clientv3.OpPut(r.key, value, clientv3.WithLease(lease))
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
	r.markWritten(version, value)
	// The record is ours under the new lease: drop the old one, which may
	// still be alive on the server (it no longer holds the key).
	r.revoke(ctx, old)
	r.mu.Lock()
	r.stale = clientv3.NoLease
	r.mu.Unlock()
	return lease, true, "", nil
}

// revoke is a best-effort revoke bounded by closeRevokeTimeout.
func (r *leased) revoke(ctx context.Context, lease clientv3.LeaseID) {
	rctx, cancel := context.WithTimeout(ctx, closeRevokeTimeout)
	defer cancel()
	_, _ = r.cli.Revoke(rctx, lease)
}

// emit sends without blocking: a slow reader loses events, the keepalive
// never waits.
func (r *leased) emit(ev RegistrationEvent) {
	select {
	case r.events <- ev:
	default:
		r.lg.Debug("membership: registration event dropped; reader is behind", "type", ev.Type.String())
	}
}
