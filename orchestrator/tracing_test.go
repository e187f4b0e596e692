package orchestrator_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/telemetry"
	"github.com/troupe-serving/troupe/worker/sim"
)

// tracedCluster starts a cluster whose head samples everything and whose
// workers follow the head, both recording into one SpanRecorder, with the
// otelgrpc stats handlers on both sides of every hop.
func tracedCluster(t *testing.T, opts orchestratortest.Options) (*orchestratortest.Cluster, *tracetest.SpanRecorder) {
	rec := tracetest.NewSpanRecorder()
	headTP := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()), sdktrace.WithSpanProcessor(rec))
	workerTP := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.NeverSample())), sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() {
		_ = headTP.Shutdown(context.Background())
		_ = workerTP.Shutdown(context.Background())
	})
	prop := propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	opts.HeadTracer = headTP
	opts.HeadDialOptions = []grpc.DialOption{grpc.WithStatsHandler(otelgrpc.NewClientHandler(otelgrpc.WithTracerProvider(headTP), otelgrpc.WithPropagators(prop)))}
	opts.WorkerServerOptions = []grpc.ServerOption{grpc.StatsHandler(otelgrpc.NewServerHandler(otelgrpc.WithTracerProvider(workerTP), otelgrpc.WithPropagators(prop)))}
	return orchestratortest.Start(t, opts), rec
}

// spanTree indexes the ended spans of one trace.
type spanTree struct {
	spans    []sdktrace.ReadOnlySpan
	children map[trace.SpanID][]sdktrace.ReadOnlySpan
}

func treeOf(rec *tracetest.SpanRecorder, traceID trace.TraceID) spanTree {
	tr := spanTree{children: map[trace.SpanID][]sdktrace.ReadOnlySpan{}}
	for _, s := range rec.Ended() {
		if s.SpanContext().TraceID() != traceID {
			continue
		}
		tr.spans = append(tr.spans, s)
		tr.children[s.Parent().SpanID()] = append(tr.children[s.Parent().SpanID()], s)
	}
	return tr
}

func (tr spanTree) named(name string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range tr.spans {
		if s.Name() == name {
			out = append(out, s)
		}
	}
	return out
}

func attr(s sdktrace.ReadOnlySpan, key attribute.Key) attribute.Value {
	for _, kv := range s.Attributes() {
		if kv.Key == key {
			return kv.Value
		}
	}
	return attribute.Value{}
}

func hasEvent(s sdktrace.ReadOnlySpan, name string) bool {
	for _, e := range s.Events() {
		if e.Name == name {
			return true
		}
	}
	return false
}

// waitSpans waits until the recorder holds a span named name in the trace:
// server-side spans end after the client has its answer.
func waitSpans(t *testing.T, rec *tracetest.SpanRecorder, traceID trace.TraceID, name string, n int) {
	t.Helper()
	require.Eventually(t, func() bool { return len(treeOf(rec, traceID).named(name)) >= n }, 30*time.Second, 5*time.Millisecond, "span %q x%d", name, n)
}

// runTraced executes req under a root span so the test knows its trace id.
func runTraced(ctx context.Context, c *orchestratortest.Cluster, req orchestrator.Request) (trace.TraceID, *orchestrator.Result, error) {
	var res *orchestrator.Result
	var err error
	var id trace.TraceID
	tracer := c.Head.TracerProvider().Tracer("test")
	ctx, span := tracer.Start(ctx, "client")
	id = span.SpanContext().TraceID()
	res, err = c.Head.Execute(ctx, req, nil)
	span.End()
	return id, res, err
}

func TestSpanTreeThreeStages(t *testing.T) {
	c, rec := tracedCluster(t, orchestratortest.Options{})
	id, res, err := runTraced(ctxT(t), c, orchestrator.Request{ID: "r1", Prompt: "trace me", Sampling: sampling(6, 1), Stages: 3})
	require.NoError(t, err)
	const rpc = "troupe.stage.v1.StageService/Generate"
	waitSpans(t, rec, id, telemetry.SpanDecode, 3)
	// A worker's server span ends after its decode span, once its handler
	// has returned: the thinker's call and its server span, and the two
	// fed stages' GenerateStream calls and theirs.
	waitSpans(t, rec, id, rpc, 2)
	waitSpans(t, rec, id, rpc+"Stream", 4)
	tr := treeOf(rec, id)

	reqs := tr.named(telemetry.SpanRequest)
	require.Len(t, reqs, 1)
	request := reqs[0]
	assert.Equal(t, trace.SpanKindInternal, request.SpanKind())
	assert.Equal(t, int64(res.CompletionTokens), attr(request, telemetry.KeyGenAIUsageOutputTokens).AsInt64())

	stageSpans := tr.children[request.SpanContext().SpanID()]
	require.Len(t, stageSpans, 3, "one stage span per stage, under troupe.request")
	for i, name := range []string{"thinker", "talker", "vocoder"} {
		st := tr.named(telemetry.StageSpanName(name))
		require.Len(t, st, 1, name)
		s := st[0]
		assert.Equal(t, request.SpanContext().SpanID(), s.Parent().SpanID())
		assert.Equal(t, int64(i), attr(s, telemetry.KeyStageID).AsInt64())
		assert.Equal(t, name, attr(s, telemetry.KeyStageName).AsString())
		assert.Equal(t, int64(0), attr(s, telemetry.KeyReplicaID).AsInt64())
		assert.Equal(t, int64(1), attr(s, telemetry.KeyAttempt).AsInt64())
		assert.Equal(t, attribute.INT64, attr(s, telemetry.KeyEngineIndex).Type())
		assert.Equal(t, "troupe-omni-sim", attr(s, telemetry.KeyGenAIRequestModel).AsString())
		assert.Positive(t, attr(s, telemetry.KeyGenAIUsageOutputTokens).AsInt64())
		assert.Equal(t, "round_robin", attr(s, telemetry.KeyRoutePolicy).AsString())
		assert.Equal(t, "rotation", attr(s, telemetry.KeyRouteReason).AsString())
		assert.Equal(t, attribute.EMPTY, attr(s, telemetry.KeyRoutePrefixSource).Type(), "no prefix attributes without prefix_aware")
		assert.True(t, hasEvent(s, "first_token"), "%s: first token event", name)
		assert.True(t, hasEvent(s, "finish"), "%s: finish event", name)
		// The stages stream into each other: every stage after the first
		// records its first input, every stage its first output forwarded
		// (to the next stage, or to the client).
		assert.Equal(t, i > 0, hasEvent(s, "first_input"), "%s: first_input event", name)
		assert.True(t, hasEvent(s, "first_output_forwarded"), "%s: first_output_forwarded event", name)

		clients := tr.children[s.SpanContext().SpanID()]
		require.Len(t, clients, 1, "%s: one gRPC client span", name)
		wantRPC := rpc
		if i > 0 {
			wantRPC = rpc + "Stream" // fed by the previous stage as it generates
		}
		assert.Equal(t, wantRPC, clients[0].Name())
		assert.Equal(t, trace.SpanKindClient, clients[0].SpanKind())
		servers := tr.children[clients[0].SpanContext().SpanID()]
		require.Len(t, servers, 1, "%s: the worker's server span is a child of the client span", name)
		assert.Equal(t, trace.SpanKindServer, servers[0].SpanKind())
		var phases []string
		for _, p := range tr.children[servers[0].SpanContext().SpanID()] {
			phases = append(phases, p.Name())
		}
		assert.ElementsMatch(t, []string{telemetry.SpanQueue, telemetry.SpanPrefill, telemetry.SpanDecode}, phases, name)
	}

	// The latency histograms carry the trace id as an exemplar.
	for _, family := range []string{"troupe_e2e_request_latency_seconds", "troupe_time_to_first_token_seconds"} {
		assert.True(t, hasExemplar(t, c, family, id.String()), family)
	}
}

func hasExemplar(t *testing.T, c *orchestratortest.Cluster, family, traceID string) bool {
	mfs, err := c.Metrics.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != family {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, b := range m.GetHistogram().GetBucket() {
				for _, l := range b.GetExemplar().GetLabel() {
					if l.GetName() == "trace_id" && l.GetValue() == traceID {
						return true
					}
				}
			}
		}
	}
	return false
}

func TestSpanTreeFailover(t *testing.T) {
	slow := sim.Config{DecodeTokenLatency: 20 * time.Millisecond}
	c, rec := tracedCluster(t, orchestratortest.Options{Pipeline: thinkerOnly, ReplicasPerStage: -1, Sim: slow})
	victim := c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{})
	c.WaitState(t, "thinker", victim.ReplicaID(), "attached")

	type result struct {
		id  trace.TraceID
		err error
	}
	done := make(chan result, 1)
	go func() {
		id, _, err := runTraced(ctxT(t), c, orchestrator.Request{ID: "f", Prompt: "x", Sampling: sampling(30, 1)})
		done <- result{id, err}
	}()
	require.Eventually(t, func() bool { return inFlight(c, victim.ReplicaID()) > 0 }, 30*time.Second, time.Millisecond)
	survivor := c.AddWorker(t, "thinker", orchestratortest.WorkerOptions{})
	c.WaitState(t, "thinker", survivor.ReplicaID(), "attached")
	victim.Kill(t)
	r := <-done
	require.NoError(t, r.err, "retried on the survivor")

	waitSpans(t, rec, r.id, telemetry.StageSpanName("thinker"), 2)
	tr := treeOf(rec, r.id)
	stages := tr.named(telemetry.StageSpanName("thinker"))
	require.Len(t, stages, 2)
	byAttempt := map[int64]sdktrace.ReadOnlySpan{}
	for _, s := range stages {
		byAttempt[attr(s, telemetry.KeyAttempt).AsInt64()] = s
	}
	first, second := byAttempt[1], byAttempt[2]
	require.NotNil(t, first)
	require.NotNil(t, second)
	assert.Equal(t, first.Parent().SpanID(), second.Parent().SpanID(), "the retry is a sibling")
	assert.Equal(t, codes.Error, first.Status().Code)
	assert.NotEmpty(t, first.Status().Description, "the failure's reason")
	assert.NotEqual(t, codes.Error, second.Status().Code)
	assert.Equal(t, int64(victim.ReplicaID()), attr(first, telemetry.KeyReplicaID).AsInt64())
	assert.Equal(t, int64(survivor.ReplicaID()), attr(second, telemetry.KeyReplicaID).AsInt64())
}

func TestSpanTreeCancelled(t *testing.T) {
	slow := sim.Config{DecodeTokenLatency: 20 * time.Millisecond}
	c, rec := tracedCluster(t, orchestratortest.Options{Pipeline: thinkerOnly, Sim: slow})
	ctx, cancel := context.WithCancel(ctxT(t))
	tracer := c.Head.TracerProvider().Tracer("test")
	ctx, root := tracer.Start(ctx, "client")
	var once sync.Once
	_, err := c.Head.Execute(ctx, orchestrator.Request{ID: "c", Prompt: "x", Sampling: &stagepb.SamplingParams{MaxTokens: 300, IgnoreEos: true}}, func(string) error {
		once.Do(cancel)
		return nil
	})
	root.End()
	require.Error(t, err)
	id := root.SpanContext().TraceID()
	waitSpans(t, rec, id, telemetry.StageSpanName("thinker"), 1)
	st := treeOf(rec, id).named(telemetry.StageSpanName("thinker"))[0]
	assert.Equal(t, codes.Error, st.Status().Code)
	var reason string
	for _, e := range st.Events() {
		if e.Name == "finish" {
			for _, kv := range e.Attributes {
				if kv.Key == "finish_reason" {
					reason = kv.Value.AsString()
				}
			}
		}
	}
	assert.Equal(t, "abort", reason, fmt.Sprint(st.Events()))
}
