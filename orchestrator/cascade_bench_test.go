package orchestrator_test

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker/sim"
)

// BenchmarkCascade compares the cascade asr → thinker → talker → vocoder
// streaming between the stages after the recognizer with running them one
// after the other, in one run, at the pace of BenchmarkStreamingPipeline
// (5 ms decode steps, answers of 64 words), one request at a time. Each
// request's user message is 12 KB of audio, transcribed by the sim asr.
// It reports time to first audio and total latency (p50/p99), from the
// request's start (the recognition included).
//
//	go test -run '^$' -bench Cascade -benchtime 16x ./orchestrator/
func BenchmarkCascade(b *testing.B) {
	pace := sim.Config{DecodeTokenLatency: 5 * time.Millisecond}
	for _, streaming := range []bool{true, false} {
		mode := map[bool]string{true: "streaming", false: "sequential"}[streaming]
		b.Run(mode, func(b *testing.B) {
			p := orchestrator.Pipeline{Model: "troupe-omni-sim", Streaming: &streaming,
				Stages: []orchestrator.Stage{{Name: "asr"}, {Name: "thinker"}, {Name: "talker"}, {Name: "vocoder"}}}
			c := orchestratortest.Start(b, orchestratortest.Options{Pipeline: p, Sim: pace})
			var ttfa, e2e []time.Duration
			b.ResetTimer()
			for i := range b.N {
				audio := bytes.Repeat([]byte{byte(i), 0, 7, 0}, 3000)
				start := time.Now()
				var first time.Duration
				req := orchestrator.Request{ID: fmt.Sprint(i), Sampling: longAnswer(64, int64(i)), Stages: 4,
					Messages: []*stagepb.ChatMessage{{Role: "user", Parts: []*stagepb.ContentPart{{Kind: stagepb.PartAudio, Data: audio}}}},
					OnAudio: func([]byte, int) error {
						if first == 0 {
							first = time.Since(start)
						}
						return nil
					}}
				if _, err := c.Head.Execute(context.Background(), req, nil); err != nil {
					b.Fatal(err)
				}
				ttfa, e2e = append(ttfa, first), append(e2e, time.Since(start))
			}
			b.StopTimer()
			b.ReportMetric(pct(ttfa, 0.5), "ttfa-p50-ms")
			b.ReportMetric(pct(ttfa, 0.99), "ttfa-p99-ms")
			b.ReportMetric(pct(e2e, 0.5), "e2e-p50-ms")
			b.ReportMetric(pct(e2e, 0.99), "e2e-p99-ms")
		})
	}
}
