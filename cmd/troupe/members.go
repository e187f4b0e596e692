package main

import (
	"context"
	"errors"
	"io"
)

// runMembers is a placeholder until its issue lands.
func runMembers(_ context.Context, _ []string, _ io.Writer) error {
	return errors.New("members: not implemented yet")
}
