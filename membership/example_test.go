package membership_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/membership/embedetcd"
)

// startEtcd runs an embedded etcd on a free loopback port for an example and
// returns a client and a function that stops both.
func startEtcd(ctx context.Context) (*clientv3.Client, func(), error) {
	dir, err := os.MkdirTemp("", "troupe-example-")
	if err != nil {
		return nil, nil, err
	}
	lg, err := embedetcd.LoggerAt("error")
	if err != nil {
		return nil, nil, err
	}
	srv, err := embedetcd.Start(ctx, embedetcd.Config{
		Name:             "example",
		Logger:           lg,
		DataDir:          dir,
		ListenClientURLs: []string{"http://127.0.0.1:0"},
		ListenPeerURLs:   []string{"http://127.0.0.1:0"},
		UnsafeNoFsync:    true,
	})
	if err != nil {
		os.RemoveAll(dir)
		return nil, nil, err
	}
	cli, err := membership.Dial(ctx, membership.ClientConfig{Endpoints: srv.ClientURLs()})
	if err != nil {
		srv.Close()
		os.RemoveAll(dir)
		return nil, nil, err
	}
	return cli, func() { cli.Close(); srv.Close(); os.RemoveAll(dir) }, nil
}

// A worker announces its replica under a lease: the key exists while the
// worker lives, and Close revokes it so the head stops routing at once.
func ExampleRegister() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cli, stop, err := startEtcd(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stop()

	reg, err := membership.Register(ctx, cli, membership.RegisterConfig{
		Member: membership.Member{Stage: "thinker", Addr: "127.0.0.1:7001", Engine: "sim"},
		AutoID: true, // the smallest free replica id of the stage
		TTL:    5 * time.Second,
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("registered", reg.Key())

	// A second worker asking for the same id is refused, never overwrites.
	_, err = membership.Register(ctx, cli, membership.RegisterConfig{
		Member: membership.Member{Stage: "thinker", ReplicaID: 0, Addr: "127.0.0.1:7002", Engine: "sim"},
	})
	fmt.Println(err)

	if err := reg.Close(ctx); err != nil {
		fmt.Println(err)
	}
	// Output:
	// registered /troupe/default/members/thinker/0
	// membership: replica thinker/0 already registered by 127.0.0.1:7001
}

// The head turns the member keys into ordered Join and Leave events.
func ExampleWatcher() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cli, stop, err := startEtcd(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stop()

	w := membership.NewWatcher(cli, membership.WatchConfig{Stages: []string{"thinker"}})
	events := make(chan membership.Event)
	wctx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	done := make(chan error, 1)
	go func() { done <- w.Run(wctx, events) }()

	reg, err := membership.Register(ctx, cli, membership.RegisterConfig{
		Member: membership.Member{Stage: "thinker", ReplicaID: 3, Addr: "127.0.0.1:7003", Engine: "sim"},
	})
	if err != nil {
		fmt.Println(err)
		stopWatch()
		<-done
		return
	}
	ev := <-events
	fmt.Println(ev.Type, ev.Member.Stage, ev.Member.ReplicaID, ev.Member.Addr)
	if err := reg.Close(ctx); err != nil { // revokes the lease: a Leave
		fmt.Println(err)
	}
	ev = <-events
	fmt.Println(ev.Type, ev.Member.Stage, ev.Member.ReplicaID)

	stopWatch()
	if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
		fmt.Println(err)
	}
	// Output:
	// join thinker 3 127.0.0.1:7003
	// leave thinker 3
}
