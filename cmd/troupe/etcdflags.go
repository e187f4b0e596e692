package main

import (
	"flag"
	"log/slog"
	"strings"
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

// warnArgvPassword warns when fs took etcd's password from the command
// line (--etcd-password, or --etcd-user user:password), where ps shows
// it to every user of the host; parseFlags leaves the environment's out
// of fs.Visit.
func (f *etcdFlags) warnArgvPassword(fs *flag.FlagSet, log *slog.Logger) {
	fs.Visit(func(fl *flag.Flag) {
		if fl.Name == "etcd-password" || (fl.Name == "etcd-user" && strings.Contains(f.user, ":")) {
			log.Warn(fs.Name() + ": --" + fl.Name + " on the command line shows etcd's password to every user of this host (ps); use TROUPE_ETCD_PASSWORD")
		}
	})
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
