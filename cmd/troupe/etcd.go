package main

import (
	"context"
	"errors"
	"io"
)

// runEtcd is a placeholder until its issue lands.
func runEtcd(_ context.Context, _ []string, _ io.Writer) error {
	return errors.New("etcd: not implemented yet")
}
