// Package jaegertest runs a real Jaeger v2 process (bin/jaeger, built by
// scripts/build-jaeger.sh) on free loopback ports for tests.
package jaegertest

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Process is a running Jaeger.
type Process struct {
	OTLPGRPC, OTLPHTTP string // host:port
	Query              string // http://host:port
}

// Start runs Jaeger with config until the test ends and waits until its
// query API answers. Its output is logged when the test fails.
func Start(ctx context.Context, t testing.TB, bin, config string) Process {
	t.Helper()
	ports := FreePorts(t, 5)
	j := Process{
		OTLPGRPC: "127.0.0.1:" + ports[0],
		OTLPHTTP: "127.0.0.1:" + ports[1],
		Query:    "http://127.0.0.1:" + ports[2],
	}
	cmd := exec.Command(bin, "--config", config)
	cmd.Env = append(os.Environ(),
		"JAEGER_LISTEN_HOST=127.0.0.1",
		"JAEGER_OTLP_GRPC_PORT="+ports[0],
		"JAEGER_OTLP_HTTP_PORT="+ports[1],
		"JAEGER_QUERY_HTTP_PORT="+ports[2],
		"JAEGER_QUERY_GRPC_PORT="+ports[3],
		"JAEGER_HEALTH_PORT="+ports[4],
		"JAEGER_LOG_LEVEL=warn",
	)
	var out syncBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Start(); err != nil {
		t.Fatalf("jaegertest: start %s: %v", bin, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(15 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			t.Logf("jaeger output:\n%s", out.String())
		}
	})

	WaitFor(ctx, t, 60*time.Second, func() error {
		select {
		case err := <-exited:
			exited <- err
			return fmt.Errorf("jaeger exited: %v\n%s", err, out.String())
		default:
		}
		resp, err := http.Get(j.Query + "/api/v3/services")
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("query API answered %s", resp.Status)
		}
		return nil
	})
	return j
}

// FreePorts reserves n loopback ports by binding them, then frees them for
// a child process (a small race, acceptable in tests).
func FreePorts(t testing.TB, n int) []string {
	t.Helper()
	var ports []string
	var lis []net.Listener
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("jaegertest: %v", err)
		}
		lis = append(lis, l)
		ports = append(ports, strconv.Itoa(l.Addr().(*net.TCPAddr).Port))
	}
	for _, l := range lis {
		_ = l.Close()
	}
	return ports
}

// WaitFor polls cond every 100ms until it returns nil, failing the test
// with cond's last error once within has passed or ctx ends.
func WaitFor(ctx context.Context, t testing.TB, within time.Duration, cond func() error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		err := cond()
		if err == nil {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("gave up after %v: %v", within, err)
		case <-tick.C:
		}
	}
}

type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
