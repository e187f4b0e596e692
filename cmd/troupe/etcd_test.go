package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// freeLoopbackPorts reserves n distinct free ports on 127.0.0.1 and
// releases them for the caller to bind.
func freeLoopbackPorts(t *testing.T, n int) []int {
	t.Helper()
	ports := make([]int, 0, n)
	var ls []net.Listener
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	for _, l := range ls {
		require.NoError(t, l.Close())
	}
	return ports
}

// memberArgsEnv carries a member's `troupe etcd` flags to the child process
// TestEtcdMemberProcess runs in; a newline separates them.
const memberArgsEnv = "TROUPE_TEST_ETCD_MEMBER_ARGS"

// TestEtcdMemberProcess is not a test on its own: TestEtcdThreeMembers runs
// the test binary again with only it selected and memberArgsEnv set, and it
// then is `troupe etcd` in its own process, as each pod of the StatefulSet
// is, until SIGTERM. It exits the process with troupe's exit status.
func TestEtcdMemberProcess(t *testing.T) {
	raw := os.Getenv(memberArgsEnv)
	if raw == "" {
		t.Skip("run by TestEtcdThreeMembers as a child process")
	}
	os.Exit(run(append([]string{"etcd"}, strings.Split(raw, "\n")...), os.Stdout, os.Stderr))
}

// TestEtcdThreeMembers bootstraps a three-member cluster of `troupe etcd`
// processes with the flags the chart's StatefulSet passes, sees a quorum (a
// write through member 1 read linearizably through member 3), then stops
// one member with SIGTERM and sees the other two still take writes.
//
// Each member runs in its own process, as in a deployment: etcd keeps idle
// peer connections (its version probes) in a transport nothing closes, so
// three members in one test process would leave goroutines behind that a
// member process takes with it when it exits.
func TestEtcdThreeMembers(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	t.Cleanup(cancel)
	ports := freeLoopbackPorts(t, 6)
	names := []string{"etcd-0", "etcd-1", "etcd-2"}
	clientURL := func(i int) string { return fmt.Sprintf("http://127.0.0.1:%d", ports[2*i]) }
	peerURL := func(i int) string { return fmt.Sprintf("http://127.0.0.1:%d", ports[2*i+1]) }
	var cluster []string
	for i, n := range names {
		cluster = append(cluster, n+"="+peerURL(i))
	}

	members := make([]*memberProc, len(names))
	for i, n := range names {
		members[i] = startMember(t, []string{
			"--name=" + n,
			"--data-dir=" + t.TempDir(),
			"--listen-client-urls=" + clientURL(i),
			"--advertise-client-urls=" + clientURL(i),
			"--listen-peer-urls=" + peerURL(i),
			"--initial-advertise-peer-urls=" + peerURL(i),
			"--initial-cluster=" + strings.Join(cluster, ","),
			"--initial-cluster-state=new",
			"--initial-cluster-token=three-members-test",
			"--log-level=error",
		})
	}

	dial := func(i int) *clientv3.Client {
		cli, err := clientv3.New(clientv3.Config{
			Endpoints: []string{clientURL(i)}, DialTimeout: 5 * time.Second, Logger: zap.NewNop(),
		})
		require.NoError(t, err)
		t.Cleanup(func() { _ = cli.Close() })
		return cli
	}
	c1, c3 := dial(0), dial(2)

	// A put through member 1 succeeds once the cluster has a leader.
	put := func(key, val string) bool {
		pctx, pcancel := context.WithTimeout(ctx, 2*time.Second)
		defer pcancel()
		_, err := c1.Put(pctx, key, val)
		return err == nil
	}
	require.Eventually(t, func() bool { return put("/quorum", "one") }, 60*time.Second, 100*time.Millisecond,
		"no write through member 1: the three members formed no quorum")
	got, err := c3.Get(ctx, "/quorum") // linearizable by default
	require.NoError(t, err)
	require.Len(t, got.Kvs, 1)
	require.Equal(t, "one", string(got.Kvs[0].Value))
	list, err := c3.MemberList(ctx)
	require.NoError(t, err)
	var listed []string
	for _, m := range list.Members {
		listed = append(listed, m.Name)
	}
	require.ElementsMatch(t, names, listed)

	// Stop member 2: the other two are still a quorum of three.
	require.NoError(t, members[1].stop(), "member 2 output:\n%s", members[1].out.String())
	require.Contains(t, members[1].out.String(), "troupe etcd: stopped")
	require.Eventually(t, func() bool { return put("/quorum", "two") }, 30*time.Second, 100*time.Millisecond,
		"members 1 and 3 took no write with member 2 stopped")
	got, err = c3.Get(ctx, "/quorum")
	require.NoError(t, err)
	require.Len(t, got.Kvs, 1)
	require.Equal(t, "two", string(got.Kvs[0].Value))
}

// memberProc is one `troupe etcd` child process.
type memberProc struct {
	cmd  *exec.Cmd
	out  *syncBuffer
	done chan error
	once sync.Once
	err  error
}

// startMember starts a member process; the test's cleanup stops it.
func startMember(t *testing.T, args []string) *memberProc {
	t.Helper()
	m := &memberProc{out: &syncBuffer{}, done: make(chan error, 1)}
	m.cmd = exec.Command(os.Args[0], "-test.run=^TestEtcdMemberProcess$", "-test.count=1")
	m.cmd.Env = append(os.Environ(), memberArgsEnv+"="+strings.Join(args, "\n"))
	m.cmd.Stdout, m.cmd.Stderr = m.out, m.out
	require.NoError(t, m.cmd.Start())
	go func() { m.done <- m.cmd.Wait() }()
	t.Cleanup(func() { _ = m.stop() })
	return m
}

// stop sends SIGTERM and waits for the process to exit (killing it after
// 30s); the exit error is nil for a clean stop.
func (m *memberProc) stop() error {
	m.once.Do(func() {
		_ = m.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case m.err = <-m.done:
		case <-time.After(30 * time.Second):
			_ = m.cmd.Process.Kill()
			<-m.done
			m.err = errors.New("member did not stop within 30s of SIGTERM")
		}
	})
	return m.err
}

// syncBuffer is a bytes.Buffer a process and the test may use at once.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.buf.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.buf.String()
}

// TestEtcdRejectsBadClusterFlags: a wrong cluster flag fails at start with
// an error that names the value, before anything binds.
func TestEtcdRejectsBadClusterFlags(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--initial-cluster-state=exists"}, `cluster state "exists": want "new" or "existing"`},
		{[]string{"--name=a", "--initial-cluster=b=http://127.0.0.1:1"}, `does not name this member "a"`},
		{[]string{"--name=a", "--initial-cluster=a"}, `initial cluster "a": want name=http://host:port`},
		{[]string{"--name=a", "--initial-cluster=a=127.0.0.1:2380"}, `want name=http://host:port`},
		{[]string{"--name=a", "--initial-cluster=a=http://127.0.0.1:9,=http://127.0.0.1:8"}, "a member has no name"},
		{
			[]string{"--name=a", "--initial-advertise-peer-urls=http://10.0.0.1:2380", "--initial-cluster=a=http://10.0.0.2:2380"},
			`not its advertised peer URL http://10.0.0.1:2380`,
		},
	} {
		args := append([]string{"--data-dir=" + dir, "--listen-client-urls=http://127.0.0.1:0", "--log-level=error"}, tc.args...)
		err := runEtcd(context.Background(), args, io.Discard)
		require.ErrorContains(t, err, tc.want, "args %v", tc.args)
	}
}
