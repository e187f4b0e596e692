package openai_test

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	oa "github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/worker/openai"
)

// busyUpstream is a fake vLLM server whose chat answers take serve and
// whose /metrics reports the answers it is computing, until frozen: then
// its /metrics stops answering (as an overloaded engine's may), so its
// worker keeps the last load it scraped.
type busyUpstream struct {
	*fake
	running atomic.Int32
	frozen  atomic.Bool
}

func newBusyUpstream(t *testing.T, serve time.Duration) *busyUpstream {
	u := &busyUpstream{fake: newVLLM(t)}
	u.route("GET /metrics", func(w http.ResponseWriter, r *http.Request) {
		if u.frozen.Load() {
			<-r.Context().Done() // the scrape times out
			return
		}
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		_, _ = fmt.Fprintf(w, "vllm:num_requests_running{model_name=\"m\"} %d\nvllm:num_requests_waiting{model_name=\"m\"} 0\n", u.running.Load())
	})
	u.route("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		u.running.Add(1)
		defer u.running.Add(-1)
		select { // the engine computing the answer
		case <-time.After(serve):
		case <-r.Context().Done():
			return
		}
		sse(w, delta("ok"), finish("stop"), usageEvent(4, 1, 0), "[DONE]")
	})
	return u
}

// A replica whose engine stopped answering its metrics scrape (its last
// scrape said idle) does not draw traffic sent through the HTTP API: the
// worker reports how old its load is (gauges_age_ms), the head counts it
// unknown past --signal-max-age, and /v1/replicas shows the age. With a
// bound of an hour the same frozen load draws more than its share, which
// is what the bound prevents.
func TestFrozenMetricsDoNotAttractTraffic(t *testing.T) {
	for _, policy := range []string{"least_loaded", "power_of_two", "prefix_aware"} {
		t.Run(policy, func(t *testing.T) {
			bounded := frozenShareThroughHead(t, policy, 300*time.Millisecond)
			blind := frozenShareThroughHead(t, policy, time.Hour)
			t.Logf("the frozen replica served %.0f%% of the requests with a bound of 300 ms, %.0f%% with an hour", 100*bounded, 100*blind)
			// A third is its share; 360 requests give about 2.5 points of
			// noise.
			assert.LessOrEqual(t, bounded, 0.4, "about its share, no more")
			assert.Greater(t, blind, bounded+0.1, "without the bound the frozen idle draws more")
		})
	}
}

// frozenShareThroughHead serves 3 openai workers over busy upstreams,
// freezes the first upstream's metrics, waits until /v1/replicas shows its
// load older than maxAge, sends 360 chat completions from 12 clients
// through the head's HTTP API and returns the frozen upstream's share.
func frozenShareThroughHead(t *testing.T, policy string, maxAge time.Duration) float64 {
	pipe := orchestrator.Pipeline{Model: thinkerOnly.Model, Stages: []orchestrator.Stage{{Name: "thinker", Policy: policy}}}
	head := orchestratortest.Start(t, orchestratortest.Options{Pipeline: pipe, ReplicasPerStage: -1, SignalMaxAge: maxAge})
	ups := make([]*busyUpstream, 3)
	ids := make([]uint32, 3)
	for i := range ups {
		ups[i] = newBusyUpstream(t, 20*time.Millisecond)
		e := startText(t, openai.Config{URL: ups[i].URL + "/v1", HealthInterval: 50 * time.Millisecond})
		srv := startWorker(t, head, "thinker", e)
		head.WaitState(t, "thinker", srv.Member().ReplicaID, "attached")
		ids[i] = srv.Member().ReplicaID
	}
	base := serveAPI(t, head)
	ctx := testCtx(t)

	ups[0].frozen.Store(true)
	loadAges := func() map[uint32]float64 {
		resp, err := http.Get(base + "/v1/replicas")
		require.NoError(t, err)
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		var list struct {
			Data []struct {
				Replica uint32   `json:"replica"`
				LoadAge *float64 `json:"load_age_s"`
			} `json:"data"`
		}
		require.NoError(t, json.Unmarshal(body, &list), "body: %s", body)
		ages := map[uint32]float64{}
		for _, r := range list.Data {
			if r.LoadAge != nil {
				ages[r.Replica] = *r.LoadAge
			}
		}
		return ages
	}
	// Past the worker's 1 s heartbeat: the age is the engine's
	// measurement's, not the relay's.
	require.Eventually(t, func() bool { return loadAges()[ids[0]] > 1.5 }, wait, 10*time.Millisecond,
		"/v1/replicas shows the frozen replica's load aging")

	client := oa.NewClient(option.WithBaseURL(base+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	before := ups[0].posts()
	var wg sync.WaitGroup
	errs := make(chan error, 12)
	for range 12 {
		wg.Go(func() {
			for range 30 {
				_, err := client.Chat.Completions.New(ctx, oa.ChatCompletionNewParams{
					Model:    thinkerOnly.Model,
					Messages: []oa.ChatCompletionMessageParamUnion{oa.UserMessage("how busy are you")},
				})
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	served := 0
	for _, u := range ups {
		served += u.posts()
	}
	require.Equal(t, 360+before, served, "every request reached an upstream once")
	ages := loadAges()
	assert.Greater(t, ages[ids[0]], 1.5, "the chunks it answered carried its load's age too")
	assert.Less(t, ages[ids[1]], 1.5)
	assert.Less(t, ages[ids[2]], 1.5)
	return float64(ups[0].posts()-before) / 360
}
