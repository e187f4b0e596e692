//go:build unix

package e2e

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// troupeBin is the binary under test, built once by TestMain.
var troupeBin string

// buildTimeout bounds `go build` of the binary (cold caches on a slow
// machine take a while).
const buildTimeout = 5 * time.Minute

func TestMain(m *testing.M) {
	flag.Parse()
	if testing.Short() {
		// Every test skips itself with the reason; nothing to build.
		os.Exit(m.Run())
	}
	dir, err := os.MkdirTemp("", "troupe-e2e-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		os.Exit(1)
	}
	troupeBin, err = troupeBinary(dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		_ = os.RemoveAll(dir)
		os.Exit(1)
	}
	goleak.VerifyTestMain(m, goleak.Cleanup(func(code int) {
		_ = os.RemoveAll(dir)
		os.Exit(code)
	}))
}

// troupeBinary returns $TROUPE_E2E_BIN when set, else builds
// ./cmd/troupe into dir with the go command on PATH.
func troupeBinary(dir string) (string, error) {
	if p := os.Getenv("TROUPE_E2E_BIN"); p != "" {
		abs, err := filepath.Abs(p)
		if err != nil {
			return "", fmt.Errorf("TROUPE_E2E_BIN=%q: %w", p, err)
		}
		if _, err := os.Stat(abs); err != nil {
			return "", fmt.Errorf("TROUPE_E2E_BIN: %w", err)
		}
		return abs, nil
	}
	goTool, err := exec.LookPath("go")
	if err != nil {
		return "", fmt.Errorf("building troupe needs the go command on PATH (or set TROUPE_E2E_BIN): %w", err)
	}
	out := filepath.Join(dir, "troupe")
	ctx, cancel := context.WithTimeout(context.Background(), buildTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, goTool, "build", "-o", out, "github.com/troupe-serving/troupe/cmd/troupe")
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/troupe: %w\n%s", err, b)
	}
	return out, nil
}

// requireBinary skips the test in -short mode: it runs real processes.
func requireBinary(t testing.TB) {
	t.Helper()
	if testing.Short() {
		t.Skip("e2e: skipped with -short: builds the troupe binary and runs etcd, head and workers as processes")
	}
	if troupeBin == "" {
		t.Fatal("e2e: no troupe binary (TestMain did not build one)")
	}
}
