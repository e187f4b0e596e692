package httpapi

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
)

// longAudio is a streamed audio request whose answer (2,000 words, a few
// MB of audio) is far larger than any socket buffer.
const longAudio = `{"model":"troupe-omni-sim","messages":[{"role":"user","content":"go on"}],"max_tokens":2000,"ignore_eos":true,"stream":true,` +
	`"modalities":["text","audio"],"audio":{"voice":"alloy","format":"pcm16"}}`

// unreadStream sends body to path over a connection of its own with a
// receive buffer of rcvbuf bytes, and reads nothing of the answer: the
// caller reads the connection, slowly or never. It is closed at cleanup.
func (a *api) unreadStream(t testing.TB, path, body string, rcvbuf int) net.Conn {
	t.Helper()
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		if err := rc.Control(func(fd uintptr) {
			serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, rcvbuf)
		}); err != nil {
			return err
		}
		return serr
	}}
	conn, err := d.Dial("tcp", strings.TrimPrefix(a.base, "http://"))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	_, err = fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: troupe\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", path, len(body), body)
	require.NoError(t, err)
	return conn
}

// smallSendBuffers gives every connection the server accepts a send
// buffer of 4 KiB.
func smallSendBuffers(s *http.Server) {
	s.ConnState = func(c net.Conn, state http.ConnState) {
		if ec, ok := c.(*errorConn); ok && state == http.StateNew {
			if tc, ok := ec.Conn.(*net.TCPConn); ok {
				_ = tc.SetWriteBuffer(4 << 10)
			}
		}
	}
}

// throttled reads at most burst bytes from r once per tick: a client that
// reads slowly, in bursts.
type throttled struct {
	r     io.Reader
	tick  <-chan time.Time
	burst int
}

func (s *throttled) Read(p []byte) (int, error) {
	<-s.tick
	return s.r.Read(p[:min(len(p), s.burst)])
}

// TestSlowAndUnreadStreamsAreTheClientsFault: clients that read their
// audio streams slowly or not at all block the head's writes, and through
// them the stages, far longer than the stall timeout; no replica is blamed
// (no failed attempt, no ejection, though the breaker ejects at the first
// failure). The slow stream and a well-behaved one complete, every sample
// there; once the write deadline passes the client that reads nothing is
// cut off alone, its stages' work cancelled and counted as the client's
// abort.
func TestSlowAndUnreadStreamsAreTheClientsFault(t *testing.T) {
	const stall = 200 * time.Millisecond
	c := startCluster(t, orchestratortest.Options{ReplicasPerStage: 2, StallTimeout: stall,
		Breaker: orchestrator.BreakerConfig{Failures: 1, Backoff: time.Minute}})
	// The write deadline, 15 stall timeouts: the stages wait on the
	// client that long before it is cut off.
	// Small send buffers: the head's writes wait for the client at once,
	// not once megabytes have gone into the kernel's.
	a := startAPI(t, c, Config{WriteStallTimeout: 15 * stall}, nil, smallSendBuffers)
	a.unreadStream(t, "/v1/chat/completions", longAudio, 1024)
	require.Eventually(t, func() bool { return inFlight(c, 2) > 0 }, wait, 5*time.Millisecond, "the unread request reached the vocoder")

	short := strings.Replace(longAudio, `"max_tokens":2000`, `"max_tokens":12`, 1)
	// The slow client reads 16 KiB every 2 stall timeouts: each write of
	// the head waits for it longer than the stall timeout.
	slow := a.unreadStream(t, "/v1/chat/completions", short, 16<<10)
	ticker := time.NewTicker(2 * stall)
	defer ticker.Stop()
	slowDone := make(chan []int, 1)
	go func() {
		resp, err := http.ReadResponse(bufio.NewReaderSize(&throttled{r: slow, tick: ticker.C, burst: 16 << 10}, 16<<10), nil)
		if err != nil {
			slowDone <- nil
			return
		}
		defer resp.Body.Close()
		slowDone <- streamedAudio(newSSEReader(resp))
	}()

	ctx, cancel := context.WithTimeout(testCtx(t), wait)
	defer cancel()
	good := streamedAudio(newSSEReader(a.startStream(t, ctx, "/v1/chat/completions", short)))
	require.NotEmpty(t, good, "the well-behaved stream completed")
	t.Logf("audio: %d events, %d bytes", len(good), sum(good))
	assert.Equal(t, -1, good[len(good)-1], "ended by [DONE]")
	select {
	case got := <-slowDone:
		require.NotEmpty(t, got, "the slow stream completed")
		assert.Equal(t, -1, got[len(got)-1], "ended by [DONE]")
		assert.Equal(t, sum(good), sum(got), "the slow stream has all the audio")
	case <-ctx.Done():
		t.Fatal("the slow stream did not complete")
	}

	require.Eventually(t, func() bool {
		return counter(t, c, "troupe_pipeline_requests_total", "", "outcome", "abort") == 1 &&
			inFlight(c, 0)+inFlight(c, 1)+inFlight(c, 2) == 0
	}, wait, 10*time.Millisecond, "the unread stream is cut off at the write deadline and its stages end")
	require.Eventually(t, func() bool {
		for _, w := range c.Workers() {
			if s := w.Engine.Snapshot(); s.Running+s.WaitingCapacity > 0 {
				return false
			}
		}
		return true
	}, wait, 10*time.Millisecond, "every stage's work was cancelled")

	assert.Equal(t, 2.0, counter(t, c, "troupe_pipeline_requests_total", "", "outcome", "success"), "the slow and the well-behaved request")
	assert.Zero(t, counter(t, c, "troupe_pipeline_requests_total", "", "outcome", "error"), "the cut-off is the client's, not an error")
	for stage := range 3 {
		s := fmt.Sprint(stage)
		assert.Zero(t, counter(t, c, "troupe_router_ejections_total", s, "", ""), "stage %d: no replica ejected", stage)
		assert.Zero(t, counter(t, c, "troupe_request_success_total", s, "finished_reason", "error"), "stage %d: no attempt failed", stage)
	}
	assert.Equal(t, 1.0, counter(t, c, "troupe_request_success_total", "2", "finished_reason", "abort"), "the unread request's vocoder attempt aborted")
	for _, r := range c.Head.Replicas() {
		assert.Equal(t, orchestrator.StateAttached, r.State, "%s replica %d: %s", r.StageName, r.Replica, r.Reason)
	}
}

// streamedAudio reads a chat stream to its end: the length of each audio
// delta's data, then -1 for a final [DONE].
func streamedAudio(events *sseReader) []int {
	var lens []int
	for {
		d, ok := events.next()
		if !ok {
			return lens
		}
		if d == "[DONE]" {
			lens = append(lens, -1)
			continue
		}
		var ch struct {
			Choices []struct {
				Delta struct {
					Audio *struct {
						Data string `json:"data"`
					} `json:"audio"`
				} `json:"delta"`
			} `json:"choices"`
		}
		if json.Unmarshal([]byte(d), &ch) != nil {
			continue
		}
		for _, c := range ch.Choices {
			if a := c.Delta.Audio; a != nil && a.Data != "" {
				lens = append(lens, len(a.Data))
			}
		}
	}
}

func sum(xs []int) int {
	n := 0
	for _, x := range xs {
		n += x
	}
	return n
}

// TestUnreadStreamsMemory measures what streamed audio requests whose
// clients read nothing cost in memory: each should hold a bounded window
// of its answer, not the answer, the stages waiting for the client. A
// measurement, run only when TROUPE_UNREAD_STREAMS says how many streams
// (docs/reliability.md, "Clients that do not read", cites 200); with
// TROUPE_HEAP_PROFILE it writes a heap profile there. The process holds
// the sim workers too: the head's share is read from the profile.
func TestUnreadStreamsMemory(t *testing.T) {
	v := os.Getenv("TROUPE_UNREAD_STREAMS")
	if v == "" {
		t.Skip("a measurement: set TROUPE_UNREAD_STREAMS")
	}
	n, err := strconv.Atoi(v)
	require.NoError(t, err)
	profile := os.Getenv("TROUPE_HEAP_PROFILE") // a file for the heap profile at the end
	if profile != "" {
		runtime.MemProfileRate = 4 << 10
	}
	c := startCluster(t, orchestratortest.Options{})
	a := startAPI(t, c, Config{WriteStallTimeout: 10 * time.Minute}, nil, nil)
	heap0, rss0 := memory(t)
	for range n {
		a.unreadStream(t, "/v1/chat/completions", longAudio, 1024)
	}
	require.Eventually(t, func() bool { return inFlight(c, 2) == int64(n) }, wait, 10*time.Millisecond, "every stream reached the vocoder")
	// The streams stop once the buffers between the stages and the
	// clients are full: wait until the heap stops growing.
	var heap, rss uint64
	require.Eventually(t, func() bool {
		h, r := memory(t)
		settled := heap > 0 && h < heap+heap/50
		heap, rss = h, r
		return settled
	}, 2*wait, time.Second, "the heap settles")
	per := func(after, before uint64) float64 {
		return float64(int64(after)-int64(before)) / float64(n) / (1 << 20)
	}
	t.Logf("%d unread audio streams: heap %.1f MiB -> %.1f MiB (%.2f MiB a stream), RSS %.1f MiB -> %.1f MiB (%.2f MiB a stream)",
		n, mib(heap0), mib(heap), per(heap, heap0), mib(rss0), mib(rss), per(rss, rss0))
	if profile != "" {
		out, err := os.Create(profile)
		require.NoError(t, err)
		require.NoError(t, pprof.WriteHeapProfile(out))
		require.NoError(t, out.Close())
	}
	assert.Equal(t, int64(n), inFlight(c, 2), "no stream was cut off")
}

// memory is the live heap after a collection, and the process's resident
// set (0 where /proc is not there).
func memory(t *testing.T) (heap, rss uint64) {
	t.Helper()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return ms.HeapAlloc, 0
	}
	for _, line := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseUint(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			require.NoError(t, err)
			rss = kb << 10
		}
	}
	return ms.HeapAlloc, rss
}

func mib(b uint64) float64 { return float64(b) / (1 << 20) }
