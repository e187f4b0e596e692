package membership

import (
	"context"
	"fmt"
	"net"
	"slices"
	"strconv"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// claim writes the record under lease when the key is absent, or takes it
// over from this replica's previous process (see predecessor). Any other
// holder refuses it with an *AlreadyRegisteredError.
func (r *Registration) claim(ctx context.Context, cluster string, lease clientv3.LeaseID, lis net.Listener) error {
	ok, held, err := r.putIf(ctx, lease, 0)
	if err != nil || ok {
		return err
	}
	if held == nil {
		return r.refused(nil) // cannot happen: the key existed in that txn
	}
	prev, isPrev := r.predecessor(ctx, cluster, held, lis)
	if !isPrev {
		return r.refused(held)
	}
	if r.beforeTakeOver != nil {
		r.beforeTakeOver()
	}
	// Compare-and-swap on what was read: of two processes racing for the
	// key one wins, and a record written since is never replaced unseen.
	// The old lease is not ours to revoke: it expires, holding nothing.
	ok, now, err := r.putIf(ctx, lease, held.ModRevision)
	switch {
	case err != nil:
		return err
	case ok:
		r.lg.Info("membership: took over the record of this replica's previous process at the same addr",
			"key", r.key, "addr", prev.Addr, "previous_started_at", prev.StartedAt,
			"previous_lease", fmt.Sprintf("%x", held.Lease))
		return nil
	case now == nil:
		// The old lease expired in between: the key is free.
		if ok, now, err = r.putIf(ctx, lease, 0); err != nil || ok {
			return err
		}
	}
	return r.refused(now)
}

// putIf writes the record under lease if the key's mod revision is still
// rev (0: the key is absent). Otherwise it returns what the key holds now,
// nil when nothing.
func (r *Registration) putIf(ctx context.Context, lease clientv3.LeaseID, rev int64) (bool, *mvccpb.KeyValue, error) {
	cond := clientv3.Compare(clientv3.ModRevision(r.key), "=", rev)
	if rev == 0 {
		cond = clientv3.Compare(clientv3.CreateRevision(r.key), "=", 0) // as create
	}
	resp, err := r.cli.Txn(ctx).
		If(cond).
		Then(clientv3.OpPut(r.key, r.value, clientv3.WithLease(lease))).
		Else(clientv3.OpGet(r.key)).
		Commit()
	if err != nil {
		return false, nil, fmt.Errorf("membership: register %s: %w", r.key, err)
	}
	if resp.Succeeded {
		return true, nil, nil
	}
	if kvs := resp.Responses[0].GetResponseRange().GetKvs(); len(kvs) > 0 {
		return false, kvs[0], nil
	}
	return false, nil, nil
}

func (r *Registration) refused(held *mvccpb.KeyValue) error {
	holder := "an unknown holder"
	if held != nil {
		holder = recordAddr(held.Value)
	}
	return &AlreadyRegisteredError{Stage: r.member.Stage, ReplicaID: r.member.ReplicaID, Addr: holder}
}

// predecessor reports whether held is the record of this replica's
// previous process: a valid record of the same key and addr, where this
// process holds the listener (lis) that addr reaches. Only one process can
// hold it, so the record's writer no longer serves there (killed, its lease
// not yet expired), and the head's probe of that addr reaches this process.
func (r *Registration) predecessor(ctx context.Context, cluster string, held *mvccpb.KeyValue, lis net.Listener) (Member, bool) {
	if lis == nil {
		return Member{}, false
	}
	prev, err := DecodeMember(cluster, string(held.Key), held.Value)
	if err != nil || prev.Addr != r.member.Addr {
		return Member{}, false
	}
	if err := listensOn(ctx, lis.Addr(), prev.Addr); err != nil {
		r.lg.Warn("membership: a record at this replica's own addr has another lease, and this process's listener does not prove it serves that addr; not taking it over",
			"key", r.key, "addr", prev.Addr, "listener", lis.Addr().String(), "err", err)
		return Member{}, false
	}
	return prev, true
}

// listensOn checks that a listener bound at bound receives what is sent to
// addr: the same port, and every IP addr's host stands for is the bound IP
// or, for a listener on every interface, one of this host's. An addr that
// reaches the listener only through a NAT or a forwarded port (a
// container's published port) cannot be checked, and fails.
func listensOn(ctx context.Context, bound net.Addr, addr string) error {
	tcp, ok := bound.(*net.TCPAddr)
	if !ok {
		return fmt.Errorf("membership: listener %s is not TCP", bound)
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("membership: addr %q: %w", addr, err)
	}
	if port != strconv.Itoa(tcp.Port) {
		return fmt.Errorf("membership: addr %s is not on the listener's port %d", addr, tcp.Port)
	}
	ips, err := net.DefaultResolver.LookupIP(ctx, "ip", host)
	if err != nil {
		return fmt.Errorf("membership: resolve %s: %w", host, err)
	}
	served := []net.IP{tcp.IP}
	if tcp.IP.IsUnspecified() {
		ifaddrs, err := net.InterfaceAddrs()
		if err != nil {
			return fmt.Errorf("membership: this host's addresses: %w", err)
		}
		served = served[:0]
		for _, a := range ifaddrs {
			if n, ok := a.(*net.IPNet); ok {
				served = append(served, n.IP)
			}
		}
	}
	for _, ip := range ips {
		if !slices.ContainsFunc(served, ip.Equal) {
			return fmt.Errorf("membership: addr %s stands for %s, which the listener on %s does not serve", addr, ip, bound)
		}
	}
	return nil
}
