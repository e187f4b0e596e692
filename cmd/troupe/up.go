package main

import (
	"context"
	"errors"
	"io"
)

// runUp is a placeholder until its issue lands.
func runUp(_ context.Context, _ []string, _ io.Writer) error {
	return errors.New("up: not implemented yet")
}
