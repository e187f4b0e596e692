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
	"strings"
	"syscall"
)

type command struct {
	name string
	// args is the synopsis of the positional arguments, "" when the
	// command takes none (parseFlags then refuses any).
	args, summary string
	// detail, when set, follows the summary in the command's help.
	detail string
	run    func(ctx context.Context, args []string, stdout io.Writer) error
}

// commands is set by init: the commands' own flag sets read it for their
// help, which a static initializer would make a cycle.
var commands []command

func init() {
	commands = []command{
		{name: "up", summary: "laptop all-in-one: embedded etcd, a head, one sim worker per stage", run: runUp},
		{name: "etcd", summary: "run a standalone etcd server", run: runEtcd},
		{name: "head", summary: "run the head: watch membership, route requests, serve the HTTP API", run: runHead},
		{name: "worker", summary: "run a stage replica and register it in etcd", run: runWorker},
		{name: "members", summary: "list the cluster's members", run: runMembers},
		{name: "replicas", summary: "list a head's replicas and their states, or follow them (--watch)", detail: replicasDetail, run: runReplicas},
		{name: "certs", summary: "write a cluster CA, the head's and the workers' certificates and a cluster token", run: runCerts},
		{name: "healthcheck", args: "URL|grpc://HOST:PORT[/SERVICE]", summary: "exit 0 when a URL answers 2xx, or a gRPC health service SERVING", run: runHealthcheck},
		{name: "trace", args: "TRACE_ID", summary: "print one trace from Jaeger as a waterfall",
			detail: "TRACE_ID is a trace id (32 hex digits) or a whole traceparent header value; flags may come before or after it.", run: runTrace},
		{name: "bench", args: "[compare A.json B.json]", summary: "load a troupe head (or any OpenAI-compatible server) and report latencies, throughput and goodput",
			detail: benchDetail, run: runBench},
		{name: "talk", summary: "run a realtime voice session from the terminal: send text or a WAV, print and save the answers",
			detail: talkDetail, run: runTalk},
		{name: "version", summary: "print the version and the build's VCS revision", run: runVersion},
		{name: "help", args: "[COMMAND]", summary: "show the help of a command", run: runHelp},
	}
}

func lookup(name string) (command, bool) {
	for _, c := range commands {
		if c.name == name {
			return c, true
		}
	}
	return command{}, false
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: troupe <command> [flags] [arguments]")
	fmt.Fprintln(w, "\ncommands:")
	for _, c := range commands {
		fmt.Fprintf(w, "  %-12s %s\n", c.name, c.summary)
	}
	fmt.Fprintln(w, "\nRun 'troupe help <command>' or 'troupe <command> --help' for its arguments and flags.")
	fmt.Fprintln(w, "Every flag also reads TROUPE_<FLAG> from the environment (flag > env > default).")
}

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run runs the command line args and returns the exit status: 0 done (or
// help shown), 1 the command failed, 2 a usage error.
func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		usage(stderr)
		return 2
	}
	switch args[0] {
	case "-h", "-help", "--help":
		usage(stdout)
		return 0
	case "-version", "--version":
		args = append([]string{"version"}, args[1:]...)
	}
	c, ok := lookup(args[0])
	if !ok {
		fmt.Fprintf(stderr, "troupe: unknown command %q\n\n", args[0])
		usage(stderr)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := c.run(ctx, args[1:], stdout)
	var help *helpRequested
	switch {
	case err == nil:
		return 0
	case errors.As(err, &help):
		help.print(stdout)
		return 0
	case errors.Is(err, errUsage):
		return 2
	default:
		fmt.Fprintln(stderr, "troupe "+withPrefix(c.name, err))
		return 1
	}
}

// withPrefix is "name: err", once: an error of a package that shares the
// command's name (worker, etcd) already starts with it.
func withPrefix(name string, err error) string {
	msg := err.Error()
	if strings.HasPrefix(msg, name+": ") {
		return msg
	}
	return name + ": " + msg
}

// runHelp shows the usage, or a command's help.
func runHelp(ctx context.Context, args []string, stdout io.Writer) error {
	fs := newFlagSet("help")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	switch fs.NArg() {
	case 0:
		usage(stdout)
		return nil
	case 1:
		c, ok := lookup(fs.Arg(0))
		if !ok {
			fmt.Fprintf(fs.Output(), "troupe help: unknown command %q\n\n", fs.Arg(0))
			usage(fs.Output())
			return errUsage
		}
		return c.run(ctx, []string{"--help"}, stdout)
	}
	fmt.Fprintf(fs.Output(), "troupe help: one command at most, got %q\n", fs.Args())
	return errUsage
}
