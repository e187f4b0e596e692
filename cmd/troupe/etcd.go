package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/troupe-serving/troupe/membership/embedetcd"
)

// runEtcd runs an etcd server until ctx ends: a single node by default, or
// one member of a static cluster given by --initial-cluster (a StatefulSet of
// three runs three, each with its own --name).
func runEtcd(ctx context.Context, args []string, stdout io.Writer) error {
	fs := newFlagSet("etcd")
	dataDir := fs.String("data-dir", "", "directory for etcd's WAL and database (required)")
	name := fs.String("name", "troupe", "member name")
	listenClient := fs.String("listen-client-urls", embedetcd.DefaultClientURL, "comma-separated URLs to serve clients on")
	listenPeer := fs.String("listen-peer-urls", "", "comma-separated URLs to serve peers on (default: the client host, client port + 1)")
	advertiseClient := fs.String("advertise-client-urls", "", "client URLs to advertise (default: the listen client URLs)")
	advertisePeer := fs.String("initial-advertise-peer-urls", "", "peer URLs to advertise (default: the listen peer URLs)")
	initialCluster := fs.String("initial-cluster", "", "every `member` of a new cluster as etcd's flag, name=peerURL,name2=peerURL2; must name --name at its advertised peer URLs (default: this member alone)")
	clusterState := fs.String("initial-cluster-state", "new", "cluster `state`: new bootstraps the cluster in --initial-cluster; existing joins a running one (after etcdctl member add)")
	clusterToken := fs.String("initial-cluster-token", "", "`token` that keeps clusters bootstrapped from the same --initial-cluster apart (default etcd's etcd-cluster)")
	logLevel := fs.String("log-level", "warn", "etcd log level: debug, info, warn, error")
	certFile := fs.String("cert-file", "", "server certificate for clients (PEM); listen client URLs must be https://")
	keyFile := fs.String("key-file", "", "server key for clients (PEM)")
	trustedCA := fs.String("trusted-ca-file", "", "CA bundle (PEM) client certificates must chain to: mutual TLS")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if strings.TrimSpace(*dataDir) == "" {
		fmt.Fprintln(fs.Output(), "troupe etcd: --data-dir is required")
		return errUsage
	}
	lg, err := embedetcd.LoggerAt(*logLevel)
	if err != nil {
		return err
	}
	defer func() { _ = lg.Sync() }()

	srv, err := embedetcd.Start(ctx, embedetcd.Config{
		Name:                *name,
		DataDir:             *dataDir,
		ListenClientURLs:    splitList(*listenClient),
		ListenPeerURLs:      splitList(*listenPeer),
		AdvertiseClientURLs: splitList(*advertiseClient),
		AdvertisePeerURLs:   splitList(*advertisePeer),
		InitialCluster:      *initialCluster,
		ClusterState:        *clusterState,
		ClusterToken:        *clusterToken,
		ClientCertFile:      *certFile,
		ClientKeyFile:       *keyFile,
		ClientCAFile:        *trustedCA,
		Logger:              lg,
	})
	if err != nil {
		if ctx.Err() != nil {
			return nil // interrupted while starting
		}
		return err
	}
	defer srv.Close()
	fmt.Fprintf(stdout, "troupe etcd: serving clients on %s (data dir %s)\n", strings.Join(srv.ClientURLs(), ","), *dataDir)

	select {
	case <-ctx.Done():
		srv.Close()
		fmt.Fprintln(stdout, "troupe etcd: stopped")
		return nil
	case err, ok := <-srv.Err():
		if !ok || err == nil {
			return errors.New("the server stopped unexpectedly")
		}
		return err
	}
}
