package stagepb

import (
	"fmt"
	"slices"
)

// Roles say what a stage's engine gives (HealthResponse.role) and takes
// (HealthResponse.input_role). A stage's input role must equal the role of
// the stage before it; the first stage takes text from the client.
const (
	RoleText  = "text"  // text out; as input: text, chat or token_ids
	RoleCodes = "codes" // codec codes
	RoleAudio = "audio" // PCM16 audio out; no engine takes it as input
	// RoleTensors is an input role only: the engine takes the named tensors
	// (HealthResponse.input_tensors) that the stage before gives
	// (output_tensors), worker to worker, beside that stage's role.
	RoleTensors = "tensors"
)

// Roles lists every role, in pipeline order.
var Roles = [...]string{RoleText, RoleCodes, RoleAudio}

// ParseRole returns name when it names a role: text, codes or audio.
func ParseRole(name string) (string, error) {
	if !slices.Contains(Roles[:], name) {
		return "", fmt.Errorf("stagepb: unknown role %q (want text, codes or audio)", name)
	}
	return name, nil
}

// InputRoleOf is what an engine of the given role takes unless it says
// otherwise: codes for audio, text for every other role (the sim's rule).
func InputRoleOf(role string) string {
	if role == RoleAudio {
		return RoleCodes
	}
	return RoleText
}

// EffectiveInputRole is what the engine that reported h takes: its
// input_role, or, for workers that do not report one, InputRoleOf its role.
func (h *HealthResponse) EffectiveInputRole() string {
	if r := h.GetInputRole(); r != "" {
		return r
	}
	return InputRoleOf(h.GetRole())
}

// EffectiveRole is what the engine that reported h gives: its role, text
// when it reports none.
func (h *HealthResponse) EffectiveRole() string {
	if r := h.GetRole(); r != "" {
		return r
	}
	return RoleText
}

// SpeechText is the text a speech stage speaks for r: its text input, or
// the content of the last message of a chat input. ok is false for other
// inputs (token ids, codes, none).
func (r *GenerateRequest) SpeechText() (text string, ok bool) {
	switch in := r.GetInput().(type) {
	case *GenerateRequest_Text:
		return in.Text, true
	case *GenerateRequest_Chat:
		msgs := in.Chat.GetMessages()
		if len(msgs) == 0 {
			return "", true
		}
		return msgs[len(msgs)-1].GetContent(), true
	}
	return "", false
}
