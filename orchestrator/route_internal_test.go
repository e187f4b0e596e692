package orchestrator

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/internal/core/router"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/tokenizers"
)

func TestRouteOfEachInput(t *testing.T) {
	chat := []*stagepb.ChatMessage{{Role: "system", Content: "s"}, {Role: "user", Content: "u"}}
	r := routeOf(&stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Chat{Chat: &stagepb.Chat{Messages: chat}}}, "k")
	assert.Equal(t, "system: s\nuser: u", r.Text)
	assert.Equal(t, "k", r.SessionKey)

	r = routeOf(&stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Text{Text: "t"}}, "")
	assert.Equal(t, "t", r.Text)

	r = routeOf(&stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_TokenIds{TokenIds: &stagepb.TokenIds{Ids: []uint32{1, 2, 3}}}}, "")
	require.Equal(t, []uint32{1, 2, 3}, r.Tokens)
	assert.Empty(t, r.Text)

	r = routeOf(&stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Codes{Codes: &stagepb.Codes{Codes: []uint32{1}}}}, "")
	assert.Empty(t, r.Text)
	assert.Empty(t, r.Tokens)
}

// A chat's media parts are in its routing key, by the hash of their bytes:
// two requests on the same image share the prefix through it, and the
// routing text is the sim's own (worker/sim TestChatTokensMedia checks the
// sim tokenizes it as it reads the chat).
func TestRouteOfMedia(t *testing.T) {
	img := bytes.Repeat([]byte{3}, 3000)
	chat := func(data []byte, question string) *stagepb.GenerateRequest {
		msgs := []*stagepb.ChatMessage{{Role: "user", Content: question, Parts: []*stagepb.ContentPart{
			{Kind: stagepb.PartImage, Data: data}, {Kind: stagepb.PartText, Text: question}}}}
		return &stagepb.GenerateRequest{Input: &stagepb.GenerateRequest_Chat{Chat: &stagepb.Chat{Messages: msgs}}}
	}
	a := routeOf(chat(img, "what is it"), "").Text
	b := routeOf(chat(bytes.Clone(img), "who made it"), "").Text
	imgWords := tokenizers.MediaText(&stagepb.ContentPart{Kind: stagepb.PartImage, Data: img})
	assert.Equal(t, "user: "+imgWords+" what is it", a)
	assert.Equal(t, tokenizers.ChatText(chat(img, "what is it").GetChat().GetMessages()), a)
	assert.True(t, strings.HasPrefix(b, "user: "+imgWords+" "), "the same image, the same prefix")
	other := bytes.Clone(img)
	other[len(other)-1] = 4
	assert.NotEqual(t, a, routeOf(chat(other, "what is it"), "").Text, "other bytes, another key")
}

func TestPipelineBalance(t *testing.T) {
	p, err := ParsePipeline([]byte(`model: m
stages:
  - name: thinker
    policy: prefix_aware
    balance:
      abs: 4
      replicate_factor: 2
      affinity_load_factor: 1.5
  - name: talker
`))
	require.NoError(t, err)
	b := p.Stages[0].RouterBalance()
	assert.Equal(t, int64(4), b.Abs)
	assert.Equal(t, 2.0, b.ReplicateFactor)
	assert.Equal(t, 1.5, b.AffinityLoadFactor)
	assert.Zero(t, b.Rel, "absent: the default")
	assert.Equal(t, router.DefaultBalanceRel, b.WithDefaults().Rel)
	assert.Equal(t, router.Balance{}, p.Stages[1].RouterBalance())

	_, err = ParsePipeline([]byte("model: m\nstages:\n  - name: thinker\n    balance:\n      rel: 0.5\n"))
	assert.ErrorContains(t, err, "factors must be at least 1")
	_, err = ParsePipeline([]byte("model: m\nstages:\n  - name: thinker\n    balance:\n      relative: 2\n"))
	assert.Error(t, err, "unknown keys are errors")
}

// The pipeline's deadline keys: targets per pipeline and per stage (a
// stage's own first), capacity and admission per deadline stage; and how a
// stage attempt is due from them and the request's own targets.
func TestPipelineDeadline(t *testing.T) {
	p, err := ParsePipeline([]byte(`model: m
deadline:
  ttft: 500ms
  ttfa: 800ms
stages:
  - name: thinker
    policy: deadline
    deadline:
      ttft: 300ms
      capacity: 4
      admission: true
  - name: talker
    policy: deadline
    deadline:
      rtf: 1.5
      model: load
      rtf_window: 2s
`))
	require.NoError(t, err)
	assert.Equal(t, Targets{TTFT: 300 * time.Millisecond, TTFA: 800 * time.Millisecond}, p.targets(0))
	assert.Equal(t, Targets{TTFT: 500 * time.Millisecond, TTFA: 800 * time.Millisecond, RTF: 1.5}, p.targets(1))
	assert.Equal(t, router.DeadlineOptions{Capacity: 4, Admission: true}, p.Stages[0].deadlineOptions())
	assert.Equal(t, router.DeadlineOptions{Model: router.DeadlineModelLoad}, p.Stages[1].deadlineOptions())

	assert.Equal(t, 2*time.Second, p.Stages[1].Deadline.RTFWindow)

	h := &Head{deadline: stageDeadlines{on: []bool{true, true}, admits: []bool{true, false}, targets: []Targets{p.targets(0), p.targets(1)}}}
	at := time.Unix(1000, 0)
	sr := &stageRun{req: Request{Received: at}, stage: 0, n: 2, route: &router.Request{}}
	h.setDeadline(sr)
	assert.Equal(t, at.Add(300*time.Millisecond), sr.route.Deadline, "stage 0: first text, the stage's ttft")
	assert.Zero(t, sr.route.MinRTF)
	require.NotNil(t, sr.gate, "stage 0 admits: its first text is gated at the target")
	assert.Equal(t, at.Add(300*time.Millisecond), sr.gate.due)
	sr = &stageRun{req: Request{Received: at, Deadline: Targets{TTFA: 2 * time.Second}}, stage: 1, route: &router.Request{}}
	h.setDeadline(sr)
	assert.Equal(t, at.Add(2*time.Second), sr.route.Deadline, "a later stage: first audio, the request's ttfa first")
	assert.Equal(t, 1.5, sr.route.MinRTF)
	assert.Nil(t, sr.gate, "stage 1 does not admit")

	_, err = ParsePipeline([]byte("model: m\nstages:\n  - name: thinker\n    policy: least_loaded\n    deadline:\n      admission: true\n"))
	assert.ErrorContains(t, err, "policy deadline only")
	_, err = ParsePipeline([]byte("model: m\nstages:\n  - name: thinker\n    policy: least_loaded\n    deadline:\n      model: load\n"))
	assert.ErrorContains(t, err, "policy deadline only")
	_, err = ParsePipeline([]byte("model: m\nstages:\n  - name: thinker\n    policy: deadline\n    deadline:\n      model: psychic\n"))
	assert.ErrorContains(t, err, "unknown deadline model")
	_, err = ParsePipeline([]byte("model: m\ndeadline:\n  capacity: 3\nstages:\n  - name: thinker\n"))
	assert.ErrorContains(t, err, "per stage")
	_, err = ParsePipeline([]byte("model: m\nstages:\n  - name: thinker\n    deadline:\n      ttfb: 1s\n"))
	assert.Error(t, err, "unknown keys are errors")
}

func TestParseTargets(t *testing.T) {
	got, err := ParseTargets(" ttfa=800ms, ttft=500ms,rtf=1.2")
	require.NoError(t, err)
	assert.Equal(t, Targets{TTFT: 500 * time.Millisecond, TTFA: 800 * time.Millisecond, RTF: 1.2}, got)
	for _, bad := range []string{"", "ttft", "ttft=0s", "ttft=5", "rtf=-1", "rtf=NaN", "ttfa=1s,ttfa=2s", "e2e=1s"} {
		_, err := ParseTargets(bad)
		assert.Error(t, err, "%q", bad)
	}
}
