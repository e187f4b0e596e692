package membership_test

import (
	"context"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"

	"github.com/troupe-serving/troupe/membership"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// wait bounds every wait on a condition; generous for a loaded machine.
const wait = 20 * time.Second

func testCtx(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// dial connects with membership.Dial and closes the client at cleanup.
func dial(t *testing.T, endpoints []string) *clientv3.Client {
	t.Helper()
	cli, err := membership.Dial(testCtx(t), membership.ClientConfig{Endpoints: endpoints})
	require.NoError(t, err)
	t.Cleanup(func() { _ = cli.Close() })
	return cli
}

func member(stage string, id uint32, addr string) membership.Member {
	return membership.Member{
		Stage: stage, ReplicaID: id, Addr: addr, Engine: "sim", Version: "test",
		StartedAt: time.Now().UTC().Truncate(time.Second),
	}
}

// register registers and closes the registration at cleanup.
func register(t *testing.T, cli *clientv3.Client, cfg membership.RegisterConfig) *membership.Registration {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = quietLogger()
	}
	r, err := membership.Register(testCtx(t), cli, cfg)
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = r.Close(ctx)
	})
	return r
}

func quietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// watching runs a watcher until cleanup and hands out its events.
type watching struct {
	events chan membership.Event
}

func startWatcher(t *testing.T, w *membership.Watcher) *watching {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	wa := &watching{events: make(chan membership.Event, 256)}
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx, wa.events) }()
	t.Cleanup(func() {
		cancel()
		require.ErrorIs(t, <-done, context.Canceled)
	})
	return wa
}

// next returns the next event, failing t when none comes in time.
func (wa *watching) next(t *testing.T) membership.Event {
	t.Helper()
	select {
	case ev := <-wa.events:
		return ev
	case <-time.After(wait):
		t.Fatalf("no membership event within %v", wait)
		return membership.Event{}
	}
}

// until returns the events up to and including the first one that
// matches.
func (wa *watching) until(t *testing.T, match func(membership.Event) bool) []membership.Event {
	t.Helper()
	var seen []membership.Event
	timeout := time.After(wait)
	for {
		select {
		case ev := <-wa.events:
			seen = append(seen, ev)
			if match(ev) {
				return seen
			}
		case <-timeout:
			t.Fatalf("no matching membership event within %v; saw %v", wait, seen)
		}
	}
}

// none asserts that no event is queued right now.
func (wa *watching) none(t *testing.T) {
	t.Helper()
	select {
	case ev := <-wa.events:
		t.Fatalf("unexpected membership event %+v", ev)
	default:
	}
}

func is(typ membership.EventType, key string) func(membership.Event) bool {
	return func(ev membership.Event) bool { return ev.Type == typ && ev.Key == key }
}

// resyncs collects the outcome of each list a watcher makes.
type resyncs struct{ ch chan error }

func hookResyncs(w *membership.Watcher, listTimeout time.Duration) *resyncs {
	r := &resyncs{ch: make(chan error, 1024)}
	membership.SetWatchTestHooks(w, listTimeout, func(_ int64, err error) {
		select {
		case r.ch <- err:
		default:
		}
	})
	return r
}

// waitFor waits for a list whose outcome matches ok.
func (r *resyncs) waitFor(t *testing.T, what string, ok func(error) bool) {
	t.Helper()
	timeout := time.After(wait)
	for {
		select {
		case err := <-r.ch:
			if ok(err) {
				return
			}
		case <-timeout:
			t.Fatalf("no %s list within %v", what, wait)
		}
	}
}

func succeeded(err error) bool { return err == nil }
func failed(err error) bool    { return err != nil }

// regEvent waits for a registration event of the given type.
func regEvent(t *testing.T, r interface {
	Events() <-chan membership.RegistrationEvent
}, typ membership.RegistrationEventType) membership.RegistrationEvent {
	t.Helper()
	timeout := time.After(wait)
	for {
		select {
		case ev, ok := <-r.Events():
			if !ok {
				t.Fatalf("registration events closed while waiting for %v", typ)
			}
			if ev.Type == typ {
				return ev
			}
		case <-timeout:
			t.Fatalf("no %v registration event within %v", typ, wait)
		}
	}
}

// logRecorder is a slog handler that keeps messages for assertions.
type logRecorder struct {
	mu   sync.Mutex
	msgs []string
}

func (l *logRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (l *logRecorder) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	b.WriteString(r.Message)
	r.Attrs(func(a slog.Attr) bool {
		b.WriteString(" " + a.Key + "=" + a.Value.String())
		return true
	})
	l.mu.Lock()
	l.msgs = append(l.msgs, b.String())
	l.mu.Unlock()
	return nil
}
func (l *logRecorder) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logRecorder) WithGroup(string) slog.Handler      { return l }

func (l *logRecorder) count(substr string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, m := range l.msgs {
		if strings.Contains(m, substr) {
			n++
		}
	}
	return n
}

// proxy is a loopback TCP proxy that can cut a client off from etcd while
// others still reach it: a network partition of one process.
type proxy struct {
	ln     net.Listener
	target string

	mu     sync.Mutex
	paused bool
	conns  map[net.Conn]struct{}
	wg     sync.WaitGroup
}

func startProxy(t *testing.T, targetURL string) *proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &proxy{ln: ln, target: strings.TrimPrefix(targetURL, "http://"), conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

func (p *proxy) url() string { return "http://" + p.ln.Addr().String() }

func (p *proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		if p.paused {
			p.mu.Unlock()
			_ = c.Close()
			continue
		}
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			p.mu.Unlock()
			_ = c.Close()
			continue
		}
		p.conns[c], p.conns[up] = struct{}{}, struct{}{}
		p.wg.Add(2)
		p.mu.Unlock()
		go p.pipe(c, up)
		go p.pipe(up, c)
	}
}

func (p *proxy) pipe(dst, src net.Conn) {
	defer p.wg.Done()
	_, _ = io.Copy(dst, src)
	_ = dst.Close()
	_ = src.Close()
	p.mu.Lock()
	delete(p.conns, dst)
	delete(p.conns, src)
	p.mu.Unlock()
}

// pause drops every connection and refuses new ones until resume.
func (p *proxy) pause() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.paused = true
	for c := range p.conns {
		_ = c.Close()
	}
}

func (p *proxy) resume() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.paused = false
}

func (p *proxy) close() {
	_ = p.ln.Close()
	p.pause()
	p.wg.Wait()
}
