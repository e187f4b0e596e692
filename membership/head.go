package membership

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Head is the record a head writes under its lease at
// /troupe/<cluster>/heads/<id>. It is informational: heads do not watch
// each other, every head serves the whole API on its own.
type Head struct {
	ID        string    `json:"id"`
	Addr      string    `json:"addr"` // host:port of its HTTP API
	Version   string    `json:"version"`
	StartedAt time.Time `json:"started_at"`
}

// Validate reports what is wrong with a head record, if anything.
func (h Head) Validate() error {
	switch {
	case !validName(h.ID):
		return fmt.Errorf("membership: invalid head id %q (want 1 to 128 of A-Z a-z 0-9 . _ -)", h.ID)
	case h.Addr == "":
		return errors.New("membership: head has an empty addr")
	case len(h.Addr) > MaxAddrLen:
		return fmt.Errorf("membership: head addr of %d bytes, at most %d", len(h.Addr), MaxAddrLen)
	case len(h.Version) > MaxFieldLen:
		return fmt.Errorf("membership: head version of %d bytes, at most %d", len(h.Version), MaxFieldLen)
	}
	return validAddr(h.Addr)
}

// HeadsPrefix is the prefix under which every head of a cluster lives.
func HeadsPrefix(cluster string) string { return KeyRoot + cluster + "/heads/" }

// HeadKey is the key of one head.
func HeadKey(cluster, id string) string { return HeadsPrefix(cluster) + id }

// DecodeHead parses and checks a head record against the key it was found at.
func DecodeHead(cluster, key string, value []byte) (Head, error) {
	id, ok := strings.CutPrefix(key, HeadsPrefix(cluster))
	if !ok || !validName(id) {
		return Head{}, fmt.Errorf("membership: malformed head key %q", key)
	}
	if len(value) > MaxRecordBytes {
		return Head{}, fmt.Errorf("membership: head record at %q has %d bytes, at most %d", key, len(value), MaxRecordBytes)
	}
	var h Head
	if err := json.Unmarshal(value, &h); err != nil {
		return Head{}, fmt.Errorf("membership: bad head record at %q: %w", key, err)
	}
	if h.ID != id {
		return Head{}, fmt.Errorf("membership: head record at %q names %q", key, h.ID)
	}
	if err := h.Validate(); err != nil {
		return Head{}, fmt.Errorf("membership: bad head record at %q: %w", key, err)
	}
	return h, nil
}

// HeadConfig configures RegisterHead.
type HeadConfig struct {
	Cluster string        // default DefaultCluster
	Head    Head          // the record
	TTL     time.Duration // lease TTL, default 10s, at least 1s, rounded up to seconds
	Logger  *slog.Logger
}

// HeadRegistration is a head's record under a lease, kept alive and written
// again under a new lease when the old one is lost, until Close: the same
// machinery, rules and events as a replica's Registration. Its methods may
// be called from any goroutine.
type HeadRegistration struct {
	*leased
	head Head
}

// RegisterHead writes the head's record under a fresh lease if its key is
// absent and keeps it alive until Close. A key with a live holder (another
// head with the same id) fails at once with an *AlreadyRegisteredError;
// RegisterHead never overwrites. ctx bounds only the first write.
func RegisterHead(ctx context.Context, cli *clientv3.Client, cfg HeadConfig) (*HeadRegistration, error) {
	if cli == nil {
		return nil, errors.New("membership: register head: nil etcd client")
	}
	cluster := cfg.Cluster
	if cluster == "" {
		cluster = DefaultCluster
	}
	if err := ValidateCluster(cluster); err != nil {
		return nil, err
	}
	if err := cfg.Head.Validate(); err != nil {
		return nil, err
	}
	l, err := newLeased(cli, cfg.TTL, cfg.Logger)
	if err != nil {
		return nil, err
	}
	r := &HeadRegistration{leased: l, head: cfg.Head}
	if err := r.setRecord(HeadKey(cluster, cfg.Head.ID), cfg.Head); err != nil {
		return nil, err
	}
	grant, err := cli.Grant(ctx, r.ttlSecs)
	if err != nil {
		return nil, fmt.Errorf("membership: grant lease: %w", err)
	}
	ok, holder, err := r.create(ctx, grant.ID)
	if err == nil && !ok {
		err = &AlreadyRegisteredError{Head: cfg.Head.ID, Addr: holder}
	}
	if err != nil {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), closeRevokeTimeout)
		defer cancel()
		_, _ = cli.Revoke(rctx, grant.ID)
		return nil, err
	}
	r.start(grant.ID, grant.TTL, "addr", cfg.Head.Addr)
	return r, nil
}

// Head returns the registered record.
func (r *HeadRegistration) Head() Head { return r.head }
