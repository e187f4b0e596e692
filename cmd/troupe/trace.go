package main

import (
	"context"
	"errors"
	"io"
)

// runTrace is a placeholder until its issue lands.
func runTrace(_ context.Context, _ []string, _ io.Writer) error {
	return errors.New("trace: not implemented yet")
}
