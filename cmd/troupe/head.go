package main

import (
	"context"
	"errors"
	"io"
)

// runHead is a placeholder until its issue lands.
func runHead(_ context.Context, _ []string, _ io.Writer) error {
	return errors.New("head: not implemented yet")
}
