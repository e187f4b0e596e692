package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
)

// errUsage is returned after the problem was printed to the flag set's
// output (stderr); the exit status is 2.
var errUsage = errors.New("usage")

// helpRequested is returned by parseFlags for -h or --help: run prints the
// command's help to stdout and exits 0.
type helpRequested struct{ fs *flag.FlagSet }

func (h *helpRequested) Error() string { return "help requested" }

// print writes the command's help: its synopsis with the positional
// arguments, what it does, and its flags.
func (h *helpRequested) print(w io.Writer) {
	name := strings.TrimPrefix(h.fs.Name(), "troupe ")
	c, _ := lookup(name)
	synopsis := "troupe " + name
	hasFlags := false
	h.fs.VisitAll(func(*flag.Flag) { hasFlags = true })
	if hasFlags {
		synopsis += " [flags]"
	}
	if c.args != "" {
		synopsis += " " + c.args
	}
	fmt.Fprintf(w, "usage: %s\n\n%s\n", synopsis, c.summary)
	if c.detail != "" {
		fmt.Fprintf(w, "\n%s\n", c.detail)
	}
	if hasFlags {
		fmt.Fprintln(w, "\nflags:")
		out := h.fs.Output()
		h.fs.SetOutput(w)
		h.fs.PrintDefaults()
		h.fs.SetOutput(out)
		fmt.Fprintln(w, "\nEvery flag also reads TROUPE_<FLAG> from the environment (flag > env > default).")
	}
}

// newFlagSet returns the flag set of command name: it reports errors
// instead of exiting, and leaves the help to parseFlags.
func newFlagSet(name string) *flag.FlagSet {
	fs := flag.NewFlagSet("troupe "+name, flag.ContinueOnError)
	fs.SetOutput(os.Stderr)
	fs.Usage = func() {} // parseFlags prints help to stdout, a hint on errors
	return fs
}

// parseFlags parses args, then fills every flag not given on the command
// line from TROUPE_<FLAG>, so the precedence is flag > env > default. A
// command that takes no positional arguments refuses any, so that a stray
// word is not silently ignored.
func parseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return &helpRequested{fs: fs}
		}
		// The flag package printed the problem.
		fmt.Fprintf(fs.Output(), "Run '%s --help' for usage.\n", fs.Name())
		return errUsage
	}
	if c, ok := lookup(strings.TrimPrefix(fs.Name(), "troupe ")); ok && c.args == "" && fs.NArg() > 0 {
		fmt.Fprintf(fs.Output(), "%s: unexpected arguments %q (it takes flags only; run '%s --help')\n", fs.Name(), fs.Args(), fs.Name())
		return errUsage
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	var errs []error
	fs.VisitAll(func(f *flag.Flag) {
		if set[f.Name] {
			return
		}
		env := envName(f.Name)
		v, ok := os.LookupEnv(env)
		if !ok {
			return
		}
		if err := f.Value.Set(v); err != nil {
			errs = append(errs, fmt.Errorf("invalid %s=%q: %w", env, v, err))
		}
	})
	return errors.Join(errs...)
}

// envName maps a flag name to its environment variable.
func envName(flagName string) string {
	return "TROUPE_" + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// splitList splits a comma-separated flag value, dropping empty items.
func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}
