package fleet

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

// TestMain runs the replica child when the benchmark re-executes the test
// binary as one (childEnv set), and the package's benchmarks otherwise.
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(runChild())
	}
	goleak.VerifyTestMain(m)
}
