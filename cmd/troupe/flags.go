package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
)

// errUsage is returned after the flag package already printed the problem.
var errUsage = errors.New("usage")

// newFlagSet returns a flag set that reports errors instead of exiting.
func newFlagSet(name string) *flag.FlagSet {
	fs := flag.NewFlagSet("troupe "+name, flag.ContinueOnError)
	return fs
}

// parseFlags parses args, then fills every flag not given on the command
// line from TROUPE_<FLAG>, so the precedence is flag > env > default.
func parseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return errUsage
		}
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
