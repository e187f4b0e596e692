package stagepb

import (
	"errors"
	"strconv"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// How a replica refuses input, as both ends read it:
//
//   - Generate answers InvalidArgument for input the engine will not run,
//     and FailedPrecondition when the engine cannot run anything now (it
//     is asleep). These two status messages are written for the API
//     client, who sees them: no package prefix, no address, no Go type
//     names. Other codes' messages are for logs only.
//   - A refusal with a machine-readable cause carries a google.rpc.ErrorInfo
//     detail with Domain ErrorDomain and one of the Reason constants; the
//     head maps the reason to an OpenAI error code without reading the text.

// ErrorDomain is the ErrorInfo domain of troupe's error reasons.
const ErrorDomain = "troupe.stage"

// ReasonContextLengthExceeded: prompt plus the requested output do not fit
// the engine's context (its max model length). The head answers 400
// context_length_exceeded. ErrorInfo metadata: "max_model_len",
// "prompt_tokens", "requested_tokens" (decimal).
const ReasonContextLengthExceeded = "CONTEXT_LENGTH_EXCEEDED"

// ContextLengthError is the refusal of an input longer than maxModelLen
// tokens: InvalidArgument with an ErrorInfo of ReasonContextLengthExceeded.
// requested is the prompt plus the output the request may generate.
func ContextLengthError(maxModelLen, promptTokens, requested int) error {
	st := status.Newf(codes.InvalidArgument,
		"This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the prompt, %d in the completion). Please reduce the length of the prompt or of the completion (max_tokens).",
		maxModelLen, requested, promptTokens, requested-promptTokens)
	return withReason(st, ReasonContextLengthExceeded, map[string]string{
		"max_model_len":    strconv.Itoa(maxModelLen),
		"prompt_tokens":    strconv.Itoa(promptTokens),
		"requested_tokens": strconv.Itoa(requested),
	})
}

// withReason is st's error with an ErrorInfo of ErrorDomain, reason and
// metadata (nil: none).
func withReason(st *status.Status, reason string, metadata map[string]string) error {
	withInfo, err := st.WithDetails(&errdetails.ErrorInfo{Reason: reason, Domain: ErrorDomain, Metadata: metadata})
	if err != nil { // only for a detail that cannot be marshalled
		return st.Err()
	}
	return withInfo.Err()
}

// ReasonInvalidVoice: the request's voice (audio.voice) is not one the
// engine has. The head answers 400 invalid_value with param audio.voice.
const ReasonInvalidVoice = "INVALID_VOICE"

// InvalidVoiceError is the refusal of a voice the engine does not have:
// InvalidArgument with an ErrorInfo of ReasonInvalidVoice. message is
// written for the API client.
func InvalidVoiceError(message string) error {
	return withReason(status.New(codes.InvalidArgument, message), ReasonInvalidVoice, nil)
}

// ReasonDraining: the replica is draining (it finishes what it runs and
// takes nothing new) and refused the call before running any of it. The
// head tries another replica without counting the refusal as an attempt
// or as the replica's fault: during a rollout many replicas refuse before
// the heads learn that they drain.
const ReasonDraining = "DRAINING"

// DrainingError is a draining replica's refusal of a new call:
// Unavailable with an ErrorInfo of ReasonDraining. message is for logs.
func DrainingError(message string) error {
	return withReason(status.New(codes.Unavailable, message), ReasonDraining, nil)
}

// ErrorReason is the troupe reason an error's status carries (an ErrorInfo
// detail of ErrorDomain), or "" when it carries none.
func ErrorReason(err error) string {
	var se interface{ GRPCStatus() *status.Status }
	if !errors.As(err, &se) {
		return ""
	}
	for _, d := range se.GRPCStatus().Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && info.GetDomain() == ErrorDomain {
			return info.GetReason()
		}
	}
	return ""
}
