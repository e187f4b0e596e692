// Package python_test runs the Python tests of worker/python (the
// troupe_engine package and the omni_numpy example pipeline) under go test,
// with Debian's python3 and its grpcio, protobuf and numpy.
package python_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

// python is the interpreter the tests run with: Debian's, whose
// python3-grpcio, python3-protobuf and python3-numpy scripts/test.sh
// installs.
const python = "/usr/bin/python3"

// repoRoot is the repository root: two folders above this file.
func repoRoot(t *testing.T) string {
	t.Helper()
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		t.Fatal("runtime.Caller: no file")
	}
	root := filepath.Join(filepath.Dir(file), "..", "..")
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatalf("no go.mod at %s, the repository root: %v", root, err)
	}
	return root
}

// missing says why Python or its modules cannot run the tests ("" when they
// can). Outside CI the test skips for it; under CI (CI set, as
// scripts/test.sh's machines have it) it fails.
func missing() string {
	if _, err := os.Stat(python); err != nil {
		return python + " is missing (Debian: apt-get install python3)"
	}
	out, err := exec.Command(python, "-c", "import grpc, google.protobuf, numpy").CombinedOutput()
	if err != nil {
		return python + " lacks grpc, protobuf or numpy (Debian: apt-get install python3-grpcio python3-protobuf python3-numpy): " +
			strings.TrimSpace(string(out))
	}
	return ""
}

// TestPython runs python3 -m unittest discover -s worker/python/tests from
// the repository root with PYTHONPATH=worker/python, and fails when it exits
// non-zero, with its output.
func TestPython(t *testing.T) {
	if why := missing(); why != "" {
		if _, ci := os.LookupEnv("CI"); ci {
			t.Fatalf("CI is set, so the Python tests must run: %s", why)
		}
		t.Skipf("skipping the Python tests of worker/python: %s", why)
	}
	root := repoRoot(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, python, "-m", "unittest", "discover", "-v", "-s", "worker/python/tests")
	cmd.Dir = root
	cmd.Env = append(os.Environ(),
		"PYTHONPATH="+filepath.Join(root, "worker", "python"),
		"PYTHONDONTWRITEBYTECODE=1", // no __pycache__ in the tree
		"PYTHONUNBUFFERED=1",
	)
	cmd.WaitDelay = 10 * time.Second
	start := time.Now()
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s (%s, after %v):\n%s", strings.Join(cmd.Args, " "), err, time.Since(start).Round(time.Millisecond), out)
	}
	// unittest's summary: "Ran N tests in Xs" and "OK".
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	for _, l := range lines {
		if strings.HasPrefix(l, "Ran ") {
			t.Log(l)
		}
	}
	if last := lines[len(lines)-1]; !strings.HasPrefix(last, "OK") {
		t.Fatalf("unittest exited 0 but does not end with OK:\n%s", out)
	}
}
