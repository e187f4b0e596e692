package worker

import (
	"context"
	"errors"
	"net"
	"time"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// Observer sees the replica's own Generate and GenerateStream calls as
// this worker serves them (Config.Observer): troupe worker serves them on
// --metrics-listen as the head's per-replica families (docs/stats.md). It
// is called from request goroutines, concurrently; it must not block.
type Observer interface {
	// ObserveChunk gets every chunk's engine stats (nil: none), before the
	// chunk is sent.
	ObserveChunk(s *stagepb.EngineStats)
	// ObserveFinished gets each call once it ended.
	ObserveFinished(f Finished)
}

// Finished is one Generate call as the worker served it: the head's
// stats.Finished, measured from the worker's side of the stream (from the
// call's arrival, without the network to the head).
type Finished struct {
	Reason                                                stagepb.FinishReason
	PromptTokens, GenerationTokens, PrefillComputedTokens int
	// TTFT: arrival to the first chunk with output (0: none came);
	// InterTokenLatencies: the gaps between later output chunks.
	TTFT, E2E              time.Duration
	InterTokenLatencies    []time.Duration
	Queue, Prefill, Decode time.Duration // the engine's Timings
	MaxTokensParam         int
}

// observation follows one call for an Observer; nil without one.
type observation struct {
	obs         Observer
	start, last time.Time
	fin         Finished
}

func (s *Server) observe(req *stagepb.GenerateRequest, start time.Time) *observation {
	if s.cfg.Observer == nil {
		return nil
	}
	return &observation{obs: s.cfg.Observer, start: start,
		fin: Finished{MaxTokensParam: int(req.GetSampling().GetMaxTokens())}}
}

func (o *observation) chunk(c *stagepb.GenerateChunk) {
	if o == nil {
		return
	}
	st := c.GetStats()
	o.obs.ObserveChunk(st)
	o.fin.PromptTokens += int(st.GetPromptTokens())
	o.fin.GenerationTokens += int(st.GetGenerationTokens())
	o.fin.PrefillComputedTokens += int(st.GetPromptTokensLocalCompute())
	if c.GetText() != "" || len(c.GetCodes()) > 0 || len(c.GetAudioPcm16()) > 0 {
		now := time.Now()
		if o.last.IsZero() {
			o.fin.TTFT = max(now.Sub(o.start), 1)
		} else {
			o.fin.InterTokenLatencies = append(o.fin.InterTokenLatencies, now.Sub(o.last))
		}
		o.last = now
	}
	if r := c.GetFinishReason(); r != stagepb.FinishReason_FINISH_REASON_UNSPECIFIED {
		o.fin.Reason = r
	}
	if t := c.GetTimings(); t != nil {
		o.fin.Queue = secondsOf(t.GetQueueSeconds())
		o.fin.Prefill = secondsOf(t.GetPrefillSeconds())
		o.fin.Decode = secondsOf(t.GetDecodeSeconds())
	}
}

// end reports the call: an error ends it as abort (its context ended)
// or error, whatever a chunk said before.
func (o *observation) end(ctx context.Context, err error) {
	if o == nil {
		return
	}
	switch {
	case err != nil && (ctx.Err() != nil || errors.Is(err, context.Canceled)):
		o.fin.Reason = stagepb.FinishReason_FINISH_REASON_ABORT
	case err != nil || o.fin.Reason == stagepb.FinishReason_FINISH_REASON_UNSPECIFIED:
		o.fin.Reason = stagepb.FinishReason_FINISH_REASON_ERROR
	}
	o.fin.E2E = time.Since(o.start)
	o.obs.ObserveFinished(o.fin)
}

func secondsOf(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// metricsAddr is the metrics address to record: listen, with the host of
// advertised when its own is empty or unspecified ("" when listen is).
func metricsAddr(listen, advertised string) string {
	host, port, err := net.SplitHostPort(listen)
	if listen == "" || err != nil {
		return ""
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		if h, _, err := net.SplitHostPort(advertised); err == nil {
			host = h
		}
	}
	return net.JoinHostPort(host, port)
}
