package orchestrator

import (
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// SpeechStages is the first of the stages that turn text into audio, for
// a request that gives that text itself (Request.Speech; the speech
// endpoint): the stage after the last one, before the pipeline's last
// stage, whose routed replicas give text. It is 1 (after the thinker) while
// the head knows no roles yet, and 0 for a one-stage pipeline.
func (h *Head) SpeechStages() int {
	n := len(h.cfg.Pipeline.Stages)
	if n == 1 {
		return 0
	}
	outputs := *h.fleet.outputs.Load()
	for i := n - 2; i >= 0; i-- {
		if outputs[i] == stagepb.RoleText {
			return i + 1
		}
	}
	return 1
}
