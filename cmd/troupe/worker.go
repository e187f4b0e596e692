package main

import (
	"context"
	"errors"
	"io"
)

// runWorker is a placeholder until its issue lands.
func runWorker(_ context.Context, _ []string, _ io.Writer) error {
	return errors.New("worker: not implemented yet")
}
