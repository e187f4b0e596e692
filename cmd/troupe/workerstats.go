package main

import (
	"fmt"
	"log/slog"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/troupe-serving/troupe/internal/core/stats"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/worker"
)

// workerStats serves a worker's own replica's series on --metrics-listen:
// the head's per-replica families (internal/core/stats, full mode, engine
// index 0), fed by the worker's Generate calls. Its "stage" label is the
// stage name: a worker does not know its stage's index in the pipeline
// (the SD endpoint gives Prometheus the index; docs/stats.md).
type workerStats struct {
	l     *stats.Logger // nil: no --metrics-listen
	stage string
	log   *slog.Logger
}

func newWorkerStats(reg prometheus.Registerer, stage, model string, log *slog.Logger) (*workerStats, error) {
	w := &workerStats{stage: stage, log: log}
	if reg == nil {
		return w, nil
	}
	l, err := stats.New(reg, model, stats.Options{})
	if err != nil {
		return nil, fmt.Errorf("troupe worker: replica series: %w", err)
	}
	w.l = l
	return w, nil
}

// workerModel is the model_name of the worker's series: --model, else
// the engine's name for its model, else the stage name.
func workerModel(flag string, eng worker.Engine, stage string) string {
	if flag != "" {
		return flag
	}
	if n, ok := eng.(interface{ Model() string }); ok && n.Model() != "" {
		return n.Model()
	}
	return stage
}

// bind binds the replica's series (index 0) before the record that makes
// heads route to it is written (with --replica-id auto, once the id is
// known: at registration).
func (w *workerStats) bind(id uint32, h *stagepb.HealthResponse) {
	if w.l == nil {
		return
	}
	err := w.l.Register(0, stats.Replica{
		StageName: w.stage, StageLabel: w.stage, ReplicaID: id,
		NumSpeculativeTokens: int(h.GetNumSpeculativeTokens()), SleepState: h.GetSleepState(),
		Engine: h.GetEngine(), Version: version, Cache: h.GetCacheConfig(),
	})
	if err != nil {
		w.log.Warn("troupe worker: replica series", "err", err)
	}
}

// observer is the worker.Observer that feeds the series; nil without
// --metrics-listen.
func (w *workerStats) observer() worker.Observer {
	if w.l == nil {
		return nil
	}
	return workerObserver{w.l}
}

type workerObserver struct{ l *stats.Logger }

func (o workerObserver) ObserveChunk(s *stagepb.EngineStats) { _ = o.l.Record(0, s) }

func (o workerObserver) ObserveFinished(f worker.Finished) {
	_ = o.l.RecordFinished(0, stats.Finished{
		Reason: f.Reason, PromptTokens: f.PromptTokens, GenerationTokens: f.GenerationTokens,
		PrefillComputedTokens: f.PrefillComputedTokens, TTFT: f.TTFT, E2E: f.E2E,
		InterTokenLatencies: f.InterTokenLatencies, Queue: max(f.Queue, 0), Prefill: max(f.Prefill, 0), Decode: max(f.Decode, 0),
		MaxTokensParam: f.MaxTokensParam, N: 1,
	})
}
