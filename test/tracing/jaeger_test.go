// Package tracing checks trace propagation end to end: a head and one
// worker per stage run as processes, export OTLP to a real Jaeger, and one
// audio request must come back from Jaeger as a single trace that holds the
// head's spans and every stage worker's spans, correctly parented.
//
// It needs a Jaeger binary: scripts/e2e-tracing.sh builds one and sets
// TROUPE_JAEGER_BIN; without it the test skips.
package tracing

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/internal/front/jaeger"
	"github.com/troupe-serving/troupe/internal/front/jaeger/jaegertest"
	"github.com/troupe-serving/troupe/pkg/telemetry"
)

// proc is a troupe process that is stopped at cleanup.
type proc struct {
	cmd    *exec.Cmd
	out    *bytes.Buffer
	exited chan error
}

func start(t *testing.T, bin string, env []string, args ...string) *proc {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(cleanEnv(), env...)
	out := &bytes.Buffer{}
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	require.NoError(t, cmd.Start())
	p := &proc{cmd: cmd, out: out, exited: make(chan error, 1)}
	lines := make(chan struct{})
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			out.WriteString(sc.Text() + "\n")
		}
	}()
	go func() {
		err := cmd.Wait()
		pw.Close()
		<-lines
		p.exited <- err
	}()
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
		select {
		case <-p.exited:
		case <-time.After(20 * time.Second):
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-p.exited
		}
		if t.Failed() {
			t.Logf("%s output:\n%s", strings.Join(args[:1], " "), out.String())
		}
	})
	return p
}

// cleanEnv drops OTEL_* and TROUPE_* settings of the caller, so the test
// configures each process alone.
func cleanEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "OTEL_") || strings.HasPrefix(kv, "TROUPE_") {
			continue
		}
		env = append(env, kv)
	}
	return env
}

func get(ctx context.Context, url string) (*http.Response, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp, body, err
}

var traceparent = regexp.MustCompile(`^00-([0-9a-f]{32})-([0-9a-f]{16})-01$`)

func TestAudioRequestTraceInJaeger(t *testing.T) {
	jaegerBin := os.Getenv("TROUPE_JAEGER_BIN")
	if jaegerBin == "" {
		t.Skip("TROUPE_JAEGER_BIN is not set; scripts/e2e-tracing.sh builds Jaeger and sets it")
	}
	config := os.Getenv("TROUPE_JAEGER_CONFIG")
	if config == "" {
		config = filepath.Join("..", "..", "tools", "jaeger", "config.yaml")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()

	bin := filepath.Join(t.TempDir(), "troupe")
	build := exec.CommandContext(ctx, "go", "build", "-o", bin, "../../cmd/troupe")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "build troupe: %s", out)

	j := jaegertest.Start(ctx, t, jaegerBin, config)
	ports := jaegertest.FreePorts(t, 3)
	etcdURL := "http://127.0.0.1:" + ports[0]
	start(t, bin, nil, "etcd", "--data-dir", t.TempDir(), "--listen-client-urls", etcdURL, "--listen-peer-urls", "http://127.0.0.1:"+ports[1])

	headAddr := "127.0.0.1:" + ports[2]
	// The head exports over OTLP gRPC, the workers over OTLP HTTP: both
	// protocols are exercised in one trace.
	start(t, bin, []string{"OTEL_EXPORTER_OTLP_ENDPOINT=http://" + j.OTLPGRPC, "OTEL_EXPORTER_OTLP_PROTOCOL=grpc", "OTEL_BSP_SCHEDULE_DELAY=200"},
		"head", "--etcd-endpoints", etcdURL, "--http", headAddr)
	for _, stage := range []string{"thinker", "talker", "vocoder"} {
		start(t, bin, []string{"OTEL_EXPORTER_OTLP_ENDPOINT=http://" + j.OTLPHTTP, "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf", "OTEL_BSP_SCHEDULE_DELAY=200"},
			"worker", "--etcd-endpoints", etcdURL, "--stage", stage, "--listen", "127.0.0.1:0")
	}
	base := "http://" + headAddr
	jaegertest.WaitFor(ctx, t, 60*time.Second, func() error {
		resp, body, err := get(ctx, base+"/readyz")
		if err != nil {
			return err
		}
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("readyz: %s %s", resp.Status, body)
		}
		return nil
	})

	reqBody := `{"model":"troupe-omni-sim","modalities":["text","audio"],"max_tokens":6,"seed":3,"messages":[{"role":"user","content":"trace this request"}]}`
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions", strings.NewReader(reqBody))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", body)
	var chat struct {
		Choices []struct {
			Message struct {
				Audio struct {
					Data string `json:"data"`
				} `json:"audio"`
			} `json:"message"`
		} `json:"choices"`
	}
	require.NoError(t, json.Unmarshal(body, &chat))
	require.NotEmpty(t, chat.Choices[0].Message.Audio.Data)
	m := traceparent.FindStringSubmatch(resp.Header.Get("traceparent"))
	require.NotNil(t, m, "sampled traceparent, got %q", resp.Header.Get("traceparent"))
	traceID := m[1]

	// Spans arrive asynchronously from four processes: poll, bounded.
	const want = 3 /*stage*/ * 5 /*client, server, queue, prefill, decode*/ // plus head spans
	var tr *jaeger.Trace
	jaegertest.WaitFor(ctx, t, 60*time.Second, func() error {
		got, err := jaeger.FetchTrace(ctx, nil, j.Query, traceID)
		if err != nil {
			return err
		}
		workers := 0
		for _, s := range got.Spans {
			if s.Service == "troupe-worker" {
				workers++
			}
		}
		if workers < 3*4 {
			return fmt.Errorf("%d worker spans of %d stored", workers, 3*4)
		}
		tr = got
		return nil
	})
	require.GreaterOrEqual(t, len(tr.Spans), want)

	byID := map[string]jaeger.Span{}
	children := map[string][]jaeger.Span{}
	for _, s := range tr.Spans {
		byID[s.SpanID] = s
		children[s.ParentSpanID] = append(children[s.ParentSpanID], s)
	}
	find := func(name string) []jaeger.Span {
		var out []jaeger.Span
		for _, s := range tr.Spans {
			if s.Name == name {
				out = append(out, s)
			}
		}
		return out
	}
	reqSpans := find(telemetry.SpanRequest)
	require.Len(t, reqSpans, 1)
	request := reqSpans[0]
	assert.Equal(t, "troupe-head", request.Service)
	server, ok := byID[request.ParentSpanID]
	require.True(t, ok, "troupe.request has the HTTP server span as parent")
	assert.Equal(t, "server", server.Kind)
	assert.Equal(t, "troupe-head", server.Service)

	for i, stage := range []string{"thinker", "talker", "vocoder"} {
		spans := find(telemetry.StageSpanName(stage))
		require.Len(t, spans, 1, stage)
		st := spans[0]
		assert.Equal(t, request.SpanID, st.ParentSpanID, stage)
		assert.Equal(t, fmt.Sprint(i), st.Attributes[string(telemetry.KeyStageID)], stage)
		assert.Equal(t, "1", st.Attributes[string(telemetry.KeyAttempt)], stage)
		client := children[st.SpanID]
		require.Len(t, client, 1, "%s: one gRPC client span", stage)
		assert.Equal(t, "client", client[0].Kind)
		srv := children[client[0].SpanID]
		require.Len(t, srv, 1, "%s: the worker's server span", stage)
		assert.Equal(t, "troupe-worker", srv[0].Service, stage)
		var phases []string
		for _, p := range children[srv[0].SpanID] {
			assert.Equal(t, "troupe-worker", p.Service)
			phases = append(phases, p.Name)
		}
		assert.ElementsMatch(t, []string{telemetry.SpanQueue, telemetry.SpanPrefill, telemetry.SpanDecode}, phases, stage)
	}

	// The same trace as an operator sees it, through `troupe trace`.
	cmd := exec.CommandContext(ctx, bin, "trace", traceID, "--jaeger", j.Query)
	cmd.Env = cleanEnv()
	out, err = cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	for _, s := range []string{"troupe-head", "troupe-worker", "troupe.stage vocoder", "decode"} {
		assert.Contains(t, string(out), s)
	}
	t.Logf("troupe trace %s:\n%s", traceID, out)
}
