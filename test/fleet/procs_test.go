package fleet

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// proc is one process of the simulation: its stdout kept line by line, its
// stdin open for the replica children's commands. Cleanup kills it and
// waits for it.
type proc struct {
	name   string
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	out    *lineLog
	stderr *lineLog
	exited chan struct{}
}

func startProc(b *testing.B, name string, env []string, path string, args ...string) *proc {
	b.Helper()
	cmd := exec.Command(path, args...)
	cmd.Env = append(cleanEnv(), env...)
	p := &proc{name: name, cmd: cmd, out: newLineLog(), stderr: newLineLog(), exited: make(chan struct{})}
	var err error
	if p.stdin, err = cmd.StdinPipe(); err != nil {
		b.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = p.out, p.stderr
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Start(); err != nil {
		b.Fatalf("fleet: start %s: %v", name, err)
	}
	go func() { _ = cmd.Wait(); close(p.exited) }()
	b.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-p.exited
		if b.Failed() {
			b.Logf("--- %s stderr:\n%s", name, p.stderr.tail(20))
		}
	})
	return p
}

// cleanEnv is the caller's environment without TROUPE_* variables, which
// would change troupe's flag defaults.
func cleanEnv() []string {
	var out []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "TROUPE_") {
			out = append(out, kv)
		}
	}
	return out
}

// waitLine waits for a line of the process's stdout with prefix, until ctx
// ends or the process exits.
func (p *proc) waitLine(ctx context.Context, prefix string) (string, error) {
	line, _, err := p.out.waitOr(ctx, p.exited, 0, prefix)
	return line, err
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

// send writes one command line to the child's stdin.
func (p *proc) send(b *testing.B, line string) {
	b.Helper()
	if _, err := io.WriteString(p.stdin, line+"\n"); err != nil {
		b.Fatalf("fleet: %s: %v", p.name, err)
	}
}

// lineLog keeps every line written to it and wakes waiters on each.
type lineLog struct {
	mu      sync.Mutex
	partial []byte
	lines   []string
	changed chan struct{}
}

func newLineLog() *lineLog { return &lineLog{changed: make(chan struct{})} }

func (l *lineLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.partial = append(l.partial, p...)
	for {
		i := strings.IndexByte(string(l.partial), '\n')
		if i < 0 {
			break
		}
		l.lines = append(l.lines, string(l.partial[:i]))
		l.partial = l.partial[i+1:]
	}
	close(l.changed)
	l.changed = make(chan struct{})
	return len(p), nil
}

// wait returns the first line from index from on that has prefix, and the
// index after it, waiting until ctx ends.
func (l *lineLog) wait(ctx context.Context, from int, prefix string) (string, int, error) {
	return l.waitOr(ctx, nil, from, prefix)
}

// waitOr is wait that also gives up once exited is closed.
func (l *lineLog) waitOr(ctx context.Context, exited <-chan struct{}, from int, prefix string) (string, int, error) {
	gone := false
	for {
		l.mu.Lock()
		for i := from; i < len(l.lines); i++ {
			if strings.HasPrefix(l.lines[i], prefix) {
				line := l.lines[i]
				l.mu.Unlock()
				return line, i + 1, nil
			}
		}
		from = len(l.lines)
		changed := l.changed
		l.mu.Unlock()
		if gone {
			return "", from, fmt.Errorf("fleet: no line %q: the process exited", prefix)
		}
		select {
		case <-changed:
		case <-exited:
			gone = true // one more look at what it wrote last
		case <-ctx.Done():
			return "", from, fmt.Errorf("fleet: no line %q: %w", prefix, ctx.Err())
		}
	}
}

func (l *lineLog) snapshot() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.lines...)
}

func (l *lineLog) tail(n int) string {
	s := l.snapshot()
	return strings.Join(s[max(0, len(s)-n):], "\n")
}

// buildTroupe builds the troupe binary into a temporary directory.
func buildTroupe(b *testing.B) string {
	b.Helper()
	bin := filepath.Join(b.TempDir(), "troupe")
	out, err := exec.Command("go", "build", "-o", bin, "github.com/troupe-serving/troupe/cmd/troupe").CombinedOutput()
	if err != nil {
		b.Fatalf("fleet: go build: %v\n%s", err, out)
	}
	return bin
}

// freePort returns a loopback port that was free a moment ago, whose next
// port was free too (etcd's default peer port).
func freePort(b *testing.B) int {
	b.Helper()
	for range 20 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		l2, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port+1))
		_ = l.Close()
		if err == nil {
			_ = l2.Close()
			return port
		}
	}
	b.Fatal("fleet: no free port pair")
	return 0
}

// procStat is a process's CPU time so far and its resident memory.
type procStat struct {
	cpu time.Duration
	rss int64 // bytes
}

// readProc reads /proc/PID/stat (utime + stime, at the kernel's 100 ticks a
// second) and /proc/PID/status (VmRSS).
func readProc(pid int) (procStat, error) {
	var s procStat
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return s, err
	}
	f := strings.Fields(string(raw[strings.LastIndexByte(string(raw), ')')+2:]))
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	s.cpu = time.Duration(ut+st) * 10 * time.Millisecond
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return s, err
	}
	for line := range strings.SplitSeq(string(status), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			s.rss = kb * 1024
		}
	}
	return s, nil
}

// scrape reads a Prometheus text exposition: each sample's name and labels,
// as written, to its value.
func scrape(ctx context.Context, url string) (map[string]float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Accept", "text/plain")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("fleet: scrape: %w", err)
	}
	defer func() { _ = resp.Body.Close() }()
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if i > 0 && err == nil {
			out[line[:i]] = v
		}
	}
	return out, sc.Err()
}

// sum adds the samples of name whose labels contain every one of labels.
func sum(m map[string]float64, name string, labels ...string) float64 {
	var t float64
	for k, v := range m {
		if !strings.HasPrefix(k, name) || (len(k) > len(name) && k[len(name)] != '{') {
			continue
		}
		all := true
		for _, l := range labels {
			all = all && strings.Contains(k, l)
		}
		if all {
			t += v
		}
	}
	return t
}

// attachedReplicas reads GET /v1/replicas of the head at base: the ids in
// state attached (routed, healthy, awake: what the head picks from).
func attachedReplicas(ctx context.Context, base string) (map[uint32]bool, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/v1/replicas", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("fleet: replicas: %w", err)
	}
	defer func() { _ = resp.Body.Close() }()
	var body struct {
		Data []struct {
			Replica uint32 `json:"replica"`
			State   string `json:"state"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return nil, fmt.Errorf("fleet: replicas: %w", err)
	}
	out := make(map[uint32]bool, len(body.Data))
	for _, r := range body.Data {
		if r.State == "attached" {
			out[r.Replica] = true
		}
	}
	return out, nil
}

// pollInterval is the time between two polls of a head's /v1/replicas of
// n replicas: 20 ms plus 25 µs a replica (270 ms at 10,000), so that the
// polls (about 250 bytes of JSON a replica, encoded by the head) take a
// small share of the CPU the storms are timed on.
func pollInterval(n int) time.Duration {
	return 20*time.Millisecond + time.Duration(n)*25*time.Microsecond
}

// watchHead polls the head at base until cond holds for its attached
// replicas, recording in first (when not nil) the time each replica was
// first seen attached (the poll's answer: late by at most one poll), n
// the fleet's size. It returns the time from start until cond held.
func watchHead(ctx context.Context, base string, n int, start time.Time, first map[uint32]time.Time, cond func(map[uint32]bool) bool) (time.Duration, error) {
	tick := time.NewTicker(pollInterval(n))
	defer tick.Stop()
	for {
		att, err := attachedReplicas(ctx, base)
		if err != nil {
			return 0, err
		}
		now := time.Now()
		if first != nil {
			for id := range att {
				if _, ok := first[id]; !ok {
					first[id] = now
				}
			}
		}
		if cond(att) {
			return now.Sub(start), nil
		}
		select {
		case <-tick.C:
		case <-ctx.Done():
			return 0, fmt.Errorf("fleet: %s: condition not reached (%d attached): %w", base, len(att), ctx.Err())
		}
	}
}

// waitReady polls the head's /readyz until it answers 200.
func waitReady(ctx context.Context, base string, start time.Time) (time.Duration, error) {
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/readyz", nil)
		if err != nil {
			return 0, err
		}
		if resp, err := http.DefaultClient.Do(req); err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return time.Since(start), nil
			}
		}
		select {
		case <-tick.C:
		case <-ctx.Done():
			return 0, fmt.Errorf("fleet: %s not ready: %w", base, ctx.Err())
		}
	}
}

// loadAvg is the 1-minute load average (/proc/loadavg): the benchmark
// reports it at each size's start and end, as every figure here needs it.
func loadAvg() float64 {
	raw, _ := os.ReadFile("/proc/loadavg")
	f := strings.Fields(string(raw))
	if len(f) == 0 {
		return -1
	}
	v, _ := strconv.ParseFloat(f[0], 64)
	return v
}
