package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/troupe-serving/troupe/membership"
	"github.com/troupe-serving/troupe/membership/embedetcd"
	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/worker/espeak"
)

// runUp is the laptop all-in-one: an embedded etcd, a head and sim workers
// for every stage, in one process. Ctrl-C drains the workers, stops the head
// and etcd, and removes a temporary data dir.
func runUp(ctx context.Context, args []string, stdout io.Writer) error {
	fs := newFlagSet("up")
	hf := addHeadFlags(fs)
	dataDir := fs.String("data-dir", "", "etcd data dir to keep (default: a temporary dir, removed at exit)")
	etcdURL := fs.String("etcd-listen", "http://127.0.0.1:0", "client URL of the embedded etcd (port 0: a free port)")
	replicas := fs.Int("replicas", 1, "sim workers per stage")
	decodeLatency := fs.Duration("decode-latency", 0, "sim: duration of one decode step (0: instant)")
	speech := fs.String("speech", "", "espeak: run thinker → speech, the speech stage on espeak-ng (real audio); default: the sim's thinker → talker → vocoder")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	hf.noteArgvSecrets(fs)
	if *replicas < 1 || *replicas > 64 {
		return fmt.Errorf("--replicas must be in 1..64, got %d", *replicas)
	}
	if err := hf.validateLimits(); err != nil {
		return err
	}
	log, flushLog := hf.log.logger()
	defer flushLog()
	pipeline, err := upPipeline(hf, *speech)
	if err != nil {
		return err
	}
	hf.builtPipeline = &pipeline

	dir := *dataDir
	if dir == "" {
		tmp, err := os.MkdirTemp("", "troupe-up-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(tmp)
		dir = tmp
	}
	lg, err := embedetcd.LoggerAt("error")
	if err != nil {
		return err
	}
	etcd, err := embedetcd.Start(ctx, embedetcd.Config{
		Name:             "troupe-up",
		DataDir:          dir,
		ListenClientURLs: []string{*etcdURL},
		ListenPeerURLs:   []string{"http://127.0.0.1:0"},
		Logger:           lg,
	})
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	defer etcd.Close()
	cli, err := membership.Dial(ctx, membership.ClientConfig{Endpoints: etcd.ClientURLs()})
	if err != nil {
		return err
	}
	defer cli.Close()

	g, gctx := errgroup.WithContext(ctx)
	headReady := make(chan headAddrs, 1)
	g.Go(func() error { return serveHead(gctx, cli, hf, log, io.Discard, headReady) })
	for _, st := range pipeline.Stages {
		for range *replicas {
			// A worker's defaults are its flags' defaults; up sets the rest
			// from its own configuration.
			wf := addWorkerFlags(newFlagSet("worker"))
			wf.stage, wf.cluster, wf.model = st.Name, hf.cluster, pipeline.Model
			wf.decodeLatency = *decodeLatency
			wf.maxMessage = byteSize(grpcMessageLimit(hf.maxBody)) // the head's prompts fit
			wf.tls, wf.otel, wf.log = hf.tls, hf.otel, hf.log
			if *speech != "" && st.Name == speechStage {
				wf.engine = espeak.EngineName
			}
			g.Go(func() error { return serveWorker(gctx, cli, wf, log, io.Discard, nil) })
		}
	}

	var started atomic.Bool // the banner is out: a stop is worth reporting
	g.Go(func() error {
		var addrs headAddrs
		select {
		case addrs = <-headReady:
		case <-gctx.Done():
			return nil
		}
		api := baseURL(addrs.api)
		if err := waitReady(gctx, api+"/readyz", 60*time.Second); err != nil {
			if gctx.Err() != nil {
				return nil
			}
			return err
		}
		admin := api
		if addrs.admin != nil {
			admin = baseURL(addrs.admin)
		}
		printBanner(stdout, banner{
			pipeline: pipeline, api: api, admin: admin, etcdURLs: etcd.ClientURLs(), cluster: hf.cluster,
			dataDir: dir, temporary: *dataDir == "", auth: hf.apiKey != "", self: selfCommand(), speech: *speech != "",
		})
		started.Store(true)
		return nil
	})
	err = g.Wait()
	if started.Load() {
		fmt.Fprintln(stdout, "troupe up: stopped")
	}
	if ctx.Err() != nil && (err == nil || errors.Is(err, context.Canceled)) {
		return nil
	}
	return err
}

// speechStage is the name of the speech stage of `troupe up --speech`.
const speechStage = "speech"

// upPipeline is the pipeline `troupe up` runs: --pipeline, the default,
// or with --speech espeak a thinker (sim) and a speech stage (espeak-ng).
func upPipeline(hf *headFlags, speech string) (orchestrator.Pipeline, error) {
	switch speech {
	case "":
		return hf.loadPipeline()
	case espeak.EngineName:
		if hf.pipeline != "" {
			return orchestrator.Pipeline{}, errors.New("up: --speech and --pipeline cannot be combined: --speech runs thinker → speech")
		}
		if _, err := exec.LookPath(espeak.DefaultBinary); err != nil {
			return orchestrator.Pipeline{}, fmt.Errorf("up: --speech espeak needs espeak-ng (Debian: apt-get install espeak-ng): %w", err)
		}
		p := orchestrator.DefaultPipeline()
		p.Stages = []orchestrator.Stage{{Name: "thinker"}, {Name: speechStage}}
		return p, nil
	}
	return orchestrator.Pipeline{}, fmt.Errorf("up: unknown --speech %q (supported: espeak)", speech)
}

// baseURL is the http:// URL of a bound address as a client on this host
// dials it: an unspecified host (0.0.0.0, ::) becomes loopback.
func baseURL(a net.Addr) string {
	host, port, err := net.SplitHostPort(a.String())
	if err != nil {
		return "http://" + a.String()
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
		host = "127.0.0.1"
		if ip.To4() == nil {
			host = "::1"
		}
	}
	return "http://" + net.JoinHostPort(host, port)
}

// waitReady polls a readiness URL until it answers 200.
func waitReady(ctx context.Context, url string, limit time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	var last string
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		if resp, err := http.DefaultClient.Do(req); err == nil {
			body, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = strings.TrimSpace(string(body))
		} else {
			last = err.Error()
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("not ready after %s: %s", limit, last)
		case <-tick.C:
		}
	}
}

// banner is what `troupe up` says once it is ready.
type banner struct {
	pipeline   orchestrator.Pipeline
	api, admin string // base URLs; admin == api without --admin-http
	etcdURLs   []string
	cluster    string
	dataDir    string
	temporary  bool   // the data dir is removed at exit
	auth       bool   // --api-key is set
	self       string // how to run this binary again (selfCommand)
	speech     bool   // --speech: a thinker → speech pipeline
}

// selfCommand is how a user runs this binary again from the shell that
// started it: "troupe" when that is on PATH, "go run ./cmd/troupe" under
// go run (whose binary is a temporary file), else the path it was started
// by.
func selfCommand() string {
	exe, err := os.Executable()
	if err != nil {
		return "troupe"
	}
	if p, err := exec.LookPath("troupe"); err == nil {
		a, aerr := os.Stat(p)
		b, berr := os.Stat(exe)
		if aerr == nil && berr == nil && os.SameFile(a, b) {
			return "troupe"
		}
	}
	if strings.Contains(exe, string(filepath.Separator)+"go-build") {
		return "go run ./cmd/troupe"
	}
	return os.Args[0]
}

// printBanner writes the banner: every URL in it answers, with the key
// where --api-key asks for one, and every command in it can be pasted.
func printBanner(w io.Writer, b banner) {
	keep := "kept"
	if b.temporary {
		keep = "removed at exit"
	}
	header, needsKey := "", ""
	if b.auth {
		header = " \\\n    -H \"Authorization: Bearer $TROUPE_API_KEY\""
		needsKey = " (with the API key)"
	}
	admin := ""
	if b.admin != b.api {
		admin = " (admin listener)"
	}
	members := b.self + " members --etcd-endpoints " + strings.Join(b.etcdURLs, ",")
	if b.cluster != membership.DefaultCluster {
		members += " --cluster " + b.cluster
	}
	fmt.Fprintf(w, `troupe is up: model %s, stages %s
  API:      %s/v1 (the base URL for OpenAI clients)
  replicas: %s/v1/replicas%s%s (?watch=true follows them)
  metrics:  %s/metrics%s
  etcd:     %s (data dir %s, %s)

List the members:
  %s

Try:
  curl -s %s/v1/chat/completions%s \
    -H 'Content-Type: application/json' \
    -d '{"model":%s,"messages":[{"role":"user","content":"hello"}],"max_tokens":8}'
`, b.pipeline.Model, strings.Join(b.pipeline.StageNames(), " → "), b.api, b.admin, admin, needsKey, b.admin, admin,
		strings.Join(b.etcdURLs, ","), b.dataDir, keep, members, b.api, header, strconv.Quote(b.pipeline.Model))
	if b.speech {
		fmt.Fprintf(w, `
Speech (espeak-ng), saved as hello.wav:
  curl -s %s/v1/chat/completions%s \
    -H 'Content-Type: application/json' \
    -d '{"model":%s,"modalities":["text","audio"],"audio":{"voice":"en","format":"wav"},"messages":[{"role":"user","content":"hello"}],"max_tokens":16}' \
    | jq -r .choices[0].message.audio.data | base64 -d > hello.wav
`, b.api, header, strconv.Quote(b.pipeline.Model))
	}
	fmt.Fprint(w, "\nPress Ctrl-C to stop.\n")
}
