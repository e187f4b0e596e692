package membership

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Listed is one record found by List (a Member) or ListHeads (a Head).
type Listed[R Member | Head] struct {
	Key    string
	Record R // zero when Invalid is set
	// Invalid says why the record cannot be used (bad JSON, key mismatch).
	Invalid error
	Lease   clientv3.LeaseID // NoLease when the key has none
	// TTLLeft is the lease's remaining time; -1 when the key has no lease
	// or the lease is gone.
	TTLLeft time.Duration
	// TTL is the lease's granted TTL (what the holder asked for, e.g.
	// --lease-ttl); -1 like TTLLeft.
	TTL            time.Duration
	CreateRevision int64
	ModRevision    int64
}

// List reads every member record of a cluster (one linearizable read) and
// the remaining TTL of their leases, sorted by stage and replica id;
// invalid records come last, by key.
func List(ctx context.Context, cli *clientv3.Client, cluster string) ([]Listed[Member], error) {
	return list(ctx, cli, cluster, MembersPrefix, DecodeMember, func(a, b Member) int {
		return cmp.Or(cmp.Compare(a.Stage, b.Stage), cmp.Compare(a.ReplicaID, b.ReplicaID))
	})
}

// ListHeads reads every head record of a cluster (one linearizable read)
// and the remaining TTL of their leases, sorted by id; invalid records come
// last, by key.
func ListHeads(ctx context.Context, cli *clientv3.Client, cluster string) ([]Listed[Head], error) {
	return list(ctx, cli, cluster, HeadsPrefix, DecodeHead, func(a, b Head) int { return cmp.Compare(a.ID, b.ID) })
}

// list reads the records under prefix(cluster), decodes each against its
// key, and sorts the valid ones by order (then key) before the invalid
// ones (by key).
func list[R Member | Head](ctx context.Context, cli *clientv3.Client, cluster string,
	prefix func(cluster string) string, decode func(cluster, key string, value []byte) (R, error), order func(a, b R) int,
) ([]Listed[R], error) {
	if cluster == "" {
		cluster = DefaultCluster
	}
	if err := ValidateCluster(cluster); err != nil {
		return nil, err
	}
	p := prefix(cluster)
	resp, err := cli.Get(ctx, p, clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("membership: list %s: %w", p, err)
	}
	out := make([]Listed[R], 0, len(resp.Kvs))
	ttls := leaseTTLs{cli: cli, known: map[clientv3.LeaseID][2]time.Duration{}}
	for _, kv := range resp.Kvs {
		l := Listed[R]{
			Key:            string(kv.Key),
			Lease:          clientv3.LeaseID(kv.Lease),
			CreateRevision: kv.CreateRevision,
			ModRevision:    kv.ModRevision,
		}
		l.Record, l.Invalid = decode(cluster, l.Key, kv.Value)
		if l.TTLLeft, l.TTL, err = ttls.left(ctx, l.Lease); err != nil {
			return nil, err
		}
		out = append(out, l)
	}
	slices.SortFunc(out, func(a, b Listed[R]) int {
		if (a.Invalid != nil) != (b.Invalid != nil) {
			if a.Invalid != nil {
				return 1
			}
			return -1
		}
		if a.Invalid != nil {
			return cmp.Compare(a.Key, b.Key)
		}
		return cmp.Or(order(a.Record, b.Record), cmp.Compare(a.Key, b.Key))
	})
	return out, nil
}

// leaseTTLs asks each lease's remaining and granted time once per listing.
type leaseTTLs struct {
	cli   *clientv3.Client
	known map[clientv3.LeaseID][2]time.Duration
}

// left is the lease's remaining time and its granted TTL, -1 each for no
// lease or a lease that is gone. It fails only when ctx ended.
func (t leaseTTLs) left(ctx context.Context, lease clientv3.LeaseID) (left, granted time.Duration, err error) {
	if lease == clientv3.NoLease {
		return -1, -1, nil
	}
	if k, ok := t.known[lease]; ok {
		return k[0], k[1], nil
	}
	left, granted = -1, -1
	tr, err := t.cli.TimeToLive(ctx, lease)
	if err != nil && ctx.Err() != nil {
		return 0, 0, fmt.Errorf("membership: lease TTL: %w", err)
	}
	if err == nil && tr.TTL >= 0 {
		left, granted = time.Duration(tr.TTL)*time.Second, time.Duration(tr.GrantedTTL)*time.Second
	}
	t.known[lease] = [2]time.Duration{left, granted}
	return left, granted, nil
}
