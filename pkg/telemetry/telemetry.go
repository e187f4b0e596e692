// Package telemetry sets up OpenTelemetry tracing for troupe's processes:
// the OTLP exporter, the sampler, the resource and the W3C propagators. It
// also holds the span attribute keys, a slog handler that stamps trace ids on
// log records, and the Jaeger query client and waterfall renderer behind
// `troupe trace`.
//
// Configuration follows the OpenTelemetry environment variables; the few
// fields of Config that mirror flags win over them:
//
//	endpoint  Config.Endpoint > OTEL_EXPORTER_OTLP_TRACES_ENDPOINT > OTEL_EXPORTER_OTLP_ENDPOINT
//	protocol  Config.Protocol > OTEL_EXPORTER_OTLP_TRACES_PROTOCOL > OTEL_EXPORTER_OTLP_PROTOCOL > http/protobuf
//	sampler   OTEL_TRACES_SAMPLER(_ARG) > Config (ParentBased(TraceIDRatio(DefaultRatio)))
//	resource  OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES > Config
//
// With no endpoint at all (or OTEL_TRACES_EXPORTER=none, or
// OTEL_SDK_DISABLED=true) nothing is exported, and the provider never
// samples: spans still carry valid, random trace and span ids (flags 00), so
// every response can carry a traceparent, at the cost of two random numbers.
package telemetry

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/resolver"
)

// Protocols of the OTLP exporter, as OTEL_EXPORTER_OTLP_PROTOCOL spells them.
const (
	ProtocolGRPC         = "grpc"
	ProtocolHTTPProtobuf = "http/protobuf"
	ProtocolHTTPJSON     = "http/json"
)

// Environment variables read here. The exporters read the rest of
// OTEL_EXPORTER_OTLP_* (headers, TLS, timeout, compression) themselves, and
// the batch span processor reads OTEL_BSP_*.
const (
	envSDKDisabled    = "OTEL_SDK_DISABLED"
	envTracesExporter = "OTEL_TRACES_EXPORTER"
	envEndpoint       = "OTEL_EXPORTER_OTLP_ENDPOINT"
	envTracesEndpoint = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
	envProtocol       = "OTEL_EXPORTER_OTLP_PROTOCOL"
	envTracesProtocol = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
)

// Config configures Setup. Its zero value is usable: it exports only when the
// environment names an endpoint, and samples every root trace.
type Config struct {
	// ServiceName is service.name, for example "troupe-head" or
	// "troupe-worker". Empty means "troupe". OTEL_SERVICE_NAME wins.
	ServiceName string
	// ServiceVersion is service.version (optional).
	ServiceVersion string
	// InstanceID is service.instance.id. Empty means "<hostname>-<pid>".
	InstanceID string

	// Endpoint overrides the OTLP endpoint of the environment (a flag).
	// It reads like OTEL_EXPORTER_OTLP_ENDPOINT: a URL such as
	// http://collector:4317 or https://collector:4318; a bare host:port means
	// plain http. For http/protobuf and http/json, /v1/traces is appended
	// when the URL has no path. Empty: the environment decides, and with no
	// endpoint there either, nothing is exported.
	Endpoint string
	// Protocol overrides OTEL_EXPORTER_OTLP(_TRACES)_PROTOCOL (a flag):
	// grpc, http/protobuf or http/json. Empty: the environment, then
	// http/protobuf (the OpenTelemetry default).
	Protocol string

	// DefaultRatio is the fraction of root traces (no sampled or unsampled
	// parent) that are sampled when OTEL_TRACES_SAMPLER is unset: the
	// sampler is ParentBased(TraceIDRatio(DefaultRatio)), so a request that
	// arrives with a traceparent follows its caller's decision. 0 means 1.0,
	// the design's default; it must lie in [0, 1].
	DefaultRatio float64
	// ParentBasedOnly samples no root traces at all when OTEL_TRACES_SAMPLER
	// is unset: ParentBased(NeverSample). Workers set it, so they record
	// exactly the traces the head sampled and nothing of their own (health
	// probes, for one).
	ParentBasedOnly bool

	// Logger receives the exporter's failures: the first, a reminder at
	// most every ExportLogInterval, and the recovery (nil:
	// slog.Default()). A failed batch is dropped and never reaches the
	// SDK's global error handler, so a collector that is absent costs a
	// line, and one more every ExportLogInterval, not a line a batch.
	Logger *slog.Logger
}

// Provider owns the tracer provider and its exporter. Its methods are safe
// for concurrent use, and a nil *Provider behaves as a disabled one.
type Provider struct {
	tp       *sdktrace.TracerProvider
	sampler  sdktrace.Sampler
	endpoint string // "" when disabled
	protocol string // "" when disabled
}

var propagator = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})

// Setup builds a Provider from cfg and the environment. It does not touch
// the global OpenTelemetry state: pass TracerProvider and Propagator to the
// instrumentation (otelhttp, otelgrpc). It returns an
// error for configuration that cannot work (an unknown protocol, sampler or
// exporter, a ratio out of range); connection problems are only reported
// later, to Config.Logger, because the collector may come up after us or
// not at all (an optional tracing backend).
// The caller must call Shutdown.
func Setup(ctx context.Context, cfg Config) (*Provider, error) {
	return setup(ctx, cfg, nil)
}

// setup is Setup; a non-nil exporter (tests) replaces the OTLP exporter and
// counts as an endpoint.
func setup(ctx context.Context, cfg Config, exporter sdktrace.SpanExporter) (*Provider, error) {
	ratio := cfg.DefaultRatio
	if ratio == 0 {
		ratio = 1
	}
	if ratio < 0 || ratio > 1 {
		return nil, fmt.Errorf("telemetry: default sampling ratio %v is outside [0, 1]", cfg.DefaultRatio)
	}
	endpoint, protocol, enabled, err := exportTarget(cfg)
	if err != nil {
		return nil, err
	}
	// Read even when nothing is exported, so a bad value shows at once
	// rather than on the day an endpoint is configured.
	sampler, err := samplerFromEnv()
	if err != nil {
		return nil, err
	}
	if exporter != nil && !enabled && protocol != "" {
		endpoint, enabled = "test", true
	}
	if !enabled {
		s := sdktrace.NeverSample()
		// No exporter, no processor: spans are non-recording but get real ids.
		return &Provider{tp: sdktrace.NewTracerProvider(sdktrace.WithSampler(s)), sampler: s}, nil
	}
	if sampler == nil {
		root := sdktrace.TraceIDRatioBased(ratio)
		if cfg.ParentBasedOnly {
			root = sdktrace.NeverSample()
		}
		sampler = sdktrace.ParentBased(root)
	}
	res, err := newResource(ctx, cfg)
	if err != nil {
		return nil, err
	}
	exp := exporter
	if exp == nil {
		if exp, err = newExporter(ctx, cfg.Endpoint, protocol); err != nil {
			return nil, err
		}
	}
	exp = newLoggedExporter(exp, cfg.Logger, endpoint)
	tp := sdktrace.NewTracerProvider(
		// Always passed: samplerFromEnv already honoured OTEL_TRACES_SAMPLER,
		// and WithSampler would override the SDK's own reading of it anyway.
		sdktrace.WithSampler(sampler),
		sdktrace.WithResource(res),
		sdktrace.WithBatcher(exp),
	)
	return &Provider{tp: tp, sampler: sampler, endpoint: endpoint, protocol: protocol}, nil
}

// exportTarget decides whether to export, where to and how. endpoint is
// for display only: the exporters resolve the environment themselves. When
// export is switched off (OTEL_SDK_DISABLED, OTEL_TRACES_EXPORTER=none)
// protocol is "" too; when only the endpoint is missing, it is not.
func exportTarget(cfg Config) (endpoint, protocol string, enabled bool, err error) {
	if v := strings.TrimSpace(os.Getenv(envSDKDisabled)); v != "" {
		disabled, perr := strconv.ParseBool(v)
		if perr != nil {
			return "", "", false, fmt.Errorf("telemetry: %s=%q: %w", envSDKDisabled, v, perr)
		}
		if disabled {
			return "", "", false, nil
		}
	}
	switch v := strings.ToLower(strings.TrimSpace(os.Getenv(envTracesExporter))); v {
	case "", "otlp":
	case "none":
		return "", "", false, nil
	default:
		return "", "", false, fmt.Errorf("telemetry: %s=%q is not supported (otlp or none)", envTracesExporter, v)
	}

	protocol = strings.TrimSpace(cfg.Protocol)
	if protocol == "" {
		protocol = firstEnv(envTracesProtocol, envProtocol)
	}
	if protocol == "" {
		protocol = ProtocolHTTPProtobuf
	}
	switch protocol {
	case ProtocolGRPC, ProtocolHTTPProtobuf, ProtocolHTTPJSON:
	default:
		return "", "", false, fmt.Errorf("telemetry: OTLP protocol %q is not supported (grpc, http/protobuf or http/json)", protocol)
	}

	endpoint = strings.TrimSpace(cfg.Endpoint)
	if endpoint != "" {
		if _, err := endpointURL(endpoint, protocol); err != nil {
			return "", "", false, err
		}
	} else {
		endpoint = firstEnv(envTracesEndpoint, envEndpoint)
	}
	if endpoint == "" {
		// protocol stays set: "disabled only for want of an endpoint".
		return "", protocol, false, nil
	}
	return endpoint, protocol, true, nil
}

func firstEnv(names ...string) string {
	for _, n := range names {
		if v := strings.TrimSpace(os.Getenv(n)); v != "" {
			return v
		}
	}
	return ""
}

// endpointURL turns the Endpoint flag into the URL handed to the exporter.
func endpointURL(endpoint, protocol string) (string, error) {
	raw := endpoint
	if !strings.Contains(raw, "://") {
		raw = "http://" + raw
	}
	u, err := url.Parse(raw)
	if err != nil {
		return "", fmt.Errorf("telemetry: OTLP endpoint %q: %w", endpoint, err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return "", fmt.Errorf("telemetry: OTLP endpoint %q: scheme must be http or https", endpoint)
	}
	if u.Host == "" {
		return "", fmt.Errorf("telemetry: OTLP endpoint %q has no host", endpoint)
	}
	if protocol != ProtocolGRPC && (u.Path == "" || u.Path == "/") {
		u.Path = "/v1/traces"
	}
	return u.String(), nil
}

func newExporter(ctx context.Context, flagEndpoint, protocol string) (*otlptrace.Exporter, error) {
	var u string
	if flagEndpoint != "" {
		var err error
		if u, err = endpointURL(flagEndpoint, protocol); err != nil {
			return nil, err
		}
	}
	var (
		exp *otlptrace.Exporter
		err error
	)
	switch protocol {
	case ProtocolGRPC:
		// Keepalive while an export is in flight: after a partition that
		// changes the collector's address (or ours), a call on the dead
		// connection would otherwise hang until TCP gives up (minutes),
		// losing every batch meanwhile. Without PermitWithoutStream an idle
		// connection sends no pings, so collectors' ping policy is not hit.
		//
		// The collector's name is resolved at every connection attempt
		// (passthrough, in place of gRPC's DNS resolver), and attempts are
		// at most 5 s apart: a collector that is absent at first (compose's
		// tracing profile turned on later) is found within seconds of
		// appearing, where gRPC's resolver, after failed lookups, waits up
		// to two minutes before it looks again.
		opts := []otlptracegrpc.Option{otlptracegrpc.WithDialOption(
			grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 10 * time.Second, Timeout: 5 * time.Second}),
			grpc.WithResolvers(dialTimeResolver{resolver.Get("passthrough")}),
			grpc.WithConnectParams(grpc.ConnectParams{
				Backoff:           backoff.Config{BaseDelay: time.Second, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 5 * time.Second},
				MinConnectTimeout: 5 * time.Second,
			}),
		)}
		if u != "" {
			opts = append(opts, otlptracegrpc.WithEndpointURL(u))
		}
		exp, err = otlptracegrpc.New(ctx, opts...)
	default:
		enc := otlptracehttp.EncodingProtobuf
		if protocol == ProtocolHTTPJSON {
			enc = otlptracehttp.EncodingJSON
		}
		// The encoding is always set: the flag's protocol must win over
		// an http/json or http/protobuf in the environment.
		opts := []otlptracehttp.Option{otlptracehttp.WithEncoding(enc)}
		if u != "" {
			opts = append(opts, otlptracehttp.WithEndpointURL(u))
		}
		exp, err = otlptracehttp.New(ctx, opts...)
	}
	if err != nil {
		return nil, fmt.Errorf("telemetry: OTLP %s exporter: %w", protocol, err)
	}
	return exp, nil
}

// dialTimeResolver is gRPC's passthrough resolver under the scheme "dns",
// the default of the exporter's target: the name goes to the dialer, which
// resolves it at every connection attempt.
type dialTimeResolver struct{ resolver.Builder }

func (dialTimeResolver) Scheme() string { return "dns" }

func newResource(ctx context.Context, cfg Config) (*resource.Resource, error) {
	name := cfg.ServiceName
	if name == "" {
		name = "troupe"
	}
	instance := cfg.InstanceID
	if instance == "" {
		instance = DefaultInstanceID()
	}
	attrs := []attribute.KeyValue{
		attribute.String("service.name", name),
		attribute.String("service.instance.id", instance),
	}
	if cfg.ServiceVersion != "" {
		attrs = append(attrs, attribute.String("service.version", cfg.ServiceVersion))
	}
	// Later options win: the environment overrides what the code says.
	res, err := resource.New(ctx,
		resource.WithTelemetrySDK(),
		resource.WithHost(),
		resource.WithProcessPID(),
		resource.WithAttributes(attrs...),
		resource.WithFromEnv(),
	)
	if err != nil {
		if res == nil || !errors.Is(err, resource.ErrPartialResource) {
			return nil, fmt.Errorf("telemetry: resource: %w", err)
		}
		// A partial resource (say, an unreadable hostname) still names the
		// service: better traces with one attribute missing than none.
	}
	return res, nil
}

// DefaultInstanceID is the service.instance.id used when Config has none:
// "<hostname>-<pid>", unique per process on a host and readable in Jaeger.
func DefaultInstanceID() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown"
	}
	return host + "-" + strconv.Itoa(os.Getpid())
}

// TracerProvider returns the provider to hand to instrumentation; never nil.
func (p *Provider) TracerProvider() trace.TracerProvider {
	if p == nil || p.tp == nil {
		return noop.NewTracerProvider()
	}
	return p.tp
}

// Tracer is TracerProvider().Tracer(name, opts...).
func (p *Provider) Tracer(name string, opts ...trace.TracerOption) trace.Tracer {
	return p.TracerProvider().Tracer(name, opts...)
}

// Propagator returns the W3C tracecontext + baggage propagator.
func (p *Provider) Propagator() propagation.TextMapPropagator { return propagator }

// Enabled reports whether spans are exported.
func (p *Provider) Enabled() bool { return p != nil && p.endpoint != "" }

// Endpoint is the OTLP endpoint spans go to ("" when disabled), for logs.
func (p *Provider) Endpoint() string {
	if p == nil {
		return ""
	}
	return p.endpoint
}

// Protocol is the OTLP protocol in use ("" when disabled), for logs.
func (p *Provider) Protocol() string {
	if p == nil {
		return ""
	}
	return p.protocol
}

// Sampler is the sampler in effect; its Description names it, for logs.
func (p *Provider) Sampler() sdktrace.Sampler {
	if p == nil || p.sampler == nil {
		return sdktrace.NeverSample()
	}
	return p.sampler
}

// Shutdown ends every span processor, exporting what is still queued, and
// closes the exporter. ctx bounds how long a slow collector may delay exit.
// Spans started afterwards are dropped. Calling it twice is harmless.
func (p *Provider) Shutdown(ctx context.Context) error {
	if p == nil || p.tp == nil {
		return nil
	}
	if err := p.tp.Shutdown(ctx); err != nil {
		return fmt.Errorf("telemetry: shutdown: %w", err)
	}
	return nil
}

// ForceFlush exports every ended span still queued, without shutting down.
func (p *Provider) ForceFlush(ctx context.Context) error {
	if p == nil || p.tp == nil {
		return nil
	}
	if err := p.tp.ForceFlush(ctx); err != nil {
		return fmt.Errorf("telemetry: flush: %w", err)
	}
	return nil
}

// TraceparentHeader returns the W3C traceparent header value of the span in
// ctx ("00-<trace-id>-<span-id>-<flags>"), or "" when ctx holds no valid
// span context.
func TraceparentHeader(ctx context.Context) string {
	sc := trace.SpanContextFromContext(ctx)
	if !sc.IsValid() {
		return ""
	}
	// One allocation: the string itself.
	var b [traceparentLen]byte
	copy(b[:], "00-")
	tid, sid := sc.TraceID(), sc.SpanID()
	hex.Encode(b[3:35], tid[:])
	b[35] = '-'
	hex.Encode(b[36:52], sid[:])
	copy(b[52:], "-00")
	if sc.IsSampled() {
		b[54] = '1'
	}
	return string(b[:])
}

// traceparentLen is the length of a version-00 traceparent header value.
const traceparentLen = len("00-") + 32 + len("-") + 16 + len("-00")
