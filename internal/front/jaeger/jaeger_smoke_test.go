package jaeger_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/troupe-serving/troupe/internal/front/jaeger"
	"github.com/troupe-serving/troupe/internal/front/jaeger/jaegertest"
	"github.com/troupe-serving/troupe/pkg/telemetry"
)

// TestJaegerSmoke starts a real Jaeger v2 (TROUPE_JAEGER_BIN, built by
// scripts/build-jaeger.sh) with tools/jaeger/config.yaml on free loopback
// ports, sends a troupe-shaped trace over OTLP gRPC and over OTLP HTTP
// through telemetry.Setup, and reads each back through /api/v3/traces/{id}, the path
// `troupe trace` uses. With TROUPE_BIN set it also runs `troupe trace`.
// scripts/jaeger-smoke.sh runs it; without TROUPE_JAEGER_BIN it skips.
// TROUPE_JAEGER_RECORD=FILE saves Jaeger's answer (testdata is made so).
func TestJaegerSmoke(t *testing.T) {
	bin := os.Getenv("TROUPE_JAEGER_BIN")
	if bin == "" {
		t.Skip("TROUPE_JAEGER_BIN is not set; scripts/jaeger-smoke.sh builds Jaeger and sets it")
	}
	config := os.Getenv("TROUPE_JAEGER_CONFIG")
	if config == "" {
		config = filepath.Join("..", "..", "tools", "jaeger", "config.yaml")
	}
	cleanEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	j := jaegertest.Start(ctx, t, bin, config)
	for _, proto := range []string{telemetry.ProtocolGRPC, telemetry.ProtocolHTTPProtobuf} {
		t.Run(proto, func(t *testing.T) {
			endpoint := "http://" + j.OTLPHTTP
			if proto == telemetry.ProtocolGRPC {
				endpoint = "http://" + j.OTLPGRPC
			}
			head, err := telemetry.Setup(ctx, telemetry.Config{ServiceName: "troupe-head", ServiceVersion: "smoke", Endpoint: endpoint, Protocol: proto})
			require.NoError(t, err)
			worker, err := telemetry.Setup(ctx, telemetry.Config{ServiceName: "troupe-worker", Endpoint: endpoint, Protocol: proto, ParentBasedOnly: true})
			require.NoError(t, err)
			traceID := emitPipeline(ctx, head, worker, time.Now().Add(-time.Second).Truncate(time.Millisecond))
			require.NoError(t, head.Shutdown(ctx))
			require.NoError(t, worker.Shutdown(ctx))

			// Jaeger stores asynchronously (batch processor): poll, bounded.
			var tr *jaeger.Trace
			jaegertest.WaitFor(ctx, t, 30*time.Second, func() error {
				got, err := jaeger.FetchTrace(ctx, nil, j.Query, traceID)
				if err != nil {
					return err
				}
				if len(got.Spans) != pipelineSpans {
					return fmt.Errorf("%d of %d spans stored", len(got.Spans), pipelineSpans)
				}
				tr = got
				return nil
			})
			checkPipelineTrace(t, tr, traceID)

			if path := os.Getenv("TROUPE_JAEGER_RECORD"); path != "" && proto == telemetry.ProtocolGRPC {
				url, err := jaeger.TraceURL(j.Query, traceID)
				require.NoError(t, err)
				resp, err := http.Get(url)
				require.NoError(t, err)
				body, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				require.NoError(t, err)
				require.NoError(t, os.WriteFile(path, body, 0o644))
			}

			if troupe := os.Getenv("TROUPE_BIN"); troupe != "" {
				var want bytes.Buffer
				require.NoError(t, jaeger.RenderWaterfall(&want, tr, jaeger.WaterfallOptions{}))
				out, err := exec.CommandContext(ctx, troupe, "trace", traceID, "--jaeger", j.Query).CombinedOutput()
				require.NoError(t, err, "troupe trace: %s", out)
				assert.Equal(t, want.String(), string(out))
			}
		})
	}

	t.Run("not found", func(t *testing.T) {
		_, err := jaeger.FetchTrace(ctx, nil, j.Query, "0123456789abcdef0123456789abcdef")
		require.ErrorIs(t, err, jaeger.ErrTraceNotFound)
		if troupe := os.Getenv("TROUPE_BIN"); troupe != "" {
			out, err := exec.CommandContext(ctx, troupe, "trace", "--jaeger", j.Query, "0123456789abcdef0123456789abcdef").CombinedOutput()
			var exit *exec.ExitError
			require.ErrorAs(t, err, &exit)
			assert.Equal(t, 1, exit.ExitCode())
			assert.Contains(t, string(out), "trace: trace 0123456789abcdef0123456789abcdef not found in "+j.Query)
		}
	})
}

// pipelineSpans is how many spans emitPipeline creates.
const pipelineSpans = 16

// emitPipeline records the span tree of docs/contracts.md for a two-stage request
// whose first thinker attempt fails, with fixed offsets from base: the head
// (otelhttp server span, troupe.request, troupe.stage attempts, gRPC client
// spans) and the worker (gRPC server spans, queue/prefill/decode), joined
// through the W3C propagator as over the wire.
func emitPipeline(ctx context.Context, head, worker *telemetry.Provider, base time.Time) (traceID string) {
	at := func(ms int) time.Time { return base.Add(time.Duration(ms) * time.Millisecond) }
	ht := head.Tracer("github.com/troupe-serving/troupe/orchestrator")
	wt := worker.Tracer("github.com/troupe-serving/troupe/worker")
	type span struct {
		ctx context.Context
		s   trace.Span
	}
	start := func(tr trace.Tracer, parent context.Context, name string, kind trace.SpanKind, from int, attrs ...[]attribute.KeyValue) span {
		opts := []trace.SpanStartOption{trace.WithTimestamp(at(from)), trace.WithSpanKind(kind)}
		for _, a := range attrs {
			opts = append(opts, trace.WithAttributes(a...))
		}
		c, s := tr.Start(parent, name, opts...)
		return span{c, s}
	}
	end := func(s span, ms int) { s.s.End(trace.WithTimestamp(at(ms))) }
	fail := func(s span, msg string) { s.s.SetStatus(codes.Error, msg) }

	// Over the wire: the client span's context travels in gRPC metadata.
	wire := func(client span) context.Context {
		carrier := propagation.MapCarrier{}
		head.Propagator().Inject(client.ctx, carrier)
		return worker.Propagator().Extract(ctx, carrier)
	}
	const method = "troupe.stage.v1.StageService/Generate"
	stageAttempt := func(parent context.Context, stageID int, stage string, replica uint64, engine, attempt, from, to int, errMsg string) {
		st := start(ht, parent, telemetry.StageSpanName(stage), trace.SpanKindInternal, from,
			telemetry.StageAttributes(stageID, stage, replica, engine, attempt), telemetry.GenAIUsageAttributes(12, 34, "stop"))
		cl := start(ht, st.ctx, method, trace.SpanKindClient, from+1)
		if errMsg != "" {
			fail(cl, errMsg)
			fail(st, errMsg)
		} else {
			srv := start(wt, wire(cl), method, trace.SpanKindServer, from+2,
				[]attribute.KeyValue{telemetry.KeyReplicaID.Int64(int64(replica)), telemetry.KeyStageName.String(stage)})
			q := start(wt, srv.ctx, telemetry.SpanQueue, trace.SpanKindInternal, from+2)
			end(q, from+4)
			p := start(wt, srv.ctx, telemetry.SpanPrefill, trace.SpanKindInternal, from+4)
			end(p, from+12)
			d := start(wt, srv.ctx, telemetry.SpanDecode, trace.SpanKindInternal, from+12)
			end(d, to-3)
			end(srv, to-2)
		}
		end(cl, to-1)
		end(st, to)
	}

	root := start(ht, ctx, "POST /v1/chat/completions", trace.SpanKindServer, 0,
		[]attribute.KeyValue{attribute.String("http.request.method", "POST")})
	req := start(ht, root.ctx, telemetry.SpanRequest, trace.SpanKindInternal, 1,
		telemetry.GenAIRequestAttributes(telemetry.GenAIOperationChat, "troupe-omni-sim", 64, nil))
	stageAttempt(req.ctx, 0, "thinker", 0, 0, 1, 2, 10, "replica thinker/0 unavailable")
	stageAttempt(req.ctx, 0, "thinker", 2, 1, 2, 11, 60, "")
	stageAttempt(req.ctx, 1, "talker", 1, 2, 1, 61, 98, "")
	end(req, 99)
	end(root, 100)
	return root.s.SpanContext().TraceID().String()
}

// checkPipelineTrace asserts the tree Jaeger returned is emitPipeline's.
func checkPipelineTrace(t *testing.T, tr *jaeger.Trace, traceID string) {
	t.Helper()
	require.NotNil(t, tr)
	assert.Equal(t, traceID, tr.TraceID)
	byID := map[string]jaeger.Span{}
	count := map[string]int{}
	services := map[string]int{}
	for _, s := range tr.Spans {
		byID[s.SpanID] = s
		count[s.Name]++
		services[s.Service]++
	}
	assert.Equal(t, map[string]int{"troupe-head": 8, "troupe-worker": 8}, services)
	assert.Equal(t, 2, count["troupe.stage thinker"])
	assert.Equal(t, 1, count["troupe.stage talker"])
	assert.Equal(t, 2, count[telemetry.SpanDecode])
	var errs int
	for _, s := range tr.Spans {
		if s.Error {
			errs++
			assert.Equal(t, "replica thinker/0 unavailable", s.StatusMessage)
		}
		if s.Name == telemetry.SpanDecode {
			parent := byID[s.ParentSpanID]
			assert.Equal(t, "troupe.stage.v1.StageService/Generate", parent.Name)
			assert.Equal(t, "server", parent.Kind)
			assert.Equal(t, "troupe-worker", parent.Service)
			client := byID[parent.ParentSpanID]
			assert.Equal(t, "client", client.Kind)
			assert.Equal(t, "troupe-head", client.Service)
			stage := byID[client.ParentSpanID]
			assert.Equal(t, parent.Attributes["troupe.replica.id"], stage.Attributes["troupe.replica.id"])
			assert.Equal(t, telemetry.SpanRequest, byID[stage.ParentSpanID].Name)
		}
	}
	assert.Equal(t, 2, errs, "the failed attempt and its client span")
	var buf bytes.Buffer
	require.NoError(t, jaeger.RenderWaterfall(&buf, tr, jaeger.WaterfallOptions{}))
	t.Logf("waterfall:\n%s", buf.String())
	assert.Contains(t, buf.String(), "trace "+traceID+": 16 spans, 2 services, 100ms")
}
