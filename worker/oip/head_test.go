package oip_test

import (
	"context"
	"encoding/json"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	oa "github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/troupe-serving/troupe/internal/front/httpapi"
	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/oippb"
	"github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/oip"
)

// TestChatThroughHead is the front door: the official OpenAI client → a
// real head (embedded etcd, HTTP API on loopback) → a worker with the oip
// engine, registered through etcd → the test's OIP engine over gRPC. The
// chat completion's content is the engine's text, and the engine got the
// conversation as the messages tensor and the client's max_tokens.
func TestChatThroughHead(t *testing.T) {
	te := &testEngine{
		meta: metadata(ins(tensor("messages", "BYTES", 1)), tensor("text", "BYTES", 1)),
		infer: func(_ context.Context, req *oippb.ModelInferRequest, send func(*oippb.ModelStreamInferResponse) error) error {
			_, raw := findInput(req, "messages")
			var msgs []struct{ Role, Content string }
			if len(raw) < 4 || json.Unmarshal(raw[4:], &msgs) != nil || len(msgs) == 0 {
				return send(&oippb.ModelStreamInferResponse{ErrorMessage: "bad messages"})
			}
			for _, w := range strings.SplitAfter("you said: "+msgs[len(msgs)-1].Content, " ") {
				if err := send(respond(more(), textOut(w))); err != nil {
					return err
				}
			}
			return send(respond(final("stop")))
		}}
	e, _ := runEngine(t, oip.Config{Upstream: serve(t, "unix", te), Model: "m"})

	c := orchestratortest.Start(t, orchestratortest.Options{
		Pipeline:         orchestrator.Pipeline{Model: "troupe-omni-sim", Stages: []orchestrator.Stage{{Name: "thinker"}}},
		ReplicasPerStage: -1,
	})
	srv := startRegistered(t, c, "thinker", e)
	c.WaitState(t, "thinker", srv.Member().ReplicaID, "attached")
	assert.Equal(t, "oip", srv.Member().Engine)
	assert.Equal(t, "m", srv.Member().Model, "the OIP model, from the engine")

	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	client := oa.NewClient(option.WithBaseURL(serveAPI(t, c)+"/v1/"), option.WithAPIKey("unused"),
		option.WithHTTPClient(&http.Client{Transport: tr}), option.WithMaxRetries(0))
	res, err := client.Chat.Completions.New(testCtx(t), oa.ChatCompletionNewParams{
		Model:     "troupe-omni-sim",
		Messages:  []oa.ChatCompletionMessageParamUnion{oa.SystemMessage("be brief"), oa.UserMessage("hello there")},
		MaxTokens: oa.Int(16),
	})
	require.NoError(t, err)
	require.Len(t, res.Choices, 1)
	assert.Equal(t, "you said: hello there", res.Choices[0].Message.Content)
	assert.Equal(t, "stop", string(res.Choices[0].FinishReason))
	assert.Equal(t, int64(4), res.Usage.CompletionTokens, "one token per response with text")

	reqs := te.got()
	require.Len(t, reqs, 1)
	assert.Equal(t, `[{"role":"system","content":"be brief"},{"role":"user","content":"hello there"}]`, textOf(t, reqs[0], "messages"))
	assert.Equal(t, int64(16), reqs[0].GetParameters()["max_tokens"].GetInt64Param())
	assert.NotEmpty(t, reqs[0].GetId(), "the troupe request id")
}

// startRegistered runs a worker for the engine in the cluster, built once
// the engine is ready (as troupe worker does), until the test ends, and
// waits until it is registered.
func startRegistered(t testing.TB, c *orchestratortest.Cluster, stage string, e *oip.Engine) *worker.Server {
	t.Helper()
	select {
	case <-e.Ready():
	case <-testCtx(t).Done():
		t.Fatal("engine never ready")
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: c.Etcd.Endpoints(), DialTimeout: 5 * time.Second})
	require.NoError(t, err)
	srv, err := worker.New(worker.Config{Stage: stage, AutoID: true, Engine: e, EtcdClient: cli, LeaseTTL: 3 * time.Second,
		DrainTimeout: 5 * time.Second, Version: "test", Logger: quiet()})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			assert.NoError(t, err)
		case <-time.After(wait):
			t.Error("worker did not stop")
		}
		cli.Close()
	})
	select {
	case <-srv.Registered():
	case err := <-done:
		t.Fatalf("worker stopped: %v", err)
	case <-time.After(wait):
		t.Fatal("worker never registered")
	}
	return srv
}

// serveAPI serves the cluster head's HTTP API on loopback until the test
// ends and returns its root URL.
func serveAPI(t testing.TB, c *orchestratortest.Cluster) string {
	t.Helper()
	srv := httpapi.NewHTTPServer("127.0.0.1:0", httpapi.New(c.Head, httpapi.Config{Logger: quiet(), Gatherer: c.Metrics}).Handler())
	lis, err := net.Listen("tcp", srv.Addr)
	require.NoError(t, err)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), wait)
		defer cancel()
		if err := srv.Shutdown(ctx); err != nil {
			_ = srv.Close()
		}
		require.ErrorIs(t, <-served, http.ErrServerClosed)
	})
	return "http://" + lis.Addr().String()
}
