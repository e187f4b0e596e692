package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"time"
)

// runHealthcheck exits 0 when the URL answers 2xx. Images built FROM scratch
// have no shell or curl, so their HEALTHCHECK runs this.
func runHealthcheck(ctx context.Context, args []string, stdout io.Writer) error {
	fs := newFlagSet("healthcheck")
	timeout := fs.Duration("timeout", 3*time.Second, "how long to wait for an answer")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		fmt.Fprintln(fs.Output(), "usage: troupe healthcheck [--timeout D] URL")
		return errUsage
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, fs.Arg(0), nil)
	if err != nil {
		return fmt.Errorf("healthcheck: %w", err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("healthcheck: %w", err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return fmt.Errorf("healthcheck: %s answered %s", fs.Arg(0), resp.Status)
	}
	return nil
}
