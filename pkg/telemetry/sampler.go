package telemetry

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

const (
	envSampler    = "OTEL_TRACES_SAMPLER"
	envSamplerArg = "OTEL_TRACES_SAMPLER_ARG"
)

// samplerFromEnv reads OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG as
// the OpenTelemetry specification defines them. It returns nil when the
// variable is unset, and an error for a sampler or argument it cannot honour:
// the SDK would only log those and sample everything, which is the wrong
// surprise for someone who asked for less.
func samplerFromEnv() (sdktrace.Sampler, error) {
	name := strings.ToLower(strings.TrimSpace(os.Getenv(envSampler)))
	if name == "" {
		return nil, nil
	}
	arg := strings.TrimSpace(os.Getenv(envSamplerArg))
	ratio := func() (float64, error) {
		if arg == "" {
			return 1, nil
		}
		v, err := strconv.ParseFloat(arg, 64)
		if err != nil {
			return 0, fmt.Errorf("telemetry: %s=%q: %w", envSamplerArg, arg, err)
		}
		if v < 0 || v > 1 {
			return 0, fmt.Errorf("telemetry: %s=%q is outside [0, 1]", envSamplerArg, arg)
		}
		return v, nil
	}
	switch name {
	case "always_on":
		return sdktrace.AlwaysSample(), nil
	case "always_off":
		return sdktrace.NeverSample(), nil
	case "traceidratio":
		r, err := ratio()
		if err != nil {
			return nil, err
		}
		return sdktrace.TraceIDRatioBased(r), nil
	case "parentbased_always_on":
		return sdktrace.ParentBased(sdktrace.AlwaysSample()), nil
	case "parentbased_always_off":
		return sdktrace.ParentBased(sdktrace.NeverSample()), nil
	case "parentbased_traceidratio":
		r, err := ratio()
		if err != nil {
			return nil, err
		}
		return sdktrace.ParentBased(sdktrace.TraceIDRatioBased(r)), nil
	default:
		return nil, fmt.Errorf("telemetry: %s=%q is not supported (always_on, always_off, traceidratio, parentbased_always_on, parentbased_always_off, parentbased_traceidratio)", envSampler, name)
	}
}
