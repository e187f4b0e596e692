package orchestrator

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/troupe-serving/troupe/internal/router"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// ResolveStage accepts a stage name or index.
func (h *Head) ResolveStage(s string) (int, error) {
	if i := h.cfg.Pipeline.StageIndex(s); i >= 0 {
		return i, nil
	}
	i, err := strconv.Atoi(s)
	if err != nil || i < 0 || i >= len(h.cfg.Pipeline.Stages) {
		return 0, newError(ErrUnknownReplica, nil, "no stage %q: stages are %s (or their indexes 0..%d)", s, strings.Join(h.cfg.Pipeline.StageNames(), ", "), len(h.cfg.Pipeline.Stages)-1)
	}
	return i, nil
}

// Sleep puts an attached replica to sleep (level 1 or 2). It leaves
// rotation, and its engine_sleep_state follows what the worker reports.
func (h *Head) Sleep(ctx context.Context, stage int, replica uint32, level int) (stagepb.SleepState, error) {
	if _, err := stagepb.SleepStateForLevel(level); err != nil {
		return 0, newError(ErrBadRequest, nil, "level must be 1 (offload weights) or 2 (discard all), got %d", level)
	}
	rep, ok := h.router.Snapshot().Lookup(router.Key{Stage: stage, Replica: replica})
	if !ok {
		return 0, newError(ErrUnknownReplica, nil, "stage %d replica %d is not attached", stage, replica)
	}
	resp, err := rep.Client.Sleep(ctx, &stagepb.SleepRequest{Level: uint32(level)})
	if err != nil {
		return 0, replicaError(fmt.Sprintf("sleep of stage %d", stage), replica, rep.Addr, err)
	}
	rep.SetSleepState(resp.GetSleepState())
	if resp.GetSleepState() == stagepb.SleepState_SLEEP_STATE_DISCARD_ALL {
		h.router.Forget(rep.Key) // its cache is gone
	}
	if err := h.stats.SetSleepState(rep.EngineIndex, resp.GetSleepState()); err != nil {
		h.log.Warn("orchestrator: sleep state not recorded", "err", err)
	}
	return resp.GetSleepState(), nil
}

// WakeUp wakes a sleeping replica; it rejoins rotation.
func (h *Head) WakeUp(ctx context.Context, stage int, replica uint32) (stagepb.SleepState, error) {
	rep, ok := h.router.Snapshot().Lookup(router.Key{Stage: stage, Replica: replica})
	if !ok {
		return 0, newError(ErrUnknownReplica, nil, "stage %d replica %d is not attached", stage, replica)
	}
	resp, err := rep.Client.WakeUp(ctx, &stagepb.WakeUpRequest{})
	if err != nil {
		return 0, replicaError(fmt.Sprintf("wake_up of stage %d", stage), replica, rep.Addr, err)
	}
	if err := h.stats.SetSleepState(rep.EngineIndex, resp.GetSleepState()); err != nil {
		h.log.Warn("orchestrator: sleep state not recorded", "err", err)
	}
	rep.SetSleepState(resp.GetSleepState())
	return resp.GetSleepState(), nil
}
