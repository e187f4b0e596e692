package router

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// chatText renders a conversation as tokenizers.ChatText does.
func chatText(system string, turns ...string) string {
	lines := []string{"system: " + system}
	for i, t := range turns {
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		lines = append(lines, role+": "+t)
	}
	return strings.Join(lines, "\n")
}

func TestConversationKey(t *testing.T) {
	sys := strings.Repeat("a shared system prompt. ", 30)
	k2, ok := conversationKey(chatText(sys, "first question", "an answer"))
	require.True(t, ok)
	k3, ok := conversationKey(chatText(sys, "first question", "an answer", "a follow-up"))
	require.True(t, ok)
	assert.Equal(t, k2, k3, "every later turn of one conversation has its key")
	other, ok := conversationKey(chatText(sys, "another first question", "an answer"))
	require.True(t, ok)
	assert.NotEqual(t, k2, other, "conversations that share only the system prompt differ")
	u, ok := conversationKey("user: hello\nassistant: hi\nuser: more")
	require.True(t, ok)
	v, _ := conversationKey("user: hello\nassistant: hi there\nuser: other")
	assert.Equal(t, u, v)

	for _, text := range []string{
		"",
		chatText(sys, "a first turn goes with its system prompt's users"),
		sys + "user: not a rendered chat\nassistant: no",
		"system: only a system prompt\nassistant: and an answer",
	} {
		_, ok := conversationKey(text)
		assert.False(t, ok, "%.40q", text)
	}
}

// headsSim routes a multi-turn chat workload through heads prefix_aware
// policies in the head-side mode, each with its own replicas of the same
// keys (as each head's router has), turn i through head i%heads as a
// round-robin balancer sends them, one every 25 ms; each turn is the next
// of a conversation drawn at random (seeded), and runs for the next 12
// picks; every head reads the same reported load (the engine's running
// count). It returns each turn's replica id, in order, how many turns went
// where the conversation's previous turn went, and the requests each
// replica served.
func headsSim(t *testing.T, heads, conversations, turns int, window time.Duration, render func(string, ...string) string) (picks []uint32, stayed int, served map[uint32]int) {
	return headsSimRouted(t, heads, conversations, turns, window, render, false)
}

// headsSimRouted is headsSim; with routed, every replica's worker shares
// the blocks heads route to it (EngineInfo.RoutedSubscription): each
// pick's RoutedBlocks reach every head's index (ApplyRoutedBlocks), as the
// worker's routed-block reports bring them.
func headsSimRouted(t *testing.T, heads, conversations, turns int, window time.Duration, render func(string, ...string) string, routed bool) (picks []uint32, stayed int, served map[uint32]int) {
	t.Helper()
	const n = 4
	ps := make([]*PrefixAware, heads)
	cs := make([][]*Replica, heads)
	var now int64 // a request every 25 ms
	for h := range heads {
		ps[h] = NewPrefixAware(PolicyOptions{PrefixSource: PrefixSourceHead})
		ps[h].HomeLoadWindow = window
		ps[h].clock = func() int64 { return now }
		cs[h] = replicas(n)
		for _, r := range cs[h] {
			r.Engine.RoutedSubscription = routed
		}
	}
	systems := []string{
		strings.Repeat("system prompt zero, the popular one. ", 30),
		strings.Repeat("system prompt one. ", 40),
		strings.Repeat("system prompt two. ", 40),
	}
	history := make([][]string, conversations)
	running := map[uint32]int64{}
	var queue []uint32
	served = map[uint32]int{}
	last := map[int]uint32{}
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range conversations * turns {
		c := rng.IntN(conversations)
		history[c] = append(history[c], fmt.Sprintf("conversation %d asks question %d", c, len(history[c])/2))
		sys := systems[0] // half the conversations share one system prompt
		if c%2 == 1 {
			sys = systems[1+c/2%2]
		}
		h := i % heads
		now += int64(25 * time.Millisecond)
		d := ps[h].Pick(&Request{Text: render(sys, history[c]...)}, cs[h])
		id := d.Replica.Key.Replica
		if routed {
			require.NotEmpty(t, d.RoutedBlocks, "a head-side pick's blocks go with the request")
			for g := range heads {
				ps[g].ApplyRoutedBlocks(cs[g][id], &stagepb.KvEvents{Stored: d.RoutedBlocks, Routed: true})
			}
		} else {
			require.Empty(t, d.RoutedBlocks, "a worker that does not share them gets none")
		}
		history[c] = append(history[c], fmt.Sprintf("answer %d", len(history[c])))
		picks = append(picks, id)
		if prev, ok := last[c]; ok && prev == id {
			stayed++
		}
		last[c] = id
		served[id]++
		running[id]++
		queue = append(queue, id)
		if len(queue) > 12 {
			running[queue[0]]--
			queue = queue[1:]
		}
		for _, rs := range cs {
			for _, r := range rs {
				r.SetLoad(running[r.Key.Replica])
			}
		}
	}
	return picks, stayed, served
}

// In the head-side mode, where a chat goes hardly depends on which head
// routes it: 3 heads behind a round-robin balancer, each holding only the
// turns it routed, keep a conversation where its previous turn went about
// as often as one head does (far more often than when each head follows
// its own index), and every replica takes a share with a hot system
// prompt.
func TestPrefixAwareHeadsAgreeOnConversations(t *testing.T) {
	const conversations, turns = 40, 12
	later := float64(conversations*turns - conversations)
	for _, heads := range []int{1, 3} {
		_, stayed, served := headsSim(t, heads, conversations, turns, DefaultHomeLoadWindow, chatText)
		t.Logf("%d heads: %.1f%% of later turns where the previous went; served %v", heads, 100*float64(stayed)/later, served)
		assert.Greater(t, float64(stayed), 0.8*later, "%d heads: turns on their previous turn's replica", heads)
		// No replica is starved (BenchmarkRouting measures the balance
		// target under a realistic load; this model's loads are coarse).
		for id := range uint32(4) {
			assert.GreaterOrEqual(t, float64(served[id]), 0.6*float64(conversations*turns)/4, "%d heads: served: %v", heads, served)
		}
	}
	// The same inputs not rendered as a chat are matched on each head's
	// own index, which holds a third of each conversation: the heads
	// disagree and conversations move far more often.
	flat := func(system string, turns ...string) string {
		return strings.ReplaceAll(chatText(system, turns...), "\n", " ")
	}
	_, stayed, _ := headsSim(t, 3, conversations, turns, DefaultHomeLoadWindow, flat)
	t.Logf("3 heads, each on its own index: %.1f%%", 100*float64(stayed)/later)
	assert.Less(t, float64(stayed), 0.75*later)
}

// With routed-block reports every head's index holds every head's picks:
// 3 heads keep a conversation where its previous turn went about as often
// as one head does, chats and flat prompts alike (no conversation home),
// far more often than flat prompts on each head's own index, and every
// replica takes a share.
func TestPrefixAwareHeadsShareRoutedBlocks(t *testing.T) {
	const conversations, turns = 40, 12
	later := float64(conversations*turns - conversations)
	flat := func(system string, turns ...string) string {
		return strings.ReplaceAll(chatText(system, turns...), "\n", " ")
	}
	for _, render := range []func(string, ...string) string{chatText, flat} {
		_, one, _ := headsSimRouted(t, 1, conversations, turns, DefaultHomeLoadWindow, render, true)
		_, three, served := headsSimRouted(t, 3, conversations, turns, DefaultHomeLoadWindow, render, true)
		t.Logf("later turns where the previous went: 1 head %.1f%%, 3 heads %.1f%%; served %v", 100*float64(one)/later, 100*float64(three)/later, served)
		assert.Greater(t, float64(three), float64(one)-0.1*later, "3 heads about as one")
		if strings.Contains(render("s", "q"), "\n") {
			continue // a chat without reports goes home (step 6): compared above
		}
		_, apart, _ := headsSim(t, 3, conversations, turns, DefaultHomeLoadWindow, render)
		assert.Greater(t, float64(three), float64(apart)+0.05*later, "3 heads sharing their picks against each on its own index (%d)", apart)
		for id := range uint32(4) {
			assert.GreaterOrEqual(t, float64(served[id]), 0.6*float64(conversations*turns)/4, "served: %v", served)
		}
	}
}

// A conversation's home follows the smoothed load: a momentary spike on it
// moves nothing, a lasting one moves the conversation to its next replica
// in rendezvous order, the same on every head.
func TestPrefixAwareHomeFollowsSmoothedLoad(t *testing.T) {
	text := chatText(strings.Repeat("a system prompt. ", 30), "a question", "an answer", "another")
	c := replicas(4)
	for _, r := range c {
		r.SetLoad(2)
	}
	p := NewPrefixAware(PolicyOptions{PrefixSource: PrefixSourceHead})
	p.HomeLoadWindow = time.Hour
	home := p.Pick(&Request{Text: text}, c).Replica
	home.SetLoad(7)
	assert.Same(t, home, p.Pick(&Request{Text: text}, c).Replica, "a spike is smoothed away")

	// No smoothing: the spike is the load, and each head moves the
	// conversation to the same next replica.
	var next *Replica
	for range 3 {
		q := NewPrefixAware(PolicyOptions{PrefixSource: PrefixSourceHead})
		q.HomeLoadWindow = time.Nanosecond
		d := q.Pick(&Request{Text: text}, c)
		assert.NotSame(t, home, d.Replica)
		if next == nil {
			next = d.Replica
		}
		assert.Same(t, next, d.Replica)
	}
}
