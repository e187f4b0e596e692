package main

import (
	"flag"
	"time"

	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/membership/embedetcd"
)

// etcdFlags are the etcd client flags shared by head, worker and members.
type etcdFlags struct {
	endpoints, cacert, cert, key, user, password string
	dialTimeout                                  time.Duration
}

func addEtcdFlags(fs *flag.FlagSet) *etcdFlags {
	f := &etcdFlags{}
	fs.StringVar(&f.endpoints, "etcd-endpoints", embedetcd.DefaultClientURL, "comma-separated etcd client URLs")
	fs.StringVar(&f.cacert, "etcd-cacert", "", "CA bundle to verify etcd's certificate")
	fs.StringVar(&f.cert, "etcd-cert", "", "client certificate for etcd")
	fs.StringVar(&f.key, "etcd-key", "", "client key for etcd")
	fs.StringVar(&f.user, "etcd-user", "", "etcd user name (or user:password)")
	fs.StringVar(&f.password, "etcd-password", "", "etcd password")
	fs.DurationVar(&f.dialTimeout, "etcd-dial-timeout", membership.DefaultDialTimeout, "how long to wait for etcd at start-up")
	return f
}

func (f *etcdFlags) config() membership.ClientConfig {
	return membership.ClientConfig{
		Endpoints:   splitList(f.endpoints),
		CACert:      f.cacert,
		Cert:        f.cert,
		Key:         f.key,
		Username:    f.user,
		Password:    f.password,
		DialTimeout: f.dialTimeout,
	}
}
