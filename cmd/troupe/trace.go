package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/troupe-serving/troupe/internal/front/jaeger"
)

// runTrace prints one trace from Jaeger's query service as a waterfall.
//
//	troupe trace ID [--jaeger URL] [--timeout D] [--width N]
//
// ID is a trace id or a whole traceparent header value; flags may come
// before or after it.
func runTrace(ctx context.Context, args []string, stdout io.Writer) error {
	fs := newFlagSet("trace")
	jaegerURL := fs.String("jaeger", "http://localhost:16686", "base URL of the Jaeger query service (api_v3)")
	timeout := fs.Duration("timeout", 10*time.Second, "how long to wait for Jaeger")
	width := fs.Int("width", 40, "width of the timeline bars in characters")
	ids, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(ids) != 1 {
		fmt.Fprintf(fs.Output(), "troupe trace: want one TRACE_ID, got %d arguments; run 'troupe trace --help'\n", len(ids))
		return errUsage
	}
	id, err := jaeger.ParseTraceID(ids[0])
	if err != nil {
		fmt.Fprintf(fs.Output(), "troupe trace: %v; run 'troupe trace --help'\n", err)
		return errUsage
	}
	if *width < 10 || *width > 400 {
		fmt.Fprintf(fs.Output(), "troupe trace: --width %d: want 10 to 400\n", *width)
		return errUsage
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	t, err := jaeger.FetchTrace(ctx, &http.Client{}, *jaegerURL, id)
	if errors.Is(err, jaeger.ErrTraceNotFound) {
		return fmt.Errorf("trace %s not found in %s", id, strings.TrimRight(*jaegerURL, "/"))
	}
	if err != nil {
		return err
	}
	return jaeger.RenderWaterfall(stdout, t, jaeger.WaterfallOptions{BarWidth: *width})
}

// parseInterspersed parses flags that may come before, between or after
// positional arguments (the flag package stops at the first positional
// one), with parseFlags' precedence: flag > TROUPE_<FLAG> > default.
func parseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	if err := parseFlags(fs, args); err != nil {
		return nil, err
	}
	var positional []string
	for rest := fs.Args(); len(rest) > 0; rest = fs.Args() {
		positional = append(positional, rest[0])
		if err := fs.Parse(rest[1:]); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, &helpRequested{fs: fs}
			}
			fmt.Fprintf(fs.Output(), "Run '%s --help' for usage.\n", fs.Name())
			return nil, errUsage
		}
	}
	return positional, nil
}
