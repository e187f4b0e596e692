package oip

import (
	"fmt"
	"slices"

	"github.com/troupe-serving/troupe/pkg/oippb"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// The OIP tensor names of the mapping (docs/contracts.md, "Engine protocol
// (--engine oip)").
const (
	TensorText     = "text"      // BYTES [1], UTF-8: text in, new text out
	TensorMessages = "messages"  // BYTES [1]: a chat input as JSON [{"role","content"}]
	TensorContext  = "context"   // BYTES [1]: the input before a fed segment
	TensorTokenIDs = "token_ids" // INT32 [n], in and out
	TensorCodes    = "codes"     // INT32 [n], in and out
	TensorAudio    = "audio"     // INT16 [n]: PCM16 mono, in and out
)

// Parameter names of the mapping: on the audio tensor or the response
// (sample_rate), on a response (the two others).
const (
	ParamSampleRate    = "sample_rate"
	ParamFinalResponse = "triton_final_response"
	ParamFinishReason  = "finish_reason"
	// ParamEnableEmptyFinal, on every request, asks Triton for the final
	// flag even when the model sends it without a response.
	ParamEnableEmptyFinal = "triton_enable_empty_final_response"
)

// standardTypes is the datatype of each tensor name of the mapping, as an
// input and as an output (messages and context are inputs only).
var (
	standardInputs = map[string]string{
		TensorText: typeBytes, TensorMessages: typeBytes, TensorContext: typeBytes,
		TensorTokenIDs: typeInt32, TensorCodes: typeInt32, TensorAudio: typeInt16,
	}
	standardOutputs = map[string]string{
		TensorText: typeBytes, TensorTokenIDs: typeInt32, TensorCodes: typeInt32, TensorAudio: typeInt16,
	}
)

// model is what the worker knows of its OIP model, from ModelMetadata.
type model struct {
	name    string
	inputs  map[string]string // name → datatype
	outputs map[string]string

	role, inputRole string
	// outputTensors and inputTensors are the named tensors beyond the
	// mapping's: the Health fields.
	outputTensors, inputTensors []string
	// skippedInputs and skippedOutputs are tensors outside the mapping of
	// a datatype troupe does not carry: it never sends such an input (the
	// model must take it as optional) and drops such an output.
	skippedInputs, skippedOutputs []string
}

// modelOf reads the roles off a model's metadata: its outputs give the
// role (audio → audio, codes → codes, else text), its inputs the input
// role (audio → audio, codes → codes, a float tensor outside the mapping →
// tensors, else text). A tensor of the mapping with another datatype than
// the mapping's is an error: every request would fail.
func modelOf(md *oippb.ModelMetadataResponse) (*model, error) {
	m := &model{name: md.GetName(), inputs: map[string]string{}, outputs: map[string]string{}}
	floatIn := false
	var others []string
	for _, t := range md.GetInputs() {
		name, dt := t.GetName(), t.GetDatatype()
		m.inputs[name] = dt
		if want, ok := standardInputs[name]; ok {
			if dt != want {
				return nil, fmt.Errorf("input %q is %s; troupe sends it as %s", name, dt, want)
			}
			continue
		}
		if _, ok := typeOfOIP(dt); !ok {
			m.skippedInputs = append(m.skippedInputs, name)
			continue
		}
		floatIn = floatIn || isFloat(dt)
		others = append(others, name)
	}
	for _, t := range md.GetOutputs() {
		name, dt := t.GetName(), t.GetDatatype()
		m.outputs[name] = dt
		if want, ok := standardOutputs[name]; ok {
			if dt != want {
				return nil, fmt.Errorf("output %q is %s; troupe reads it as %s", name, dt, want)
			}
			continue
		}
		if _, ok := typeOfOIP(dt); !ok {
			m.skippedOutputs = append(m.skippedOutputs, name)
			continue
		}
		m.outputTensors = append(m.outputTensors, name)
	}
	switch {
	case m.hasOutput(TensorAudio):
		m.role = stagepb.RoleAudio
	case m.hasOutput(TensorCodes):
		m.role = stagepb.RoleCodes
	default:
		m.role = stagepb.RoleText
	}
	switch {
	case m.hasInput(TensorAudio):
		m.inputRole = stagepb.RoleAudio
	case m.hasInput(TensorCodes):
		m.inputRole = stagepb.RoleCodes
	case floatIn:
		m.inputRole = stagepb.RoleTensors
		m.inputTensors = others
	default:
		m.inputRole = stagepb.RoleText
	}
	return m, nil
}

func (m *model) hasInput(name string) bool  { _, ok := m.inputs[name]; return ok }
func (m *model) hasOutput(name string) bool { _, ok := m.outputs[name]; return ok }

// continues reports whether the model runs a fed input in segments, each
// with the input before it (worker.Continuer): it takes codes or tensors,
// or declares a context input.
func (m *model) continues() bool {
	return m.inputRole == stagepb.RoleCodes || m.inputRole == stagepb.RoleTensors || m.hasInput(TensorContext)
}

// sameRoles reports whether n gives and takes what m does: the stage's
// roles, which the worker fixed when it started.
func (m *model) sameRoles(n *model) bool {
	return m.role == n.role && m.inputRole == n.inputRole &&
		slices.Equal(m.outputTensors, n.outputTensors) && slices.Equal(m.inputTensors, n.inputTensors)
}
