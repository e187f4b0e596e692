package stagepb

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestContextLengthError(t *testing.T) {
	err := ContextLengthError(100, 90, 120)
	assert.Equal(t, codes.InvalidArgument, status.Code(err))
	assert.Equal(t, ReasonContextLengthExceeded, ErrorReason(err))
	assert.Equal(t, ReasonContextLengthExceeded, ErrorReason(fmt.Errorf("wrapped: %w", err)))
	assert.Contains(t, status.Convert(err).Message(), "maximum context length is 100 tokens. However, you requested 120 tokens (90 in the prompt, 30 in the completion)")
	info := status.Convert(err).Details()[0].(*errdetails.ErrorInfo)
	assert.Equal(t, map[string]string{"max_model_len": "100", "prompt_tokens": "90", "requested_tokens": "120"}, info.GetMetadata())

	// A reason is read from troupe's domain only, and never from text.
	assert.Empty(t, ErrorReason(nil))
	assert.Empty(t, ErrorReason(errors.New("CONTEXT_LENGTH_EXCEEDED")))
	assert.Empty(t, ErrorReason(status.Error(codes.InvalidArgument, "CONTEXT_LENGTH_EXCEEDED")))
	other, err2 := status.New(codes.InvalidArgument, "x").WithDetails(&errdetails.ErrorInfo{Reason: ReasonContextLengthExceeded, Domain: "example.com"})
	assert.NoError(t, err2)
	assert.Empty(t, ErrorReason(other.Err()))
}
