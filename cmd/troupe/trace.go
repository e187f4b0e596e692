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

	"github.com/troupe-serving/troupe/internal/jaeger"
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
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: troupe trace ID [--jaeger URL] [--timeout D] [--width N]")
		fmt.Fprintln(fs.Output(), "ID is a trace id (hex) or a traceparent header value.")
		fs.PrintDefaults()
	}
	ids, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(ids) != 1 {
		fs.Usage()
		return errUsage
	}
	id, err := jaeger.ParseTraceID(ids[0])
	if err != nil {
		fmt.Fprintf(fs.Output(), "troupe trace: %v\n", err)
		fs.Usage()
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
		return fmt.Errorf("trace: trace %s not found in %s", id, strings.TrimRight(*jaegerURL, "/"))
	}
	if err != nil {
		return fmt.Errorf("trace: %w", err)
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
			return nil, errUsage
		}
	}
	return positional, nil
}
