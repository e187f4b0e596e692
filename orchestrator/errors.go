package orchestrator

import (
	"errors"
	"fmt"

	grpccodes "google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// Kinds of failure the HTTP layer maps to status codes. Execute, Sleep,
// WakeUp and ResolveStage return an *Error whose Kind is one of them, so
// errors.Is works on the returned error.
var (
	// ErrNoReplica: a needed stage has no routable replica (503).
	ErrNoReplica = router.ErrNoReplica
	// ErrStageFailed: a replica failed and the request could not be
	// completed (502).
	ErrStageFailed = errors.New("orchestrator: stage failed")
	// ErrBadRequest: a replica refused the input as invalid (400).
	ErrBadRequest = errors.New("orchestrator: invalid request")
	// ErrInputTooLarge: the input is larger than the gRPC message limit
	// toward the replicas (413).
	ErrInputTooLarge = errors.New("orchestrator: input too large")
	// ErrUnknownReplica: the admin call names no attached replica (404).
	ErrUnknownReplica = errors.New("orchestrator: unknown replica")
	// ErrConflict: an admin call asks for what the replica's state
	// forbids, e.g. a sleep at another level than the one it sleeps at
	// (409); the replica's message says what to do first.
	ErrConflict = errors.New("orchestrator: conflict")
)

// AsleepError is the cause of an ErrNoReplica whose stage has replicas,
// every one asleep: no retry helps until one is woken (errors.As finds it
// in an *Error).
type AsleepError = router.AsleepError

// Error is a failure of the head as Execute and the admin calls report it.
// Its two texts have two readers: Error() is for the head's log and may
// name a replica's address and the gRPC status; Message is for the API
// client and never carries an address, a Go package prefix or a type name.
type Error struct {
	Kind    error  // one of the Err* kinds above
	Message string // for the client
	// Reason is the replica's machine-readable cause (stagepb.Reason*, e.g.
	// stagepb.ReasonContextLengthExceeded), or "".
	Reason string
	Cause  error // what happened underneath, for the log; may be nil
}

func (e *Error) Error() string {
	if e.Cause == nil {
		return e.Kind.Error() + ": " + e.Message
	}
	return e.Kind.Error() + ": " + e.Message + ": " + e.Cause.Error()
}

// Unwrap exposes the kind and the cause to errors.Is and errors.As.
func (e *Error) Unwrap() []error {
	if e.Cause == nil {
		return []error{e.Kind}
	}
	return []error{e.Kind, e.Cause}
}

func newError(kind error, cause error, format string, args ...any) *Error {
	return &Error{Kind: kind, Message: fmt.Sprintf(format, args...), Cause: cause}
}

// replicaError classifies a replica's gRPC error for a call described by
// what (e.g. `stage "thinker"`). InvalidArgument is a refusal of the input:
// its status message is written for the client (stagepb's rules) and is
// passed on as is. Any other status is a failure whose message is not
// shown, since transport errors name addresses.
func replicaError(what string, replica uint32, addr string, err error) *Error {
	st := status.Convert(err)
	cause := fmt.Errorf("replica %d (%s): %w", replica, addr, err)
	switch st.Code() {
	case grpccodes.InvalidArgument:
		return &Error{Kind: ErrBadRequest, Message: st.Message(), Reason: stagepb.ErrorReason(err), Cause: cause}
	case grpccodes.FailedPrecondition:
		// The engine's own words (asleep, busy); engines write them.
		return newError(ErrStageFailed, cause, "%s failed on replica %d: %s", what, replica, st.Message())
	default:
		return newError(ErrStageFailed, cause, "%s failed on replica %d (%s)", what, replica, st.Code())
	}
}
