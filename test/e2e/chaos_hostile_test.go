//go:build unix

package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// The hostile scenarios of the chaos suite (issue 34): clients and
// neighbours that attack a running cluster, each with its own checks on
// top of the load's (c.violate). They are strict: a goal not met fails
// TestChaos.
var hostileScenarios = []chaosScenario{
	{
		name: "vocoder kill -9 under streamed audio", goal: "0 failed, every stream every sample once",
		inject: vocoderKillUnderStreams, strict: true,
		detected:  func(rows []replicaRow) bool { r, ok := rowOf(rows, "vocoder", 0); return ok && r.State != "attached" },
		recovered: replicaIs("vocoder", 0, "detached"),
	},
	{
		name: "slow uploads (1,000 connections)", goal: "0 failed, no 429, every upload 408",
		inject: slowUploads, recovered: settled, strict: true,
		// A small admission limit: when uploads took slots, 1,000 of them
		// would have left none for the load.
		headArgs: []string{"--max-in-flight", "64"},
	},
	{
		name: "200 never-read audio streams", goal: "0 failed, no ejection, head RSS bounded",
		inject: unreadStreams, recovered: settled, strict: true,
	},
	{
		name: "records that lie", goal: "0 failed, every lie refused",
		inject: recordsThatLie, recovered: settled, strict: true,
	},
}

func replicaIs(stage string, id uint32, state string) func([]replicaRow) bool {
	return func(rows []replicaRow) bool { r, ok := rowOf(rows, stage, id); return ok && r.State == state }
}

// audioBody is a streamed pcm16 audio chat request.
func audioBody(seed, maxTokens int, prompt string) []byte {
	b, _ := json.Marshal(map[string]any{"model": modelName, "max_tokens": maxTokens, "ignore_eos": true, "stream": true, "seed": seed,
		"messages": []chatMessage{{Role: "user", Content: prompt}}, "modalities": []string{"text", "audio"},
		"audio": map[string]string{"voice": "alloy", "format": "pcm16"}})
	return b
}

// audioAnswer is what a client read from a streamed audio answer.
type audioAnswer struct {
	pcm        []byte
	transcript string
	done       bool // [DONE] seen
	err        error
}

// readAudio posts a streamed audio request and reads it to its end;
// onAudio is called after each audio delta.
func readAudio(ctx context.Context, client *http.Client, base string, body []byte, onAudio func()) audioAnswer {
	var a audioAnswer
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		a.err = err
		return a
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		a.err = errorf("audio stream: %w", err)
		return a
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		a.err = errorf("audio stream: %s: %s", resp.Status, bytes.TrimSpace(b))
		return a
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			a.done = true
			return a
		}
		var c struct {
			Choices []struct {
				Delta struct {
					Audio *struct {
						Data       string `json:"data"`
						Transcript string `json:"transcript"`
					} `json:"audio"`
				} `json:"delta"`
			} `json:"choices"`
			Error *json.RawMessage `json:"error"`
		}
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			a.err = errorf("audio stream: %w", err)
			return a
		}
		if c.Error != nil {
			a.err = errorf("audio stream: error event: %s", *c.Error)
			return a
		}
		for _, ch := range c.Choices {
			if au := ch.Delta.Audio; au != nil {
				a.transcript += au.Transcript
				if au.Data != "" {
					pcm, err := base64.StdEncoding.DecodeString(au.Data)
					if err != nil {
						a.err = errorf("audio stream: %w", err)
						return a
					}
					a.pcm = append(a.pcm, pcm...)
					onAudio()
				}
			}
		}
	}
	a.err = errorf("audio stream: ended without [DONE] (%d bytes of audio): %v", len(a.pcm), sc.Err())
	return a
}

// waitClosed waits, bounded, for ch to be closed.
func waitClosed(ctx context.Context, ch <-chan struct{}, bound time.Duration) bool {
	select {
	case <-ch:
		return true
	case <-time.After(bound):
	case <-ctx.Done():
	}
	return false
}

// vocoderKillUnderStreams (issue 34, item 2): the last stage dies while
// streamed audio reaches clients. Every stream must complete, its audio
// identical to a re-render of the same seeded request.
func vocoderKillUnderStreams(ctx context.Context, c *chaosCluster) string {
	const n, tokens = 8, 400
	answers := make([]audioAnswer, n)
	bodies := make([][]byte, n)
	var wg sync.WaitGroup
	var heard sync.WaitGroup
	heard.Add(n)
	var finished atomic.Int32
	for i := range n {
		bodies[i] = audioBody(9000+i, tokens, fmt.Sprintf("stream %d speaks at length", i))
		wg.Add(1)
		go func() {
			defer wg.Done()
			var once sync.Once
			answers[i] = readAudio(ctx, c.head.client, c.head.base, bodies[i], func() { once.Do(heard.Done) })
			finished.Add(1)
			once.Do(heard.Done)
		}()
	}
	allEnded := make(chan struct{})
	go func() { wg.Wait(); close(allEnded) }()
	allHeard := make(chan struct{})
	go func() { heard.Wait(); close(allHeard) }()
	defer func() { <-allEnded }()
	if !waitClosed(ctx, allHeard, wait) {
		c.violate("not every stream had audio within %s", wait)
		return ""
	}
	// The victim must be serving some of them.
	var inFlight int64
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		if rows, err := c.head.replicas(ctx); err == nil {
			if r, ok := rowOf(rows, "vocoder", 0); ok && r.InFlight > 0 {
				inFlight = r.InFlight
				break
			}
		}
		sleepCtx(ctx, 10*time.Millisecond)
	}
	live := n - int(finished.Load())
	c.workers["vocoder"][0].kill(c.t)
	if inFlight == 0 || live == 0 {
		c.violate("the kill hit no stream (vocoder 0 in flight %d, %d streams live)", inFlight, live)
	}
	if !waitClosed(ctx, allEnded, time.Minute) {
		c.violate("streams still open a minute after the kill")
		return ""
	}
	// The re-renders, all at once, on the surviving vocoder.
	renders := make([]audioAnswer, n)
	var rwg sync.WaitGroup
	for i := range n {
		rwg.Add(1)
		go func() {
			defer rwg.Done()
			renders[i] = readAudio(ctx, c.head.client, c.head.base, bodies[i], func() {})
		}()
	}
	rwg.Wait()
	same, total := 0, 0
	for i, a := range answers {
		if a.err != nil || !a.done {
			c.violate("stream %d: %v", i, a.err)
			continue
		}
		re := renders[i]
		switch {
		case re.err != nil:
			c.violate("re-render %d: %v", i, re.err)
		case !bytes.Equal(a.pcm, re.pcm):
			c.violate("stream %d: %d bytes of audio, its re-render %d (first difference at byte %d)", i, len(a.pcm), len(re.pcm), firstDiff(a.pcm, re.pcm))
		case a.transcript != re.transcript:
			c.violate("stream %d: transcript differs from its re-render", i)
		default:
			same++
			total += len(a.pcm)
		}
	}
	return fmt.Sprintf("%d streams (pcm16, max_tokens %d); kill -9 of vocoder 0 with %d in flight on it, %d streams live; %d of %d complete with [DONE] and PCM byte-identical to a re-render on the surviving vocoder (%d KiB in all)",
		n, tokens, inFlight, live, same, n, total>>10)
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// headAddr is the head's host:port.
func (c *chaosCluster) headAddr() string { return strings.TrimPrefix(c.head.base, "http://") }

// slowUploads (issue 34, item 3): many connections send full headers with
// Content-Length 100000 and then one body byte every 3 s. They must get
// 408 body_too_slow at the head's default pacing (10 s idle, 8 KiB/s
// after 10 s) and never take an admission slot from the load.
func slowUploads(ctx context.Context, c *chaosCluster) string {
	const n = 1000
	const every = 3 * time.Second
	start := time.Now()
	results := make(chan uploadResult, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results <- slowUpload(ctx, c.headAddr(), every)
		}()
		if i%100 == 99 {
			sleepCtx(ctx, 50*time.Millisecond) // spread the dials a little
		}
	}
	wg.Wait()
	close(results)
	var cut, other int
	var first, last time.Duration
	reasons := map[string]int{}
	for r := range results {
		if r.err == nil && r.status == http.StatusRequestTimeout && r.code == "body_too_slow" {
			cut++
			if first == 0 || r.after < first {
				first = r.after
			}
			last = max(last, r.after)
			continue
		}
		other++
		k := fmt.Sprintf("%d %s %v", r.status, r.code, r.err)
		reasons[k]++
	}
	if other > 0 {
		c.violate("%d uploads not answered 408 body_too_slow: %v", other, reasons)
	}
	return fmt.Sprintf("%d connections at once, each Content-Length 100000 and 1 byte every %s (head --max-in-flight 64, default pacing); %d answered 408 body_too_slow, %s to %s after their start; attack over in %s",
		n, every, cut, first.Round(100*time.Millisecond), last.Round(100*time.Millisecond), time.Since(start).Round(100*time.Millisecond))
}

// uploadResult is the head's answer to a slow upload.
type uploadResult struct {
	status int
	code   string // the error's code
	after  time.Duration
	err    error
}

// slowUpload is one slow upload; it returns the head's answer.
func slowUpload(ctx context.Context, addr string, every time.Duration) (r uploadResult) {
	start := time.Now()
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		r.err = err
		return r
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(45 * time.Second))
	if _, err := io.WriteString(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: troupe\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"); err != nil {
		r.err = err
		return r
	}
	answered := make(chan struct{})
	go func() {
		defer close(answered)
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			r.err = err
			return
		}
		defer resp.Body.Close()
		var e struct {
			Error struct {
				Code string `json:"code"`
			} `json:"error"`
		}
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		_ = json.Unmarshal(b, &e)
		r.status, r.code, r.after = resp.StatusCode, e.Error.Code, time.Since(start)
	}()
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-answered:
			return r
		case <-ctx.Done():
			conn.Close()
			<-answered
			return r
		case <-tick.C:
			// A write error means the head closed the connection; the
			// reader has or will have its answer.
			_, _ = conn.Write([]byte(" "))
		}
	}
}

// vmRSS reads a process's resident set size from /proc (Linux).
func vmRSS(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb << 10, err
		}
	}
	return 0, errors.New("e2e: no VmRSS")
}

// unreadRSSBound is the head's RSS bound with 200 never-read audio
// streams: what its flow-control windows and soft memory limit should hold
// them to (docs/reliability.md, "What a hostile client costs").
const unreadRSSBound = 256 << 20

// unreadRSSGoal is issue 34's goal for 1,024 never-read streams, the
// bound of a run with more than 200 (TROUPE_CHAOS_UNREAD).
const unreadRSSGoal = 512 << 20

// unreadStreams (issue 34, items 1 and 4): 200 streamed audio requests
// whose clients never read, held 20 s (under the 30 s write deadline that
// would cut them off). The head's RSS stays bounded, no replica is ejected
// or unhealthy, the load is served.
func unreadStreams(ctx context.Context, c *chaosCluster) string {
	n := 200
	// TROUPE_CHAOS_UNREAD sizes it for a one-off measurement (the bound
	// is for 200; docs/reliability.md has the 1,000-stream run).
	if v, err := strconv.Atoi(os.Getenv("TROUPE_CHAOS_UNREAD")); err == nil && v > 0 {
		n = v
	}
	const hold = 20 * time.Second
	pid := c.head.cmd.Process.Pid
	before, err := vmRSS(pid)
	if err != nil {
		c.violate("reading the head's RSS: %v", err)
		return ""
	}
	ejections := func() float64 {
		m, err := c.head.scrape(ctx)
		if err != nil {
			c.violate("scrape: %v", err)
			return 0
		}
		return m.sum("troupe_router_ejections_total", nil)
	}
	ej0 := ejections()
	var conns []net.Conn
	defer func() {
		for _, conn := range conns {
			conn.Close()
		}
	}()
	for i := range n {
		conn, err := net.Dial("tcp", c.headAddr())
		if err != nil {
			c.violate("dial %d: %v", i, err)
			return ""
		}
		conns = append(conns, conn)
		_ = conn.(*net.TCPConn).SetReadBuffer(1024)
		body := audioBody(5000+i, 2000, "never read me")
		req := fmt.Sprintf("POST /v1/chat/completions HTTP/1.1\r\nHost: troupe\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		if _, err := io.WriteString(conn, req); err != nil {
			c.violate("request %d: %v", i, err)
			return ""
		}
	}
	var peak int64
	bad := map[string]int{}
	end := time.Now().Add(hold)
	for time.Now().Before(end) && ctx.Err() == nil {
		if rss, err := vmRSS(pid); err == nil {
			peak = max(peak, rss)
		}
		if rows, err := c.head.replicas(ctx); err == nil {
			for _, r := range rows {
				if r.State != "attached" && r.State != "detached" {
					bad[fmt.Sprintf("%s/%d %s", r.StageName, r.Replica, r.State)]++
				}
			}
		}
		sleepCtx(ctx, 200*time.Millisecond)
	}
	ej := ejections() - ej0
	bound := int64(unreadRSSBound)
	if n > 200 {
		bound = unreadRSSGoal
	}
	if peak > bound {
		c.violate("head RSS peaked at %d MiB, over the %d MiB bound", peak>>20, bound>>20)
	}
	if ej > 0 {
		c.violate("%v ejections", ej)
	}
	if len(bad) > 0 {
		c.violate("replicas seen not attached: %v", bad)
	}
	return fmt.Sprintf("%d streamed pcm16 requests (max_tokens 2000) on connections with a 1 KiB receive buffer, never read, held %s; head RSS %d MiB before, peak %d MiB (bound %d MiB); %v ejections",
		n, hold, before>>20, peak>>20, bound>>20, ej)
}

// recordsThatLie (issue 34, item 7): records written straight into etcd
// that lie about a running cluster. thinker/0's record is overwritten,
// under another lease, with the address of a listener that is not a
// worker; thinker/5, 6 and 7 name thinker 1's address; thinker/9 carries a
// 1.4 MB version. The head refuses every one, routes nothing to them and
// its /metrics stays small.
func recordsThatLie(ctx context.Context, c *chaosCluster) string {
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{c.etcdURL}, DialTimeout: 5 * time.Second})
	if err != nil {
		c.violate("etcd client: %v", err)
		return ""
	}
	defer cli.Close()
	fake, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		c.violate("listen: %v", err)
		return ""
	}
	var dialled atomic.Int32
	var fwg sync.WaitGroup
	fwg.Add(1)
	go func() { // accepts and reads, never answers
		defer fwg.Done()
		var cwg sync.WaitGroup
		defer cwg.Wait()
		for {
			conn, err := fake.Accept()
			if err != nil {
				return
			}
			dialled.Add(1)
			cwg.Add(1)
			go func() { defer cwg.Done(); defer conn.Close(); _, _ = io.Copy(io.Discard, conn) }()
		}
	}()
	defer func() { fake.Close(); fwg.Wait() }()
	fakeAddr := fake.Addr().String()
	real0 := c.workers["thinker"][0].addr
	one := c.workers["thinker"][1].addr

	m0, err := c.head.scrape(ctx)
	if err != nil {
		c.violate("scrape: %v", err)
		return ""
	}
	invalid0 := m0.sum("troupe_membership_invalid_records_total", nil)
	size0 := metricsSize(ctx, c)

	lease, err := cli.Grant(ctx, 60)
	if err != nil {
		c.violate("grant: %v", err)
		return ""
	}
	defer func() { _, _ = cli.Revoke(context.WithoutCancel(ctx), lease.ID) }()
	put := func(id int, addr, version string) {
		rec := fmt.Sprintf(`{"stage":"thinker","replica_id":%d,"addr":%q,"engine":"sim","version":%q,"started_at":"2026-01-01T00:00:00Z"}`, id, addr, version)
		if _, err := cli.Put(ctx, fmt.Sprintf("/troupe/default/members/thinker/%d", id), rec, clientv3.WithLease(lease.ID)); err != nil {
			c.violate("put thinker/%d: %v", id, err)
		}
	}
	for _, id := range []int{5, 6, 7} {
		put(id, one, "x")
	}
	put(9, real0, strings.Repeat("v", 1400<<10))
	// thinker/0 is overwritten every 500 ms for 5 s: its worker restores
	// its record each time.
	states0 := map[string]bool{}
	refused := map[uint32]string{}
	end := time.Now().Add(5 * time.Second)
	next := time.Now()
	for time.Now().Before(end) && ctx.Err() == nil {
		if !time.Now().Before(next) {
			put(0, fakeAddr, "x")
			next = time.Now().Add(500 * time.Millisecond)
		}
		rows, _ := reasonedReplicas(ctx, c.head)
		for _, r := range rows {
			if r.StageName != "thinker" {
				continue
			}
			switch {
			case r.Replica == 0:
				states0[r.State] = true
				if r.Addr != real0 {
					c.violate("thinker/0 listed at %s, not the worker's %s", r.Addr, real0)
				}
			case r.Replica >= 5 && r.State == "unhealthy" && strings.HasPrefix(r.Reason, "refused"):
				refused[r.Replica] = r.Reason
			case r.Replica >= 5 && r.State == "attached":
				c.violate("thinker/%d attached (%s)", r.Replica, r.Addr)
			}
		}
		sleepCtx(ctx, 50*time.Millisecond)
	}
	m1, err := c.head.scrape(ctx)
	if err != nil {
		c.violate("scrape: %v", err)
		return ""
	}
	for _, id := range []uint32{5, 6, 7} {
		if refused[id] == "" {
			c.violate("thinker/%d never refused", id)
		}
	}
	if _, ok := refused[9]; ok {
		c.violate("the oversized record was listed")
	}
	invalid := m1.sum("troupe_membership_invalid_records_total", nil) - invalid0
	if invalid < 1 {
		c.violate("the oversized record not counted invalid")
	}
	for _, id := range []uint32{5, 6, 7, 9} {
		if v := m1.sum("troupe_request_success_total", replicaLabels(id)); v > 0 {
			c.violate("thinker/%d served %v requests", id, v)
		}
	}
	size1 := metricsSize(ctx, c)
	if size1 > size0+64<<10 {
		c.violate("/metrics grew from %d to %d bytes", size0, size1)
	}
	served0 := m1.sum("troupe_request_success_total", replicaLabels(0)) - m0.sum("troupe_request_success_total", replicaLabels(0))
	st := slices.Sorted(maps.Keys(states0))
	return fmt.Sprintf("thinker/0 overwritten 10 times with a non-worker listener's address: listed %s at its worker's address, served %v requests meanwhile, the listener dialled %d times (probes); thinker/5-7 at thinker 1's address: %d of 3 refused (%q); 1.4 MB version: not listed, %v invalid counted; /metrics %d → %d bytes",
		strings.Join(st, "/"), served0, dialled.Load(), len(refused), refused[5], invalid, size0, size1)
}

// metricsSize is the size of one /metrics scrape, -1 on an error.
func metricsSize(ctx context.Context, c *chaosCluster) int {
	b, err := c.head.get(ctx, "/metrics", "text/plain;version=0.0.4")
	if err != nil {
		return -1
	}
	return len(b)
}

// reasonRow is a /v1/replicas row with its reason.
type reasonRow struct {
	replicaRow
	Reason string `json:"reason"`
}

func reasonedReplicas(ctx context.Context, h *head) ([]reasonRow, error) {
	b, err := h.get(ctx, "/v1/replicas", "")
	if err != nil {
		return nil, err
	}
	var out struct {
		Data []reasonRow `json:"data"`
	}
	if err := json.Unmarshal(b, &out); err != nil {
		return nil, errorf("/v1/replicas: %w", err)
	}
	return out.Data, nil
}
