// Command troupe is the one binary of troupe: etcd, head, worker and tools.
//
// Every flag also reads TROUPE_<FLAG> from the environment (dashes become
// underscores, upper case); a flag given on the command line wins.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

type command struct {
	name, summary string
	run           func(ctx context.Context, args []string, stdout io.Writer) error
}

var commands = []command{
	{"up", "laptop all-in-one: embedded etcd, a head, one sim worker per stage", runUp},
	{"etcd", "run a standalone etcd server", runEtcd},
	{"head", "run the head: watch membership, route requests, serve the HTTP API", runHead},
	{"worker", "run a stage replica and register it in etcd", runWorker},
	{"members", "list the cluster's members", runMembers},
	{"healthcheck", "exit 0 when a URL answers 2xx", runHealthcheck},
	{"trace", "print one trace from Jaeger as a waterfall", runTrace},
	{"version", "print the version", runVersion},
}

// version is set at link time with -ldflags "-X main.version=...".
var version = "dev"

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: troupe <command> [flags]")
	fmt.Fprintln(w, "\ncommands:")
	for _, c := range commands {
		fmt.Fprintf(w, "  %-12s %s\n", c.name, c.summary)
	}
	fmt.Fprintln(w, "\nRun 'troupe <command> -h' for its flags. Every flag also reads TROUPE_<FLAG>.")
}

func main() {
	os.Exit(run(os.Args[1:]))
}

func run(args []string) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage(os.Stderr)
		if len(args) == 0 {
			return 2
		}
		return 0
	}
	for _, c := range commands {
		if c.name != args[0] {
			continue
		}
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		defer stop()
		err := c.run(ctx, args[1:], os.Stdout)
		switch {
		case err == nil:
			return 0
		case errors.Is(err, errUsage):
			return 2
		default:
			fmt.Fprintf(os.Stderr, "troupe %s: %v\n", c.name, err)
			return 1
		}
	}
	fmt.Fprintf(os.Stderr, "troupe: unknown command %q\n\n", args[0])
	usage(os.Stderr)
	return 2
}

func runVersion(_ context.Context, _ []string, stdout io.Writer) error {
	_, err := fmt.Fprintln(stdout, version)
	return err
}
