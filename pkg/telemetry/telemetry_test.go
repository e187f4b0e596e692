package telemetry

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"regexp"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// otelEnv is every variable Setup, the SDK or the exporters read that a
// developer's shell might set; cleanEnv blanks them for one test.
var otelEnv = []string{
	"OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES",
	"OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG",
	"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
	"OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
	"OTEL_EXPORTER_OTLP_INSECURE", "OTEL_EXPORTER_OTLP_TRACES_INSECURE",
	"OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
	"OTEL_EXPORTER_OTLP_COMPRESSION", "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
}

func cleanEnv(t *testing.T) {
	t.Helper()
	for _, k := range otelEnv {
		t.Setenv(k, "")
	}
}

func testCtx(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

var traceparentRE = regexp.MustCompile(`^00-[0-9a-f]{32}-[0-9a-f]{16}-0[01]$`)

func TestNoEndpointGivesIDsButExportsNothing(t *testing.T) {
	cleanEnv(t)
	// Even an always_on sampler from the environment must not make a
	// provider without exporter record spans.
	t.Setenv("OTEL_TRACES_SAMPLER", "always_on")
	ctx := testCtx(t)
	p, err := Setup(ctx, Config{ServiceName: "troupe-head"})
	require.NoError(t, err)
	assert.False(t, p.Enabled())
	assert.Empty(t, p.Endpoint())

	tr := p.Tracer("test")
	ctx1, s1 := tr.Start(ctx, "first")
	_, s2 := tr.Start(ctx, "second")
	_, child := tr.Start(ctx1, "child")
	for _, s := range []trace.Span{s1, s2, child} {
		sc := s.SpanContext()
		assert.True(t, sc.IsValid(), "span context must be valid")
		assert.False(t, sc.IsSampled())
		assert.Equal(t, trace.TraceFlags(0), sc.TraceFlags())
		assert.False(t, s.IsRecording(), "a disabled provider must not record")
		s.End()
	}
	assert.NotEqual(t, s1.SpanContext().TraceID(), s2.SpanContext().TraceID(), "each root gets its own trace id")
	assert.Equal(t, s1.SpanContext().TraceID(), child.SpanContext().TraceID(), "a child keeps its parent's trace id")

	h := TraceparentHeader(ctx1)
	require.Regexp(t, traceparentRE, h)
	assert.Equal(t, "00-"+s1.SpanContext().TraceID().String()+"-"+s1.SpanContext().SpanID().String()+"-00", h)
	require.NoError(t, p.Shutdown(ctx))
}

func TestExporterSwitchedOffByEnvironment(t *testing.T) {
	for name, env := range map[string][2]string{
		"exporter none": {"OTEL_TRACES_EXPORTER", "none"},
		"sdk disabled":  {"OTEL_SDK_DISABLED", "true"},
	} {
		t.Run(name, func(t *testing.T) {
			cleanEnv(t)
			col := startGRPCCollector(t)
			t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://"+col.addr)
			t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
			t.Setenv(env[0], env[1])
			ctx := testCtx(t)
			p, err := Setup(ctx, Config{ServiceName: "troupe-head", Endpoint: col.addr})
			require.NoError(t, err)
			assert.False(t, p.Enabled())
			_, s := p.Tracer("test").Start(ctx, "root")
			assert.True(t, s.SpanContext().IsValid())
			assert.False(t, s.SpanContext().IsSampled())
			s.End()
			require.NoError(t, p.Shutdown(ctx))
			assert.Empty(t, col.spans(), "nothing may reach the collector")
		})
	}
}

// remoteParent returns a context carrying a remote span context, as the
// propagator extracts it from an incoming request.
func remoteParent(sampled bool) context.Context {
	var flags trace.TraceFlags
	if sampled {
		flags = trace.FlagsSampled
	}
	sc := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID:    trace.TraceID{0x4b, 0xf9, 0x2f, 0x35, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12},
		SpanID:     trace.SpanID{0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7},
		TraceFlags: flags,
		Remote:     true,
	})
	return trace.ContextWithRemoteSpanContext(context.Background(), sc)
}

func TestSamplerEnvironmentWinsOverDefault(t *testing.T) {
	// skipRoot: a ratio sampler's decision on a random root is not asserted.
	type want struct{ root, underSampled, underUnsampled, skipRoot bool }
	cases := []struct {
		name         string
		sampler, arg string
		cfg          Config
		want         want
		desc         string
	}{
		{name: "head default", cfg: Config{DefaultRatio: 1},
			want: want{root: true, underSampled: true, underUnsampled: false}, desc: "ParentBased{root:TraceIDRatioBased{1}"},
		{name: "zero config is ratio 1", cfg: Config{},
			want: want{root: true, underSampled: true, underUnsampled: false}, desc: "ParentBased{root:TraceIDRatioBased{1}"},
		{name: "worker default", cfg: Config{DefaultRatio: 1, ParentBasedOnly: true},
			want: want{root: false, underSampled: true, underUnsampled: false}, desc: "ParentBased{root:AlwaysOffSampler"},
		{name: "ratio default", cfg: Config{DefaultRatio: 0.25},
			want: want{skipRoot: true, underSampled: true}, desc: "ParentBased{root:TraceIDRatioBased{0.25}"},
		{name: "always_off beats head", sampler: "always_off", cfg: Config{DefaultRatio: 1},
			want: want{root: false, underSampled: false, underUnsampled: false}, desc: "AlwaysOffSampler"},
		{name: "always_on beats worker", sampler: "always_on", cfg: Config{ParentBasedOnly: true},
			want: want{root: true, underSampled: true, underUnsampled: true}, desc: "AlwaysOnSampler"},
		{name: "parentbased_always_off", sampler: "parentbased_always_off", cfg: Config{DefaultRatio: 1},
			want: want{root: false, underSampled: true, underUnsampled: false}, desc: "ParentBased{root:AlwaysOffSampler"},
		{name: "traceidratio 0", sampler: "traceidratio", arg: "0", cfg: Config{DefaultRatio: 1},
			want: want{root: false, underSampled: false, underUnsampled: false}, desc: "TraceIDRatioBased{0}"},
		{name: "parentbased_traceidratio 0", sampler: "PARENTBASED_TRACEIDRATIO", arg: "0", cfg: Config{DefaultRatio: 1},
			want: want{root: false, underSampled: true, underUnsampled: false}, desc: "ParentBased{root:TraceIDRatioBased{0}"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cleanEnv(t)
			t.Setenv("OTEL_TRACES_SAMPLER", tc.sampler)
			t.Setenv("OTEL_TRACES_SAMPLER_ARG", tc.arg)
			ctx := testCtx(t)
			exp := tracetest.NewInMemoryExporter()
			p, err := setup(ctx, tc.cfg, exp)
			require.NoError(t, err)
			require.True(t, p.Enabled())
			assert.Contains(t, p.Sampler().Description(), tc.desc)

			tr := p.Tracer("test")
			_, root := tr.Start(ctx, "root")
			_, underSampled := tr.Start(remoteParent(true), "under-sampled")
			_, underUnsampled := tr.Start(remoteParent(false), "under-unsampled")
			var wantNames []string
			if !tc.want.skipRoot {
				assert.Equal(t, tc.want.root, root.SpanContext().IsSampled(), "root")
				assert.Equal(t, tc.want.underUnsampled, underUnsampled.SpanContext().IsSampled(), "under an unsampled parent")
				if tc.want.root {
					wantNames = append(wantNames, "root")
				}
				if tc.want.underUnsampled {
					wantNames = append(wantNames, "under-unsampled")
				}
			}
			assert.Equal(t, tc.want.underSampled, underSampled.SpanContext().IsSampled(), "under a sampled parent")
			if tc.want.underSampled {
				wantNames = append(wantNames, "under-sampled")
			}
			root.End()
			underSampled.End()
			underUnsampled.End()

			// What was sampled, and only that, reaches the exporter.
			require.NoError(t, p.ForceFlush(ctx))
			var got []string
			for _, s := range exp.GetSpans() {
				if tc.want.skipRoot && s.Name == "root" {
					continue
				}
				got = append(got, s.Name)
			}
			assert.ElementsMatch(t, wantNames, got)
			require.NoError(t, p.Shutdown(ctx))
		})
	}
}

func TestSetupRejectsBadConfiguration(t *testing.T) {
	cases := []struct {
		name       string
		env        map[string]string
		cfg        Config
		noEndpoint bool
	}{
		{name: "unknown sampler", env: map[string]string{"OTEL_TRACES_SAMPLER": "jaeger_remote"}},
		{name: "unknown sampler without endpoint", env: map[string]string{"OTEL_TRACES_SAMPLER": "always"}, noEndpoint: true},
		{name: "sampler arg not a number", env: map[string]string{"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "half"}},
		{name: "sampler arg above 1", env: map[string]string{"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}},
		{name: "unknown exporter", env: map[string]string{"OTEL_TRACES_EXPORTER": "zipkin"}},
		{name: "bad sdk disabled", env: map[string]string{"OTEL_SDK_DISABLED": "maybe"}},
		{name: "unknown protocol flag", cfg: Config{Endpoint: "127.0.0.1:4317", Protocol: "thrift"}},
		{name: "unknown protocol env", env: map[string]string{"OTEL_EXPORTER_OTLP_PROTOCOL": "udp"}},
		{name: "bad endpoint scheme", cfg: Config{Endpoint: "ftp://127.0.0.1:4317"}},
		{name: "endpoint without host", cfg: Config{Endpoint: "http://"}},
		{name: "ratio above 1", cfg: Config{DefaultRatio: 1.5}},
		{name: "negative ratio", cfg: Config{DefaultRatio: -0.1}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cleanEnv(t)
			t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
			if tc.noEndpoint {
				t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "")
			}
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			p, err := Setup(testCtx(t), tc.cfg)
			require.Error(t, err)
			assert.Nil(t, p)
			assert.Regexp(t, `^telemetry: `, err.Error())
		})
	}
}

// grpcCollector is a real OTLP/gRPC trace service on loopback.
type grpcCollector struct {
	collectortrace.UnimplementedTraceServiceServer
	addr string

	mu   sync.Mutex
	reqs []*collectortrace.ExportTraceServiceRequest
}

func (c *grpcCollector) Export(_ context.Context, req *collectortrace.ExportTraceServiceRequest) (*collectortrace.ExportTraceServiceResponse, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.reqs = append(c.reqs, proto.Clone(req).(*collectortrace.ExportTraceServiceRequest))
	return &collectortrace.ExportTraceServiceResponse{}, nil
}

func (c *grpcCollector) spans() []*tracepb.ResourceSpans {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []*tracepb.ResourceSpans
	for _, r := range c.reqs {
		out = append(out, r.ResourceSpans...)
	}
	return out
}

func startGRPCCollector(t *testing.T) *grpcCollector {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	c := &grpcCollector{addr: lis.Addr().String()}
	srv := grpc.NewServer()
	collectortrace.RegisterTraceServiceServer(srv, c)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-done
	})
	return c
}

// httpCollector is an OTLP/HTTP trace receiver on loopback that decodes
// protobuf bodies and keeps JSON ones raw.
type httpCollector struct {
	*httptest.Server

	mu           sync.Mutex
	paths        []string
	contentTypes []string
	resource     []*tracepb.ResourceSpans
	jsonBodies   [][]byte
}

func startHTTPCollector(t *testing.T) *httpCollector {
	t.Helper()
	c := &httpCollector{}
	c.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		c.mu.Lock()
		defer c.mu.Unlock()
		c.paths = append(c.paths, r.URL.Path)
		ct := r.Header.Get("Content-Type")
		c.contentTypes = append(c.contentTypes, ct)
		switch ct {
		case "application/x-protobuf":
			var req collectortrace.ExportTraceServiceRequest
			if err := proto.Unmarshal(body, &req); err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			c.resource = append(c.resource, req.ResourceSpans...)
			out, _ := proto.Marshal(&collectortrace.ExportTraceServiceResponse{})
			w.Header().Set("Content-Type", "application/x-protobuf")
			_, _ = w.Write(out)
		case "application/json":
			c.jsonBodies = append(c.jsonBodies, body)
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{}`))
		default:
			http.Error(w, "unsupported content type "+ct, http.StatusUnsupportedMediaType)
		}
	}))
	t.Cleanup(c.Close)
	return c
}

func (c *httpCollector) snapshot() (paths, contentTypes []string, rs []*tracepb.ResourceSpans, jsonBodies [][]byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.paths...), append([]string(nil), c.contentTypes...),
		append([]*tracepb.ResourceSpans(nil), c.resource...), append([][]byte(nil), c.jsonBodies...)
}

// emitTree starts and ends a request span with one stage child.
func emitTree(ctx context.Context, p *Provider) (traceID string) {
	tr := p.Tracer("github.com/troupe-serving/troupe/test")
	ctx, req := tr.Start(ctx, SpanRequest)
	_, stage := tr.Start(ctx, StageSpanName("thinker"), trace.WithAttributes(StageAttributes(0, "thinker", 1, 3, 1)...))
	stage.End()
	req.End()
	return req.SpanContext().TraceID().String()
}

func resourceAttrs(rs *tracepb.ResourceSpans) map[string]string {
	out := map[string]string{}
	for _, kv := range rs.GetResource().GetAttributes() {
		out[kv.Key] = anyValueString(kv.Value)
	}
	return out
}

func anyValueString(v *commonpb.AnyValue) string {
	switch x := v.GetValue().(type) {
	case *commonpb.AnyValue_StringValue:
		return x.StringValue
	}
	return v.String()
}

// checkExported asserts the request tree arrived with troupe's resource.
func checkExported(t *testing.T, rss []*tracepb.ResourceSpans, traceID string, wantResource map[string]string) {
	t.Helper()
	require.NotEmpty(t, rss, "no spans reached the collector")
	byName := map[string]*tracepb.Span{}
	for _, rs := range rss {
		attrs := resourceAttrs(rs)
		for k, v := range wantResource {
			assert.Equal(t, v, attrs[k], "resource attribute %s", k)
		}
		assert.NotEmpty(t, attrs["telemetry.sdk.language"])
		for _, ss := range rs.ScopeSpans {
			for _, s := range ss.Spans {
				byName[s.Name] = s
			}
		}
	}
	req, stage := byName[SpanRequest], byName["troupe.stage thinker"]
	require.NotNil(t, req, "troupe.request missing")
	require.NotNil(t, stage, "troupe.stage thinker missing")
	assert.Equal(t, traceID, hexID(req.TraceId))
	assert.Equal(t, req.SpanId, stage.ParentSpanId, "the stage span is the request's child")
	attrs := map[string]*commonpb.AnyValue{}
	for _, kv := range stage.Attributes {
		attrs[kv.Key] = kv.Value
	}
	assert.Equal(t, "thinker", attrs["troupe.stage.name"].GetStringValue())
	assert.Equal(t, int64(1), attrs["troupe.replica.id"].GetIntValue())
	assert.Equal(t, int64(3), attrs["troupe.engine.index"].GetIntValue())
}

func hexID(b []byte) string {
	const digits = "0123456789abcdef"
	out := make([]byte, 0, 2*len(b))
	for _, c := range b {
		out = append(out, digits[c>>4], digits[c&15])
	}
	return string(out)
}

func TestExportGRPCFromFlags(t *testing.T) {
	cleanEnv(t)
	t.Setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment.name=ci,troupe.cluster=blue")
	col := startGRPCCollector(t)
	ctx := testCtx(t)
	p, err := Setup(ctx, Config{
		ServiceName: "troupe-head", ServiceVersion: "1.2.3", InstanceID: "head-7",
		Endpoint: col.addr, // bare host:port means plain http
		Protocol: ProtocolGRPC,
	})
	require.NoError(t, err)
	require.True(t, p.Enabled())
	assert.Equal(t, ProtocolGRPC, p.Protocol())
	traceID := emitTree(ctx, p)
	// Shutdown alone must deliver the queued spans: no waiting afterwards.
	require.NoError(t, p.Shutdown(ctx))
	checkExported(t, col.spans(), traceID, map[string]string{
		"service.name": "troupe-head", "service.version": "1.2.3", "service.instance.id": "head-7",
		"deployment.environment.name": "ci", "troupe.cluster": "blue",
	})
}

func TestExportGRPCFromEnvironment(t *testing.T) {
	cleanEnv(t)
	col := startGRPCCollector(t)
	t.Setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://"+col.addr)
	t.Setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf") // the per-signal variable wins
	t.Setenv("OTEL_SERVICE_NAME", "renamed-by-operator")
	ctx := testCtx(t)
	p, err := Setup(ctx, Config{ServiceName: "troupe-worker", ParentBasedOnly: true})
	require.NoError(t, err)
	require.True(t, p.Enabled())
	assert.Equal(t, "http://"+col.addr, p.Endpoint())
	// A worker records what its caller sampled.
	traceID := emitTree(remoteParentIn(ctx), p)
	require.NoError(t, p.Shutdown(ctx))
	checkExported(t, col.spans(), traceID, map[string]string{
		"service.name": "renamed-by-operator", "service.instance.id": DefaultInstanceID(),
	})
}

// remoteParentIn is remoteParent(true) under ctx's deadline.
func remoteParentIn(ctx context.Context) context.Context {
	return trace.ContextWithRemoteSpanContext(ctx, trace.SpanContextFromContext(remoteParent(true)))
}

func TestExportHTTPProtobufFromFlagsBeatsEnvironment(t *testing.T) {
	cleanEnv(t)
	col := startHTTPCollector(t)
	// The environment points elsewhere with another protocol: the flags win.
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
	ctx := testCtx(t)
	p, err := Setup(ctx, Config{ServiceName: "troupe-head", InstanceID: "h1", Endpoint: col.URL, Protocol: ProtocolHTTPProtobuf})
	require.NoError(t, err)
	traceID := emitTree(ctx, p)
	require.NoError(t, p.Shutdown(ctx))
	paths, cts, rss, _ := col.snapshot()
	require.NotEmpty(t, paths)
	assert.Equal(t, "/v1/traces", paths[0], "a flag URL without a path gets /v1/traces")
	assert.Equal(t, "application/x-protobuf", cts[0])
	checkExported(t, rss, traceID, map[string]string{"service.name": "troupe-head", "service.instance.id": "h1"})
}

func TestExportHTTPProtobufFromEnvironment(t *testing.T) {
	cleanEnv(t)
	col := startHTTPCollector(t)
	// A base URL: the exporter appends /v1/traces to its path.
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", col.URL+"/otlp")
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
	ctx := testCtx(t)
	p, err := Setup(ctx, Config{ServiceName: "troupe-head"})
	require.NoError(t, err)
	traceID := emitTree(ctx, p)
	require.NoError(t, p.Shutdown(ctx))
	paths, _, rss, _ := col.snapshot()
	require.NotEmpty(t, paths)
	assert.Equal(t, "/otlp/v1/traces", paths[0])
	checkExported(t, rss, traceID, map[string]string{"service.name": "troupe-head"})
}

func TestTraceparentHeader(t *testing.T) {
	assert.Empty(t, TraceparentHeader(context.Background()))
	sampled := remoteParent(true)
	assert.Equal(t, "00-4bf92f350102030405060708090a0b0c-00f067aa0ba902b7-01", TraceparentHeader(sampled))
	assert.Equal(t, "00-4bf92f350102030405060708090a0b0c-00f067aa0ba902b7-00", TraceparentHeader(remoteParent(false)))

	// The header is exactly what the W3C propagator injects.
	carrier := propagation.MapCarrier{}
	(&Provider{}).Propagator().Inject(sampled, carrier)
	assert.Equal(t, carrier.Get("traceparent"), TraceparentHeader(sampled))
}

func TestPropagatorCarriesTraceContextAndBaggage(t *testing.T) {
	var p *Provider // a nil provider still propagates
	member, err := baggage.NewMember("tenant", "acme")
	require.NoError(t, err)
	bag, err := baggage.New(member)
	require.NoError(t, err)
	ctx := baggage.ContextWithBaggage(remoteParent(true), bag)

	h := http.Header{}
	p.Propagator().Inject(ctx, propagation.HeaderCarrier(h))
	assert.Equal(t, "00-4bf92f350102030405060708090a0b0c-00f067aa0ba902b7-01", h.Get("traceparent"))
	assert.Equal(t, "tenant=acme", h.Get("baggage"))

	out := p.Propagator().Extract(context.Background(), propagation.HeaderCarrier(h))
	assert.Equal(t, trace.SpanContextFromContext(ctx).TraceID(), trace.SpanContextFromContext(out).TraceID())
	assert.True(t, trace.SpanContextFromContext(out).IsSampled())
	assert.Equal(t, "acme", baggage.FromContext(out).Member("tenant").Value())
	assert.NotNil(t, p.TracerProvider())
	assert.False(t, p.Enabled())
	assert.NoError(t, p.Shutdown(context.Background()))
}

// BenchmarkDisabledSpan measures a span of a provider without exporter: the
// cost every request pays when tracing is off. Target: well under 1µs.
func BenchmarkDisabledSpan(b *testing.B) {
	for _, k := range otelEnv {
		b.Setenv(k, "")
	}
	p, err := Setup(context.Background(), Config{})
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = p.Shutdown(context.Background()) }()
	tr := p.Tracer("bench")
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		c, s := tr.Start(ctx, "span")
		_ = TraceparentHeader(c)
		s.End()
	}
}
