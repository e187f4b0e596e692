package orchestrator

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	grpccodes "google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/internal/core/router"
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

// recordWait bounds how long Sleep and WakeUp wait for the loop to apply
// the worker's changed record.
const recordWait = 5 * time.Second

// Sleep puts an attached replica to sleep (level 1 or 2). The worker
// writes its new state into its member record, and every head, this one
// included, takes the replica out of rotation when its loop applies that
// record; Sleep waits for that here (bounded), so the state the API shows
// next is the one it answers.
func (h *Head) Sleep(ctx context.Context, stage int, replica uint32, level int) (stagepb.SleepState, error) {
	if _, err := stagepb.SleepStateForLevel(level); err != nil {
		return 0, newError(ErrBadRequest, nil, "level must be 1 (offload weights) or 2 (discard all), got %d", level)
	}
	return h.fleet.changeSleep(ctx, router.Key{Stage: stage, Replica: replica}, "sleep", func(c stagepb.StageServiceClient) (stagepb.SleepState, error) {
		resp, err := c.Sleep(ctx, &stagepb.SleepRequest{Level: uint32(level)})
		return resp.GetSleepState(), err
	})
}

// WakeUp wakes a sleeping replica; it rejoins rotation on every head once
// they apply its record (see Sleep).
func (h *Head) WakeUp(ctx context.Context, stage int, replica uint32) (stagepb.SleepState, error) {
	return h.fleet.changeSleep(ctx, router.Key{Stage: stage, Replica: replica}, "wake_up", func(c stagepb.StageServiceClient) (stagepb.SleepState, error) {
		resp, err := c.WakeUp(ctx, &stagepb.WakeUpRequest{})
		return resp.GetSleepState(), err
	})
}

// changeSleep calls the worker, then waits until the loop has applied a
// record of the replica newer than the one before the call, or the
// replica's state already is the answer (a sleep of a sleeping replica
// changes no record). It never sets the state itself: the record is the
// one source every head follows.
func (f *fleet) changeSleep(ctx context.Context, key router.Key, verb string, call func(stagepb.StageServiceClient) (stagepb.SleepState, error)) (stagepb.SleepState, error) {
	rep, ok := f.router.Snapshot().Lookup(key)
	if !ok {
		return 0, newError(ErrUnknownReplica, nil, "stage %d replica %d is not attached", key.Stage, key.Replica)
	}
	before, _ := f.lookup(key)
	st, err := call(rep.Client)
	if err != nil {
		return 0, adminError(fmt.Sprintf("%s of stage %s", verb, f.cfg.Pipeline.Stages[key.Stage].Name), key.Replica, rep.Addr, err)
	}
	wctx, cancel := context.WithTimeout(ctx, recordWait)
	defer cancel()
	for {
		changed := f.changed()
		now, _ := f.lookup(key)
		cur, ok := f.router.Snapshot().Lookup(key)
		if now.modRev > before.modRev || (ok && cur.SleepState() == st) {
			return st, nil
		}
		select {
		case <-changed:
		case <-wctx.Done():
			f.log.Warn("orchestrator: the replica's record has not shown its new sleep state yet; heads route by the record once it arrives",
				"stage", key.Stage, "replica", key.Replica, "sleep_state", st.Name(), "waited", recordWait)
			return st, nil
		}
	}
}

// adminError classifies a replica's answer to Sleep or WakeUp. Two status
// messages are written for the operator and shown (the engines write them
// without addresses): FailedPrecondition, what the replica's state forbids
// now (asleep at another level, requests in flight), is a conflict (409);
// Unimplemented, an engine without sleep mode, says what would give it one
// (502). Everything else is a replica failure as in Execute.
func adminError(what string, replica uint32, addr string, err error) *Error {
	st := status.Convert(err)
	cause := fmt.Errorf("replica %d (%s): %w", replica, addr, err)
	switch st.Code() {
	case grpccodes.FailedPrecondition:
		return newError(ErrConflict, cause, "%s refused by replica %d: %s", what, replica, st.Message())
	case grpccodes.Unimplemented:
		return newError(ErrStageFailed, cause, "%s failed on replica %d: %s", what, replica, st.Message())
	}
	return replicaError(what, replica, addr, err)
}
