package orchestrator

import (
	"fmt"
	"slices"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// stageIO is what a replica's engine takes and gives (Health's input_role
// and role), e.g. text → audio for a speech stage; tensors: it gives named
// tensors too (output_tensors), for a next stage that takes tensors.
type stageIO struct {
	in, out string
	tensors bool
}

func ioOf(h *stagepb.HealthResponse) stageIO {
	return stageIO{in: h.EffectiveInputRole(), out: h.EffectiveRole(), tensors: len(h.GetOutputTensors()) > 0}
}

func (s stageIO) String() string { return s.in + " → " + s.gives() }

// gives is what s gives, e.g. "text and tensors".
func (s stageIO) gives() string {
	if s.tensors {
		return s.out + " and tensors"
	}
	return s.out
}

// feeds reports whether a stage that gives s feeds one that takes in.
func (s stageIO) feeds(in string) bool {
	if in == stagepb.RoleTensors {
		return s.tensors
	}
	return s.out == in
}

// checkRoles decides whether a replica of stage with roles io fits the
// pipeline as the head knows it now, and if not, why. The rules:
//   - the first stage takes text (the client's prompt or conversation) or
//     audio (a speech recognizer: the conversation's audio parts);
//   - every routed replica of the stage has the same roles;
//   - the stage takes what the routed replicas of the stage before give;
//   - the routed replicas of the stage after take what it gives.
//
// Only routed replicas count, so the first replica of each stage sets the
// stage's roles until every replica of the stage has left. A replica being
// checked is never routed itself (a join unroutes it until it attaches),
// and all routed replicas of a stage have the same roles, so it compares
// with each neighbouring stage's roles (routedIO), not with every record:
// a storm of N joins stays O(N) on the loop. It runs on the loop goroutine.
func (f *fleet) checkRoles(key router.Key, io stageIO) string {
	names := f.cfg.Pipeline.StageNames()
	if key.Stage == 0 && io.in != stagepb.RoleText && io.in != stagepb.RoleAudio {
		return fmt.Sprintf("stage %s is the first stage, which takes text from the client, but this replica takes %s (a first stage takes text, or audio for speech recognition)", names[0], io.in)
	}
	routed := func(st int) (stageIO, bool) {
		if st < 0 || st >= len(f.routed.count) || f.routed.count[st] == 0 {
			return stageIO{}, false
		}
		return f.routed.io[st], true
	}
	if o, ok := routed(key.Stage); ok && o != io {
		return fmt.Sprintf("stage %s serves %s, but this replica is %s", names[key.Stage], o, io)
	}
	if o, ok := routed(key.Stage - 1); ok && !o.feeds(io.in) {
		return fmt.Sprintf("this replica takes %s, but stage %s before it gives %s", io.in, names[key.Stage-1], o.gives())
	}
	if o, ok := routed(key.Stage + 1); ok && !io.feeds(o.in) {
		return fmt.Sprintf("this replica gives %s, but stage %s after it takes %s", io.gives(), names[key.Stage+1], o.in)
	}
	return ""
}

// noteRouted keeps the stage outputs to publish (what each stage's routed
// replicas give, "": none routed), and the loop's indexes of routed
// records (routedIO, routedBy), in step with a change of t: it compares
// t.routed with what it counted last (t.noted). It counts the routed
// records of each stage instead of walking every record on each publish,
// which made a storm of N joins O(N²) (BenchmarkFleet). All routed
// replicas of a stage give the same (checkRoles), so the output is the
// latest routed one's. It runs on the loop goroutine; flush publishes the
// outputs.
func (f *fleet) noteRouted(t *tracked) {
	was, is := t.noted, t.routed
	if was == is {
		return
	}
	t.noted = is
	st := t.key.Stage
	if is {
		f.routed.count[st]++
		f.routed.io[st] = t.io
		t.notedInst = t.instance
		if t.instance != "" {
			f.routed.by[t.instance] = t.key
		}
	} else {
		f.routed.count[st]--
		if t.notedInst != "" && f.routed.by[t.notedInst] == t.key {
			delete(f.routed.by, t.notedInst)
		}
	}
	out := f.batch.outs
	if out == nil {
		out = f.outputs.Load()
	}
	want := ""
	if f.routed.count[st] > 0 {
		want = (*out)[st]
		if is {
			want = t.io.out
		}
	}
	if (*out)[st] != want {
		next := slices.Clone(*out)
		next[st] = want
		f.batch.outs = &next
	}
}

// inputKind is the input kind (text or codes) of the stage after one whose
// routed replicas give role: codes for codes, text for text; when the head
// has no role for the stage yet, what it actually produced (codes when it
// made any). A stage that gives audio feeds nothing: the join check keeps
// such a pipeline from forming, and its output is passed as text.
func inputKind(role string, producedCodes bool) string {
	switch role {
	case stagepb.RoleCodes:
		return stagepb.RoleCodes
	case "":
		if producedCodes {
			return stagepb.RoleCodes
		}
	}
	return stagepb.RoleText
}

// nextInput is the request for the stage after one that gave out, by the
// role the stage gives (see inputKind). A stage that gives audio cannot
// feed another stage: an error of the pipeline.
func nextInput(role string, out *stageOutput) (*stagepb.GenerateRequest, error) {
	if role == stagepb.RoleAudio {
		return nil, fmt.Errorf("%w: a stage that gives audio cannot feed another stage", ErrStageFailed)
	}
	if inputKind(role, len(out.codes) > 0) == stagepb.RoleCodes {
		return &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Codes{Codes: &stagepb.Codes{Codes: out.codes}}}, nil
	}
	return &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Text{Text: out.text.String()}}, nil
}
