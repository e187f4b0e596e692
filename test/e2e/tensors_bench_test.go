//go:build linux

package e2e

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	oa "github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	troupeworker "github.com/troupe-serving/troupe/worker"
	"github.com/troupe-serving/troupe/worker/omnisim"
	"github.com/troupe-serving/troupe/worker/sim"
)

// cpuOf is a process's CPU time so far (utime + stime of /proc/PID/stat,
// its threads included, at the kernel's 100 ticks a second).
func cpuOf(tb testing.TB, pid int) time.Duration {
	tb.Helper()
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	require.NoError(tb, err)
	f := strings.Fields(string(raw[strings.LastIndexByte(string(raw), ')')+2:]))
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * 10 * time.Millisecond
}

// serveInProcess runs a worker of stage with eng in this process,
// registered in etcd, until the benchmark ends.
func serveInProcess(tb testing.TB, etcd, stage string, eng troupeworker.Engine) {
	tb.Helper()
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{etcd}, DialTimeout: 5 * time.Second})
	require.NoError(tb, err)
	srv, err := troupeworker.New(troupeworker.Config{Stage: stage, AutoID: true, Engine: eng, EtcdClient: cli, MaxRequestTensorBytes: 64 << 20, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(tb, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	tb.Cleanup(func() {
		cancel()
		<-done
		cli.Close()
	})
	select {
	case <-srv.Registered():
	case err := <-done:
		tb.Fatalf("e2e: worker %s: %v", stage, err)
	}
}

// BenchmarkTensorHeadCPU: a chat with audio through thinker → talker →
// vocoder whose talker reads the thinker's hidden states (omnisim, in this
// process), at about 0, 1, 8 and 40 MB of tensors a request (32 words),
// through a `troupe head` process. It reports the head's CPU per request
// (its process's, idle work included: every request lasts about as long),
// which must not grow with the tensors: they go worker to worker. docs/benchmarks.md "Tensors worker to worker".
func BenchmarkTensorHeadCPU(b *testing.B) {
	const tokens = 32
	// Every word takes 15 ms, so that requests of every size last about as
	// long: the head's cost of a request grows with its length (the
	// workers' load reports while they are busy), which would otherwise
	// show as a cost of the bytes.
	const delay = 15 * time.Millisecond
	for _, mb := range []int{0, 1, 8, 40} {
		b.Run(fmt.Sprintf("%dMB", mb), func(b *testing.B) {
			requireBinary(b)
			width := max(1, mb<<20/(tokens*4))
			etcd := startEtcd(b)
			h := startHead(b, etcd)
			serveInProcess(b, etcd, "thinker", &omnisim.Thinker{Width: width, MaxTokens: tokens, TokenDelay: delay})
			serveInProcess(b, etcd, "talker", &omnisim.Talker{})
			voc := sim.New(sim.Config{Role: "audio"})
			b.Cleanup(func() { _ = voc.Close() })
			serveInProcess(b, etcd, "vocoder", voc)
			ctx := context.Background()
			client := oa.NewClient(option.WithBaseURL(h.base+"/v1/"), option.WithAPIKey("unused"), option.WithHTTPClient(h.client), option.WithMaxRetries(0))
			params := oa.ChatCompletionNewParams{
				Model:      modelName,
				Messages:   []oa.ChatCompletionMessageParamUnion{oa.UserMessage("tell me")},
				Modalities: []string{"text", "audio"},
				Audio:      oa.ChatCompletionAudioParam{Voice: oa.ChatCompletionAudioParamVoiceUnion{OfString: oa.String("alloy")}, Format: "pcm16"},
			}
			require.Eventually(b, func() bool {
				_, err := client.Chat.Completions.New(ctx, params)
				return err == nil
			}, 30*time.Second, 50*time.Millisecond, "the pipeline serves")
			pid := h.cmd.Process.Pid
			before := cpuOf(b, pid)
			b.ResetTimer()
			for range b.N {
				res, err := client.Chat.Completions.New(ctx, params)
				require.NoError(b, err)
				require.NotEmpty(b, res.Choices[0].Message.Audio.Data)
			}
			b.StopTimer()
			b.ReportMetric(float64(cpuOf(b, pid)-before)/float64(time.Millisecond)/float64(b.N), "head-cpu-ms/req")
			b.ReportMetric(float64(width*4*tokens)/(1<<20), "tensor-MB/req")
		})
	}
}
