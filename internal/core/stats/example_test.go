package stats_test

import (
	"fmt"
	"os"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/troupe-serving/troupe/internal/core/stats"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// The head loop attaches a joining replica, binds its series, and only then
// routes to it; request goroutines record; a leave detaches.
func Example() {
	reg := prometheus.NewRegistry()
	logger, err := stats.New(reg, "troupe-omni-sim", stats.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	// Join (head loop). The head hands out engine indexes in first-join
	// order; this is the first replica it has seen.
	idx := 0
	_ = logger.Register(idx, stats.Replica{Stage: 0, StageName: "thinker", ReplicaID: 3, Engine: "sim"})

	// A chunk arrives (request goroutine).
	_ = logger.Record(idx, &stagepb.EngineStats{PromptTokens: 16, GenerationTokens: 4})

	// Leave (head loop): attached goes to 0, the counters stay.
	_ = logger.Detach(idx)

	err = testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP troupe_prompt_tokens_total Number of prefill tokens processed.
# TYPE troupe_prompt_tokens_total counter
troupe_prompt_tokens_total{model_name="troupe-omni-sim",replica="3",stage="0"} 16
# HELP troupe_replica_attached 1 while the replica is a member the head routes to, 0 after it left.
# TYPE troupe_replica_attached gauge
troupe_replica_attached{model_name="troupe-omni-sim",replica="3",stage="0"} 0
`), "troupe_prompt_tokens_total", "troupe_replica_attached")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
	}
	fmt.Println("engine index", idx, "matches:", err == nil)
	// Output: engine index 0 matches: true
}
