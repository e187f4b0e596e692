package membership

import (
	"context"
	"errors"
	"log/slog"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// ErrAlreadyRegistered is wrapped by Register when a live holder owns the key.
var ErrAlreadyRegistered = errors.New("membership: already registered")

// RegisterConfig configures Register.
type RegisterConfig struct {
	Cluster string        // default DefaultCluster
	Member  Member        // Member.ReplicaID is used unless AutoID
	AutoID  bool          // take the smallest free id of the stage
	TTL     time.Duration // lease TTL, default 10s
	Logger  *slog.Logger
}

// Registration is a live registration. PLACEHOLDER: replaced by the membership issue.
type Registration struct{ m Member }

// Register writes the member record under a fresh lease.
func Register(ctx context.Context, cli *clientv3.Client, cfg RegisterConfig) (*Registration, error) {
	return nil, errors.New("membership: register not implemented")
}

// Member returns the registered record, with its assigned replica id.
func (r *Registration) Member() Member { return r.m }

// Close revokes the lease.
func (r *Registration) Close(ctx context.Context) error { return nil }
