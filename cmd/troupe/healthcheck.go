package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// runHealthcheck exits 0 when the URL answers 2xx, or, for
// grpc://host:port[/service], when the gRPC health service reports SERVING
// (a worker; a draining worker reports NOT_SERVING). Images built FROM
// scratch have no shell or curl, so their HEALTHCHECK runs this.
func runHealthcheck(ctx context.Context, args []string, stdout io.Writer) error {
	fs := newFlagSet("healthcheck")
	timeout := fs.Duration("timeout", 3*time.Second, "how long to wait for an answer")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		fmt.Fprintf(fs.Output(), "troupe healthcheck: want one URL, got %d arguments; run 'troupe healthcheck --help'\n", fs.NArg())
		return errUsage
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	if target, ok := strings.CutPrefix(fs.Arg(0), "grpc://"); ok {
		return grpcHealthcheck(ctx, target)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, fs.Arg(0), nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return fmt.Errorf("%s answered %s", fs.Arg(0), resp.Status)
	}
	return nil
}

// grpcHealthcheck asks a gRPC server's standard health service (plaintext)
// about target, "host:port" optionally followed by "/service".
func grpcHealthcheck(ctx context.Context, target string) error {
	addr, service, _ := strings.Cut(target, "/")
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: service})
	if err != nil {
		return fmt.Errorf("grpc://%s: %w", target, err)
	}
	if resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		return fmt.Errorf("grpc://%s is %s", target, resp.GetStatus())
	}
	return nil
}
