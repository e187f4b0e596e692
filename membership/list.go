package membership

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Listed is one record found by List.
type Listed struct {
	Key    string
	Member Member // zero when Invalid is set
	// Invalid says why the record cannot be used (bad JSON, key mismatch).
	Invalid error
	Lease   clientv3.LeaseID // NoLease when the key has none
	// TTLLeft is the lease's remaining time; -1 when the key has no lease
	// or the lease is gone.
	TTLLeft        time.Duration
	CreateRevision int64
	ModRevision    int64
}

// List reads every record of a cluster (one linearizable read) and the
// remaining TTL of their leases, sorted by stage and replica id; invalid
// records come last, by key.
func List(ctx context.Context, cli *clientv3.Client, cluster string) ([]Listed, error) {
	if cluster == "" {
		cluster = DefaultCluster
	}
	if err := ValidateCluster(cluster); err != nil {
		return nil, err
	}
	prefix := MembersPrefix(cluster)
	resp, err := cli.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("membership: list %s: %w", prefix, err)
	}
	out := make([]Listed, 0, len(resp.Kvs))
	ttls := map[clientv3.LeaseID]time.Duration{}
	for _, kv := range resp.Kvs {
		l := Listed{
			Key:            string(kv.Key),
			Lease:          clientv3.LeaseID(kv.Lease),
			TTLLeft:        -1,
			CreateRevision: kv.CreateRevision,
			ModRevision:    kv.ModRevision,
		}
		l.Member, l.Invalid = DecodeMember(cluster, l.Key, kv.Value)
		if l.Lease != clientv3.NoLease {
			ttl, ok := ttls[l.Lease]
			if !ok {
				ttl = -1
				tr, err := cli.TimeToLive(ctx, l.Lease)
				if err != nil && ctx.Err() != nil {
					return nil, fmt.Errorf("membership: lease TTL: %w", err)
				}
				if err == nil && tr.TTL >= 0 {
					ttl = time.Duration(tr.TTL) * time.Second
				}
				ttls[l.Lease] = ttl
			}
			l.TTLLeft = ttl
		}
		out = append(out, l)
	}
	slices.SortFunc(out, func(a, b Listed) int {
		if (a.Invalid != nil) != (b.Invalid != nil) {
			if a.Invalid != nil {
				return 1
			}
			return -1
		}
		if a.Invalid != nil {
			return cmp.Compare(a.Key, b.Key)
		}
		return cmp.Or(cmp.Compare(a.Member.Stage, b.Member.Stage), cmp.Compare(a.Member.ReplicaID, b.Member.ReplicaID))
	})
	return out, nil
}
