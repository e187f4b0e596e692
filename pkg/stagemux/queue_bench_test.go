package stagemux

import (
	"runtime"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// thinkerLike sends what a text stage sends: a token of text a chunk, with
// its stats (a token, the engine's gauges).
func thinkerLike(req *stagepb.GenerateRequest, stream grpc.ServerStreamingServer[stagepb.GenerateChunk]) error {
	n := int(req.GetSampling().GetMaxTokens())
	for i := range n {
		c := &stagepb.GenerateChunk{Text: " word", Stats: &stagepb.EngineStats{GenerationTokens: 1, NumRequestsRunning: 100, NumRequestsWaitingCapacity: 3,
			KvCacheUsagePerc: 0.5, PromptTokens: uint64(i % 2)}}
		if i == n-1 {
			c.FinishReason = stagepb.FinishReason_FINISH_REASON_LENGTH
		}
		if err := stream.Send(c); err != nil {
			return err
		}
	}
	return nil
}

// BenchmarkQueuedFrameMemory measures the live heap a call's queue takes
// a frame while nobody reads the call (the head's attempt waits on the
// next stage or the client): frames kept decoded, and frames kept encoded
// past compactAfter (the default), in one run. Reports B/frame.
func BenchmarkQueuedFrameMemory(b *testing.B) {
	const frames = 2000
	for _, tc := range []struct {
		name    string
		decoded int
	}{{"decoded", frames + 1}, {"encoded-after-32", compactAfter}} {
		b.Run(tc.name, func(b *testing.B) {
			svc := &service{generate: thinkerLike}
			client, _ := startServer(b, svc)
			mux := NewClient(client)
			defer mux.Close()
			mux.limits.decoded = tc.decoded
			var perFrame float64
			for b.Loop() {
				heap0 := liveHeap()
				call, err := mux.Generate(b.Context(), &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Text{Text: "x"},
					Sampling: &stagepb.SamplingParams{MaxTokens: frames}}, nil)
				if err != nil {
					b.Fatal(err)
				}
				deadline := time.Now().Add(30 * time.Second)
				for {
					call.mu.Lock()
					n := len(call.frames)
					call.mu.Unlock()
					if n == frames {
						break
					}
					if time.Now().After(deadline) {
						b.Fatalf("%d of %d frames queued", n, frames)
					}
					runtime.Gosched()
				}
				perFrame = float64(liveHeap()-heap0) / frames
				runtime.KeepAlive(call)
				call.Close()
			}
			b.ReportMetric(perFrame, "B/frame")
			b.Logf("%s: %.0f B a queued frame", tc.name, perFrame)
		})
	}
}

func liveHeap() int64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}
