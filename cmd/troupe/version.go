package main

import (
	"context"
	"fmt"
	"io"
	"runtime/debug"
	"strings"
)

// version names this build in logs, traces and member records. Release
// images set it at link time (-ldflags "-X main.version=..."); otherwise it
// is the module version the go command stamped from the VCS.
var version = ""

func init() {
	if version == "" {
		version = "devel"
		if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
			version = bi.Main.Version
		}
	}
}

// runVersion prints the version and what the build info says of the
// source: the VCS revision, whether the tree had local changes, and the
// commit time.
func runVersion(_ context.Context, args []string, stdout io.Writer) error {
	fs := newFlagSet("version")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	bi, _ := debug.ReadBuildInfo()
	_, err := io.WriteString(stdout, versionText(version, bi))
	return err
}

// versionText is `troupe version`'s output: the first line is "troupe
// VERSION"; then one "key: value" line per fact the build info holds.
func versionText(v string, bi *debug.BuildInfo) string {
	var b strings.Builder
	fmt.Fprintf(&b, "troupe %s\n", v)
	if bi == nil {
		return b.String()
	}
	settings := map[string]string{}
	for _, s := range bi.Settings {
		settings[s.Key] = s.Value
	}
	if bi.Main.Path != "" {
		fmt.Fprintf(&b, "  module:   %s %s\n", bi.Main.Path, bi.Main.Version)
	}
	if rev := settings["vcs.revision"]; rev != "" {
		if settings["vcs.modified"] == "true" {
			rev += " (modified)"
		}
		fmt.Fprintf(&b, "  revision: %s\n", rev)
	} else {
		fmt.Fprintln(&b, "  revision: unknown (built without VCS information)")
	}
	if t := settings["vcs.time"]; t != "" {
		fmt.Fprintf(&b, "  time:     %s\n", t)
	}
	fmt.Fprintf(&b, "  go:       %s\n", bi.GoVersion)
	return b.String()
}
