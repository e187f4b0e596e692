package stagepb

import (
	"fmt"
	"time"
)

// The protocol's vocabulary: the names troupe uses for enum values in
// metric labels, API answers and logs, and the limits both ends enforce.
// This file is the one owner of these facts; generated code is next to it.

// MaxSpeculativeTokens bounds num_speculative_tokens (K) in a membership
// record and in Health, and with it the spec-decode position series.
const MaxSpeculativeTokens = 64

// MaxHeldOutput is the longest a worker holds output
// (GenerateRequest.hold_output_ms, output_codes_per_chunk) before it sends
// what it has: a head whose stall timeout is shorter does not ask for
// held codes.
const MaxHeldOutput = time.Second

// Segment sizes of GenerateStream when StreamInput.segment_units is 0 (a
// stage without input_chunk): a talker starts after a few words, a vocoder
// after 400 ms of codes. The worker cuts segments by them; the head sizes
// output_codes_per_chunk by them.
const (
	DefaultSegmentWords = 8
	DefaultSegmentCodes = 10
)

// SleepStates lists every sleep state in label order (the value is the
// index).
var SleepStates = [...]SleepState{
	SleepState_SLEEP_STATE_AWAKE,
	SleepState_SLEEP_STATE_WEIGHTS_OFFLOADED,
	SleepState_SLEEP_STATE_DISCARD_ALL,
}

// Name is the state's label value (engine_sleep_state{sleep_state}) and its
// name in the HTTP API: awake, weights_offloaded or discard_all. An unknown
// value is named "unknown".
func (s SleepState) Name() string {
	switch s {
	case SleepState_SLEEP_STATE_AWAKE:
		return "awake"
	case SleepState_SLEEP_STATE_WEIGHTS_OFFLOADED:
		return "weights_offloaded"
	case SleepState_SLEEP_STATE_DISCARD_ALL:
		return "discard_all"
	}
	return "unknown"
}

// ParseSleepState is the inverse of Name: the state named awake,
// weights_offloaded or discard_all.
func ParseSleepState(name string) (SleepState, error) {
	for _, s := range SleepStates {
		if s.Name() == name {
			return s, nil
		}
	}
	return 0, fmt.Errorf("stagepb: unknown sleep state %q (want awake, weights_offloaded or discard_all)", name)
}

// Sleep levels, as vLLM's sleep mode numbers them.
const (
	// SleepLevelOffload offloads the weights and keeps the prefix cache.
	SleepLevelOffload = 1
	// SleepLevelDiscard discards the weights and the cache.
	SleepLevelDiscard = 2
)

// SleepStateForLevel is the state a sleep at level ends in. Levels other
// than 1 and 2 are an error whose text says which levels exist.
func SleepStateForLevel(level int) (SleepState, error) {
	switch level {
	case SleepLevelOffload:
		return SleepState_SLEEP_STATE_WEIGHTS_OFFLOADED, nil
	case SleepLevelDiscard:
		return SleepState_SLEEP_STATE_DISCARD_ALL, nil
	}
	return 0, fmt.Errorf("stagepb: sleep level must be 1 (offload weights) or 2 (discard all), got %d", level)
}

// FinishReasons lists every finish reason a finished request can have, in
// label order.
var FinishReasons = [...]FinishReason{
	FinishReason_FINISH_REASON_STOP,
	FinishReason_FINISH_REASON_LENGTH,
	FinishReason_FINISH_REASON_ABORT,
	FinishReason_FINISH_REASON_ERROR,
}

// Name is the reason's label value (request_success{finished_reason}) and
// its OpenAI finish_reason: stop, length, abort or error. Unspecified and
// unknown values are "error": a request that ends without a reason failed.
func (r FinishReason) Name() string {
	switch r {
	case FinishReason_FINISH_REASON_STOP:
		return "stop"
	case FinishReason_FINISH_REASON_LENGTH:
		return "length"
	case FinishReason_FINISH_REASON_ABORT:
		return "abort"
	}
	return "error"
}

// The size limits of a request, from the head's HTTP body to the gRPC
// messages between head and replicas: the one place their defaults are
// written, below every package that applies them. gRPC's own default (4
// MiB received) is below the head's default HTTP body limit, so both ends
// set theirs from these.
const (
	// DefaultMaxBodyBytes is the head's default HTTP body limit (troupe
	// head --max-body-bytes, httpapi.Config.MaxBodyBytes), and so the
	// largest prompt by default.
	DefaultMaxBodyBytes = 16 << 20
	// MessageHeadroom is what a Generate request needs beyond its prompt
	// (request id, sampling parameters); a limit derived from an HTTP body
	// limit adds it.
	MessageHeadroom = 1 << 20
	// DefaultMaxMessageBytes is both ends' default: a prompt as large as
	// the head's default body limit, plus headroom.
	DefaultMaxMessageBytes = DefaultMaxBodyBytes + MessageHeadroom
)
