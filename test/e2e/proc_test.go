//go:build unix

package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// wait bounds every wait on a condition; generous for a loaded 2-core
// machine.
const wait = 30 * time.Second

// testCtx is the context of one test's requests and waits.
func testCtx(t testing.TB) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// proc is one troupe process, the leader of its own process group. Its
// group is killed at cleanup, whatever state the test left it in.
type proc struct {
	name   string
	cmd    *exec.Cmd
	stdout *lineLog
	stderr *lineLog
	exited chan struct{} // closed once Wait returned; state is set before
	state  *os.ProcessState
}

// startProc runs the troupe binary with args and an environment without
// any TROUPE_* or OTEL_* variable of the caller (they would change the
// flags' defaults), plus env.
func startProc(t testing.TB, name string, env []string, args ...string) *proc {
	t.Helper()
	requireBinary(t)
	return startExec(t, name, troupeBin, env, args...)
}

// startExec is startProc for another program, bin (an engine process).
func startExec(t testing.TB, name, bin string, env []string, args ...string) *proc {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(cleanEnv(), env...)
	cmd.SysProcAttr = sysProcAttr()
	cmd.WaitDelay = 10 * time.Second // bounds copying output once the process is gone
	p := &proc{name: name, cmd: cmd, stdout: newLineLog(), stderr: newLineLog(), exited: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = p.stdout, p.stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("e2e: start %s: %v", name, err)
	}
	go func() {
		_ = cmd.Wait() // the exit status is in ProcessState
		p.state = cmd.ProcessState
		close(p.exited)
	}()
	t.Cleanup(func() {
		// The whole group, even after the leader exited: nothing may outlive
		// the test.
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		select {
		case <-p.exited:
		case <-time.After(wait):
			t.Errorf("e2e: %s (pid %d) not reaped %s after SIGKILL", name, cmd.Process.Pid, wait)
		}
		if t.Failed() {
			t.Logf("--- %s %s\nstdout:\n%s\nstderr:\n%s", name, strings.Join(args, " "), p.stdout.tail(40), p.stderr.tail(60))
		}
	})
	return p
}

func cleanEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "TROUPE_") || strings.HasPrefix(kv, "OTEL_") {
			continue
		}
		env = append(env, kv)
	}
	return env
}

// signal sends sig to the process (not its group), as kill(1) would.
func (p *proc) signal(t testing.TB, sig syscall.Signal) {
	t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		t.Fatalf("e2e: signal %v to %s: %v", sig, p.name, err)
	}
}

// kill sends SIGKILL to the whole process group: a crash.
func (p *proc) kill(t testing.TB) {
	t.Helper()
	if err := syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL); err != nil {
		t.Fatalf("e2e: SIGKILL %s: %v", p.name, err)
	}
}

// exitCode waits, bounded, for the process to exit and returns its code
// (-1 when a signal ended it).
func (p *proc) exitCode(t testing.TB, within time.Duration) int {
	t.Helper()
	select {
	case <-p.exited:
		return p.state.ExitCode()
	case <-time.After(within):
		t.Fatalf("e2e: %s did not exit within %s\nstderr:\n%s", p.name, within, p.stderr.tail(30))
		return 0
	}
}

// groupGone reports whether no process of p's group is left.
func (p *proc) groupGone() bool {
	return errors.Is(syscall.Kill(-p.cmd.Process.Pid, 0), syscall.ESRCH)
}

// waitLine waits until a line of log matches re, or the process exits, or
// the wait bound passes; it returns the submatches of the first match.
func (p *proc) waitLine(t testing.TB, log *lineLog, re *regexp.Regexp) []string {
	t.Helper()
	deadline := time.NewTimer(wait)
	defer deadline.Stop()
	for {
		changed := log.changed()
		if m := log.find(re); m != nil {
			return m
		}
		select {
		case <-changed:
		case <-p.exited:
			if m := log.find(re); m != nil {
				return m
			}
			t.Fatalf("e2e: %s exited (%v) before printing %q\nstdout:\n%s\nstderr:\n%s", p.name, p.state, re, p.stdout.tail(20), p.stderr.tail(30))
		case <-deadline.C:
			t.Fatalf("e2e: %s did not print %q within %s\nstdout:\n%s\nstderr:\n%s", p.name, re, wait, p.stdout.tail(20), p.stderr.tail(30))
		}
	}
}

// lineLog collects a process's output as lines and lets waiters know when
// more arrived. Its methods may be called concurrently.
type lineLog struct {
	mu      sync.Mutex
	lines   []string
	partial []byte
	notify  chan struct{} // closed and replaced on every write
}

func newLineLog() *lineLog { return &lineLog{notify: make(chan struct{})} }

func (l *lineLog) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.partial = append(l.partial, b...)
	for {
		i := bytes.IndexByte(l.partial, '\n')
		if i < 0 {
			break
		}
		l.lines = append(l.lines, string(l.partial[:i]))
		l.partial = l.partial[i+1:]
	}
	close(l.notify)
	l.notify = make(chan struct{})
	return len(b), nil
}

// changed is closed at the next write.
func (l *lineLog) changed() <-chan struct{} {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.notify
}

// find returns the submatches of the first line matching re, or nil.
func (l *lineLog) find(re *regexp.Regexp) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, line := range l.lines {
		if m := re.FindStringSubmatch(line); m != nil {
			return m
		}
	}
	return nil
}

// String is everything written so far.
func (l *lineLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.lines, "\n") + "\n" + string(l.partial)
}

// tail is the last n lines.
func (l *lineLog) tail(n int) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	from := max(0, len(l.lines)-n)
	return strings.Join(l.lines[from:], "\n") + "\n" + string(l.partial)
}

// eventually polls cond until it reports true, an error, or ctx or the
// wait bound ends; the last reason cond gave is in the failure.
func eventually(ctx context.Context, t testing.TB, what string, cond func() (ok bool, why string, err error)) {
	t.Helper()
	eventuallyWithin(ctx, t, wait, what, cond)
}

// eventuallyWithin is eventually with its own bound.
func eventuallyWithin(ctx context.Context, t testing.TB, bound time.Duration, what string, cond func() (ok bool, why string, err error)) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	var why string
	for {
		ok, w, err := cond()
		if err != nil {
			t.Fatalf("e2e: waiting for %s: %v", what, err)
		}
		if ok {
			return
		}
		why = w
		select {
		case <-ctx.Done():
			t.Fatalf("e2e: %s: not within %s (%s)", what, bound, why)
		case <-tick.C:
		}
	}
}

// errorf is fmt.Errorf with the e2e prefix.
func errorf(format string, args ...any) error { return fmt.Errorf("e2e: "+format, args...) }
