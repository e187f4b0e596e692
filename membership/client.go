package membership

import (
	"context"
	"errors"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// ClientConfig says how to reach etcd; it mirrors etcdctl's flags.
type ClientConfig struct {
	Endpoints   []string
	CACert      string // --etcd-cacert
	Cert        string // --etcd-cert
	Key         string // --etcd-key
	Username    string // --etcd-user
	Password    string // --etcd-password
	DialTimeout time.Duration
}

// Dial connects to etcd and checks, within a bounded time, that it answers.
// PLACEHOLDER: replaced by the membership issue.
func Dial(ctx context.Context, cfg ClientConfig) (*clientv3.Client, error) {
	return nil, errors.New("membership: dial not implemented")
}
