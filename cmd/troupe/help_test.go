package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestHelpMatchesFlags renders every command's help and holds each flag's
// line to the flag itself: a boolean flag shows no value name (Go's flag
// package takes the first back-quoted word of a usage string as one, so
// "the `user` field" on a boolean would read "-session-user user"), and a
// flag that takes a value names it by more than the generic "value".
func TestHelpMatchesFlags(t *testing.T) {
	for _, c := range commands {
		if c.name == "help" {
			continue
		}
		t.Run(c.name, func(t *testing.T) {
			err := c.run(context.Background(), []string{"--help"}, io.Discard)
			var h *helpRequested
			require.True(t, errors.As(err, &h), "%s --help: %v", c.name, err)
			var out bytes.Buffer
			h.print(&out)
			lines := strings.Split(out.String(), "\n")
			n := 0
			h.fs.VisitAll(func(f *flag.Flag) {
				n++
				name, usage := flag.UnquoteUsage(f)
				want := "  -" + f.Name
				if b, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && b.IsBoolFlag() {
					assert.Empty(t, name, "-%s is boolean but its help shows a value name", f.Name)
				} else {
					assert.NotEqual(t, "value", name, "-%s: name its value with a back-quoted word in the usage", f.Name)
					want += " " + name
				}
				assert.Contains(t, lines, want, "the help of %s has no line %q", c.name, want)
				assert.NotContains(t, usage, "`", "-%s: a second back-quoted word shows as is", f.Name)
			})
			assert.Equal(t, n, strings.Count(out.String(), "\n  -"), "every flag line belongs to a flag")
		})
	}
}
