package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/internal/router"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// ErrUnknownReplica: the admin call names no attached replica (404).
var ErrUnknownReplica = errors.New("orchestrator: unknown replica")

// ResolveStage accepts a stage name or index.
func (h *Head) ResolveStage(s string) (int, error) {
	if i := h.cfg.Pipeline.StageIndex(s); i >= 0 {
		return i, nil
	}
	i, err := strconv.Atoi(s)
	if err != nil || i < 0 || i >= len(h.cfg.Pipeline.Stages) {
		return 0, fmt.Errorf("%w: no stage %q", ErrUnknownReplica, s)
	}
	return i, nil
}

// Sleep puts an attached replica to sleep (level 1 or 2). It leaves
// rotation, and its engine_sleep_state follows what the worker reports.
func (h *Head) Sleep(ctx context.Context, stage int, replica uint32, level int) (stagepb.SleepState, error) {
	if _, err := stagepb.SleepStateForLevel(level); err != nil {
		return 0, fmt.Errorf("%w: %w", ErrBadRequest, err)
	}
	rep, ok := h.router.Snapshot().Lookup(router.Key{Stage: stage, Replica: replica})
	if !ok {
		return 0, fmt.Errorf("%w: stage %d replica %d is not attached", ErrUnknownReplica, stage, replica)
	}
	resp, err := rep.Client.Sleep(ctx, &stagepb.SleepRequest{Level: uint32(level)})
	if err != nil {
		return 0, fmt.Errorf("%w: sleep stage %d replica %d: %s", ErrStageFailed, stage, replica, status.Convert(err).Message())
	}
	rep.SetSleepState(resp.GetSleepState())
	if err := h.stats.SetSleepState(rep.EngineIndex, resp.GetSleepState()); err != nil {
		h.log.Warn("orchestrator: sleep state not recorded", "err", err)
	}
	return resp.GetSleepState(), nil
}

// WakeUp wakes a sleeping replica; it rejoins rotation.
func (h *Head) WakeUp(ctx context.Context, stage int, replica uint32) (stagepb.SleepState, error) {
	rep, ok := h.router.Snapshot().Lookup(router.Key{Stage: stage, Replica: replica})
	if !ok {
		return 0, fmt.Errorf("%w: stage %d replica %d is not attached", ErrUnknownReplica, stage, replica)
	}
	resp, err := rep.Client.WakeUp(ctx, &stagepb.WakeUpRequest{})
	if err != nil {
		return 0, fmt.Errorf("%w: wake stage %d replica %d: %s", ErrStageFailed, stage, replica, status.Convert(err).Message())
	}
	if err := h.stats.SetSleepState(rep.EngineIndex, resp.GetSleepState()); err != nil {
		h.log.Warn("orchestrator: sleep state not recorded", "err", err)
	}
	rep.SetSleepState(resp.GetSleepState())
	return resp.GetSleepState(), nil
}
