// Command scrape1000 is the two halves of scripts/bench-scrape.sh:
//
//	scrape1000 serve -listen 127.0.0.1:18500 -replicas 1000
//	scrape1000 report -prometheus http://127.0.0.1:18501 -scrapes 5
//
// serve runs the head's real /metrics handler (httpapi, wired as troupe head
// wires it: the Go and process collectors and the HTTP metrics gathered, the
// per-replica stats written by a stats.Logger as the Exposer) for a Logger
// with -replicas replicas over three stages (K=2, a cache config), and
// records into every replica every -record-every (a chunk and a finished
// request with a fresh trace id, so every series and exemplar changes
// between scrapes) until it is stopped. It listens on loopback only.
//
// report waits until Prometheus has scraped the target -scrapes times, then
// asks its HTTP API what it saw (scrape_duration_seconds,
// scrape_samples_scraped, scrape_body_size_bytes, the target's health, a
// few series counts and the exemplars of TTFT) and what the target measured
// of its own answers (scrape1000_metrics_*: time from request to last byte,
// gzip included; bytes sent; the format negotiated), and prints a Markdown
// table. Prometheus' scrape_duration_seconds includes its parsing and
// storing of every sample, which the target's time does not.
// It exits 1 if a check fails.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/troupe-serving/troupe/internal/core/stats"
	"github.com/troupe-serving/troupe/internal/front/httpapi"
	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: scrape1000 serve|report [flags]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "serve":
		err = serve(os.Args[2:])
	case "report":
		err = report(os.Args[2:])
	default:
		err = fmt.Errorf("scrape1000: unknown command %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

var stageNames = []string{"thinker", "talker", "vocoder"}

func serve(args []string) error {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	listen := fs.String("listen", "127.0.0.1:18500", "loopback address to serve /metrics on")
	replicas := fs.Int("replicas", 1000, "stage replicas")
	every := fs.Duration("record-every", time.Second, "record into every replica this often")
	if err := fs.Parse(args); err != nil {
		return err
	}
	host, _, err := net.SplitHostPort(*listen)
	if err != nil {
		return fmt.Errorf("scrape1000: -listen: %w", err)
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		return fmt.Errorf("scrape1000: -listen %s is not a loopback address", *listen)
	}

	// As troupe head: gathered families on one registry, the stats on
	// their own, written by the Logger.
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	httpMetrics, err := httpapi.NewMetrics(reg)
	if err != nil {
		return err
	}
	if _, err := stats.NewPipeline(reg, "troupe-omni-sim", len(stageNames)); err != nil {
		return err
	}
	l, err := stats.New(prometheus.NewRegistry(), "troupe-omni-sim", stats.Options{StageNames: stageNames})
	if err != nil {
		return err
	}
	for i := range *replicas {
		if err := l.Register(i, stats.Replica{
			Stage: i % 3, StageName: stageNames[i%3], ReplicaID: uint32(i / 3), NumSpeculativeTokens: 2,
			Engine: "sim", Version: "bench", Addr: "127.0.0.1:1",
			Cache: &stagepb.CacheConfig{BlockSize: 16, NumKvBlocks: 4096, EnablePrefixCaching: true, MaxNumSeqs: 256},
		}); err != nil {
			return err
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	recordAll(l, *replicas, 0)
	go func() {
		t := time.NewTicker(*every)
		defer t.Stop()
		for n := 1; ; n++ {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				recordAll(l, *replicas, n)
			}
		}
	}()

	api := httpapi.New(backend{}, httpapi.Config{
		Gatherer: reg, Exposer: l, Metrics: httpMetrics,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	lis, err := net.Listen("tcp", *listen)
	if err != nil {
		return err
	}
	srv := httpapi.NewHTTPServer(*listen, timed(reg, api.AdminHandler()))
	fmt.Printf("scrape1000: %d replicas, /metrics on http://%s/metrics\n", *replicas, lis.Addr())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return srv.Shutdown(sctx)
}

// timed serves h and measures each /metrics answer on the target's side
// (from the request to the last byte written, gzip included), in families
// the next scrape carries: Prometheus' scrape_duration_seconds also counts
// its own parsing and storing of every sample.
func timed(reg *prometheus.Registry, h http.Handler) http.Handler {
	seconds := prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "scrape1000_metrics_handler_seconds", Help: "Time the /metrics handler took, response written.",
		Buckets: prometheus.ExponentialBuckets(0.005, 2, 12),
	})
	last := prometheus.NewGauge(prometheus.GaugeOpts{Name: "scrape1000_metrics_handler_last_seconds", Help: "Time the last /metrics answer took."})
	slowest := prometheus.NewGauge(prometheus.GaugeOpts{Name: "scrape1000_metrics_handler_max_seconds", Help: "Time the slowest /metrics answer took."})
	sent := prometheus.NewGauge(prometheus.GaugeOpts{Name: "scrape1000_metrics_response_bytes", Help: "Bytes of the last /metrics answer, as sent (compressed)."})
	info := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "scrape1000_metrics_response_info", Help: "Format of the last /metrics answer."},
		[]string{"content_type", "content_encoding"})
	reg.MustRegister(seconds, last, slowest, sent, info)
	var mu sync.Mutex
	var max time.Duration
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			h.ServeHTTP(w, r)
			return
		}
		cw := &countingWriter{ResponseWriter: w}
		start := time.Now()
		h.ServeHTTP(cw, r)
		d := time.Since(start)
		seconds.Observe(d.Seconds())
		last.Set(d.Seconds())
		mu.Lock()
		if d > max {
			max = d
			slowest.Set(d.Seconds())
		}
		mu.Unlock()
		sent.Set(float64(cw.n))
		info.Reset()
		info.WithLabelValues(cw.Header().Get("Content-Type"), cw.Header().Get("Content-Encoding")).Set(1)
	})
}

type countingWriter struct {
	http.ResponseWriter
	n int
}

func (w *countingWriter) Write(p []byte) (int, error) {
	n, err := w.ResponseWriter.Write(p)
	w.n += n
	return n, err
}

// recordAll records one chunk and one finished request into every replica.
func recordAll(l *stats.Logger, replicas, n int) {
	id := make([]byte, 16)
	for i := range replicas {
		_ = l.Record(i, &stagepb.EngineStats{
			PromptTokens: 12, GenerationTokens: 1, PrefixCacheQueries: 12, PrefixCacheHits: 4,
			PromptTokensLocalCompute: 8, PromptTokensLocalCacheHit: 4,
			SpecDecodeNumDrafts: 1, SpecDecodeNumDraftTokens: 2, SpecDecodeNumAcceptedTokens: 1,
			SpecDecodeNumAcceptedTokensPerPos: []uint64{1, 0},
			IterationTokens:                   []uint32{13},
			NumRequestsRunning:                uint32(n % 5), NumRequestsWaitingCapacity: 1, KvCacheUsagePerc: 0.25,
		})
		_, _ = rand.Read(id)
		ms := time.Duration(1+(i+n)%200) * time.Millisecond
		_ = l.RecordFinished(i, stats.Finished{
			Reason: stagepb.FinishReason_FINISH_REASON_STOP, PromptTokens: 100, GenerationTokens: 20,
			TTFT: ms, E2E: 20 * ms, InterTokenLatencies: []time.Duration{ms / 4, ms / 3},
			Queue: ms / 10, Prefill: ms, Decode: 19 * ms, MaxTokensParam: 256, N: 1,
			TraceID: hex.EncodeToString(id),
		})
	}
}

// backend is the rest of the head, which a scrape does not touch.
type backend struct{}

var errNoHead = errors.New("scrape1000: no head, /metrics only")

func (backend) Pipeline() orchestrator.Pipeline { return orchestrator.DefaultPipeline() }
func (backend) Execute(context.Context, orchestrator.Request, func(string) error) (*orchestrator.Result, error) {
	return nil, errNoHead
}
func (backend) CheckParts([]*stagepb.ChatMessage) error { return nil }
func (backend) Replicas() []orchestrator.ReplicaStatus  { return nil }
func (backend) WatchReplicas(int) (*orchestrator.ReplicaWatch, []orchestrator.ReplicaStatus) {
	return nil, nil
}
func (backend) Ready() (bool, string)            { return true, "" }
func (backend) ResolveStage(string) (int, error) { return 0, errNoHead }
func (backend) Sleep(context.Context, int, uint32, int) (stagepb.SleepState, error) {
	return 0, errNoHead
}
func (backend) WakeUp(context.Context, int, uint32) (stagepb.SleepState, error) {
	return 0, errNoHead
}

// ---- report ----------------------------------------------------------------

func report(args []string) error {
	fs := flag.NewFlagSet("report", flag.ContinueOnError)
	base := fs.String("prometheus", "http://127.0.0.1:18501", "Prometheus' base URL")
	job := fs.String("job", "troupe", "the scrape job of the target")
	scrapes := fs.Int("scrapes", 5, "wait for this many scrapes of the target")
	replicas := fs.Int("replicas", 1000, "replicas the target serves")
	timeout := fs.Duration("timeout", 2*time.Minute, "give up waiting after this long")
	if err := fs.Parse(args); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	p := &promAPI{base: *base, client: &http.Client{Timeout: 10 * time.Second}}
	sel := `{job="` + *job + `"}`

	// Wait for Prometheus, then for the scrapes.
	for {
		n, err := p.scalar(ctx, `count_over_time(scrape_duration_seconds`+sel+`[10m])`)
		if err == nil && int(n) >= *scrapes {
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("scrape1000: %d scrapes not seen within %v (last: %v, %v)", *scrapes, *timeout, n, err)
		case <-time.After(time.Second):
		}
	}

	type row struct{ what, value, check string }
	var rows []row
	failed := false
	add := func(what, q string, want func(float64) bool, format func(float64) string) {
		v, err := p.scalar(ctx, q)
		r := row{what: what, value: "n/a", check: ""}
		switch {
		case err != nil && want == nil:
			r.value = "n/a (" + err.Error() + ")"
		case err != nil:
			r.value, r.check, failed = err.Error(), "FAIL", true
		default:
			r.value = format(v)
			if want != nil {
				r.check = "ok"
				if !want(v) {
					r.check, failed = "FAIL", true
				}
			}
		}
		rows = append(rows, row{what + " (`" + q + "`)", r.value, r.check})
	}
	ms := func(v float64) string { return strconv.FormatFloat(v*1000, 'f', 1, 64) + " ms" }
	num := func(v float64) string { return strconv.FormatFloat(v, 'f', -1, 64) }
	mb := func(v float64) string { return strconv.FormatFloat(v/1e6, 'f', 2, 64) + " MB" }
	add("scrapes", `count_over_time(scrape_duration_seconds`+sel+`[10m])`, nil, num)
	add("target up", `min_over_time(up`+sel+`[10m])`, func(v float64) bool { return v == 1 }, num)
	add("scrape duration, last", `scrape_duration_seconds`+sel, nil, ms)
	add("scrape duration, mean", `avg_over_time(scrape_duration_seconds`+sel+`[10m])`, nil, ms)
	add("scrape duration, max", `max_over_time(scrape_duration_seconds`+sel+`[10m])`, nil, ms)
	add("target: /metrics answer, last", `scrape1000_metrics_handler_last_seconds`+sel, nil, ms)
	add("target: /metrics answer, mean", `scrape1000_metrics_handler_seconds_sum`+sel+` / scrape1000_metrics_handler_seconds_count`+sel, nil, ms)
	add("target: /metrics answer, max", `scrape1000_metrics_handler_max_seconds`+sel, nil, ms)
	add("target: bytes sent, last", `scrape1000_metrics_response_bytes`+sel, nil, mb)
	add("samples per scrape", `scrape_samples_scraped`+sel, func(v float64) bool { return v > float64(300**replicas) }, num)
	add("body size (uncompressed)", `scrape_body_size_bytes`+sel, nil, mb)
	add("TTFT buckets", `count(troupe_time_to_first_token_seconds_bucket)`, func(v float64) bool { return v == float64(26**replicas) }, num)
	add("replicas attached", `sum(troupe_replica_attached)`, func(v float64) bool { return v == float64(*replicas) }, num)
	add("stages", `count(troupe_stage_info)`, func(v float64) bool { return v == 3 }, num)
	add("finished requests", `sum(troupe_request_success_total)`, func(v float64) bool { return v >= float64(*replicas) }, num)
	add("p99 TTFT over all replicas", `histogram_quantile(0.99, sum by (le) (rate(troupe_time_to_first_token_seconds_bucket[1m])))`, nil, ms)

	format, err := p.labels(ctx, `scrape1000_metrics_response_info`+sel)
	r := row{"target: format of the last answer", fmt.Sprintf("%s, %s", format["content_type"], format["content_encoding"]), "ok"}
	if err != nil || !strings.HasPrefix(format["content_type"], "application/openmetrics-text") {
		r.check, failed = "FAIL", true
	}
	rows = append(rows, r)
	series, exemplars, err := p.exemplars(ctx, `troupe_time_to_first_token_seconds_bucket`)
	r = row{"TTFT exemplars (`/api/v1/query_exemplars`)", fmt.Sprintf("%d series, %d exemplars", series, exemplars), "ok"}
	if err != nil || exemplars == 0 {
		r.check, failed = "FAIL", true
		if err != nil {
			r.value = err.Error()
		}
	}
	rows = append(rows, r)
	health, lastErr, err := p.target(ctx, *job)
	r = row{"target health (`/api/v1/targets`)", health + " " + lastErr, "ok"}
	if err != nil || health != "up" || lastErr != "" {
		r.check, failed = "FAIL", true
		if err != nil {
			r.value = err.Error()
		}
	}
	rows = append(rows, r)

	fmt.Println("| what | value | check |")
	fmt.Println("|---|---|---|")
	for _, r := range rows {
		fmt.Printf("| %s | %s | %s |\n", r.what, r.value, r.check)
	}
	if failed {
		return errors.New("scrape1000: a check failed")
	}
	return nil
}

// promAPI is the bit of Prometheus' HTTP API the report reads.
type promAPI struct {
	base   string
	client *http.Client
}

func (p *promAPI) get(ctx context.Context, path string, q url.Values, out any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.base+path+"?"+q.Encode(), nil)
	if err != nil {
		return err
	}
	resp, err := p.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s: %s", path, resp.Status, b)
	}
	return json.Unmarshal(b, out)
}

// scalar runs an instant query whose answer is one sample.
func (p *promAPI) scalar(ctx context.Context, query string) (float64, error) {
	var r struct {
		Data struct {
			Result []struct {
				Value [2]any `json:"value"`
			} `json:"result"`
		} `json:"data"`
	}
	if err := p.get(ctx, "/api/v1/query", url.Values{"query": {query}}, &r); err != nil {
		return 0, err
	}
	if len(r.Data.Result) != 1 {
		return 0, fmt.Errorf("%d samples", len(r.Data.Result))
	}
	s, _ := r.Data.Result[0].Value[1].(string)
	return strconv.ParseFloat(s, 64)
}

// labels runs an instant query whose answer is one series and returns
// its labels.
func (p *promAPI) labels(ctx context.Context, query string) (map[string]string, error) {
	var r struct {
		Data struct {
			Result []struct {
				Metric map[string]string `json:"metric"`
			} `json:"result"`
		} `json:"data"`
	}
	if err := p.get(ctx, "/api/v1/query", url.Values{"query": {query}}, &r); err != nil {
		return nil, err
	}
	if len(r.Data.Result) != 1 {
		return nil, fmt.Errorf("%d series", len(r.Data.Result))
	}
	return r.Data.Result[0].Metric, nil
}

func (p *promAPI) exemplars(ctx context.Context, query string) (series, exemplars int, err error) {
	var r struct {
		Data []struct {
			Exemplars []json.RawMessage `json:"exemplars"`
		} `json:"data"`
	}
	now := time.Now()
	q := url.Values{"query": {query}, "start": {strconv.FormatInt(now.Add(-10*time.Minute).Unix(), 10)}, "end": {strconv.FormatInt(now.Unix(), 10)}}
	if err := p.get(ctx, "/api/v1/query_exemplars", q, &r); err != nil {
		return 0, 0, err
	}
	for _, s := range r.Data {
		exemplars += len(s.Exemplars)
	}
	return len(r.Data), exemplars, nil
}

func (p *promAPI) target(ctx context.Context, job string) (health, lastError string, err error) {
	var r struct {
		Data struct {
			ActiveTargets []struct {
				Labels    map[string]string `json:"labels"`
				Health    string            `json:"health"`
				LastError string            `json:"lastError"`
			} `json:"activeTargets"`
		} `json:"data"`
	}
	if err := p.get(ctx, "/api/v1/targets", url.Values{"state": {"active"}}, &r); err != nil {
		return "", "", err
	}
	for _, t := range r.Data.ActiveTargets {
		if t.Labels["job"] == job {
			return t.Health, t.LastError, nil
		}
	}
	return "", "", fmt.Errorf("no target of job %s", job)
}
