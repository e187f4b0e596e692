package httpapi

import (
	"encoding/base64"
	"runtime"
	"strings"
	"testing"
	"time"
	"weak"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/realtime"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
)

// recvType reads the next event and requires its type.
func recvType(t *testing.T, conn *realtime.RealtimeConnection, want string) realtime.RealtimeServerEventUnion {
	t.Helper()
	ev, err := conn.Recv(testCtx(t))
	require.NoError(t, err)
	require.Equal(t, want, ev.Type, "%s", ev.RawJSON())
	return ev
}

// recvError reads the next event, requires an error event of code and
// returns its message.
func recvError(t *testing.T, conn *realtime.RealtimeConnection, code string) string {
	t.Helper()
	ev := recvType(t, conn, "error").AsRealtimeErrorEvent()
	assert.Equal(t, code, ev.Error.Code, "%s", ev.RawJSON())
	assert.Equal(t, "invalid_request_error", ev.Error.Type)
	return ev.Error.Message
}

// createItem sends a user text item and returns the ids of the items the
// head deleted to make room for it, and the new item's id.
func createItem(t *testing.T, conn *realtime.RealtimeConnection, text string) (deleted []string, id string) {
	t.Helper()
	require.NoError(t, conn.Send(testCtx(t), realtime.RealtimeClientEventParamOfConversationItemCreate(realtime.RealtimeConversationItemUserMessageParam{
		Content: []realtime.RealtimeConversationItemUserMessageContentParam{{Type: "input_text", Text: openai.String(text)}}})))
	for {
		ev, err := conn.Recv(testCtx(t))
		require.NoError(t, err)
		switch ev.Type {
		case "conversation.item.deleted":
			deleted = append(deleted, ev.AsConversationItemDeletedEvent().ItemID)
		case "conversation.item.added":
			id = ev.AsConversationItemAdded().Item.OfRealtimeConversationItemUserMessage.ID
		case "conversation.item.done":
			return deleted, id
		default:
			t.Fatalf("unexpected event %s", ev.RawJSON())
		}
	}
}

func appendAudio(t *testing.T, conn *realtime.RealtimeConnection, pcm []byte) {
	t.Helper()
	require.NoError(t, conn.Send(testCtx(t), realtime.RealtimeClientEventParamOfInputAudioBufferAppend(base64.StdEncoding.EncodeToString(pcm))))
}

func commitAudio(t *testing.T, conn *realtime.RealtimeConnection) {
	t.Helper()
	require.NoError(t, conn.Send(testCtx(t), realtime.RealtimeClientEventUnionParam{OfInputAudioBufferCommit: &realtime.InputAudioBufferCommitEventParam{}}))
}

// TestRealtimeItemLimits: a session holds at most MaxItems items and
// MaxItemsBytes bytes of them; a new item drops the oldest first, each
// announced with conversation.item.deleted, and the thinker then sees only
// what is left. An item larger than the whole limit is refused
// (item_too_large) and changes nothing; conversation.item.delete frees an
// item. Through the official client.
func TestRealtimeItemLimits(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{})
	a, _ := rtAPI(t, c, Config{Realtime: RealtimeConfig{MaxItems: 3, MaxItemsBytes: 300}})
	conn := connect(t, a)
	sessionUpdate(t, conn, "", "text")
	dropped := func() float64 {
		return testutil.ToFloat64(a.cfg.Metrics.realtime.limitHits.WithLabelValues(limitDropped))
	}

	var ids []string
	for i, text := range []string{"one", "two", "three"} {
		deleted, id := createItem(t, conn, text)
		assert.Empty(t, deleted, "item %d fits", i)
		ids = append(ids, id)
	}
	assert.EqualValues(t, len("onetwothree"), a.MemoryHeld())
	deleted, id := createItem(t, conn, "four")
	assert.Equal(t, []string{ids[0]}, deleted, "a fourth item drops the oldest")
	ids = append(ids[1:], id)
	assert.EqualValues(t, len("twothreefour"), a.MemoryHeld(), "the dropped item's bytes are given back")

	// Bytes: 297 more bytes drop every older item, oldest first.
	big := strings.Repeat("b", 297)
	deleted, id = createItem(t, conn, big)
	assert.Equal(t, ids, deleted)
	assert.EqualValues(t, 297, a.MemoryHeld())
	assert.Equal(t, 4.0, dropped())

	// The thinker sees what is left, as a chat of it would; the answer's
	// item then drops the big one to fit.
	tr := respond(t, conn, nil)
	require.Equal(t, realtime.RealtimeResponseStatus("completed"), tr.done.Response.Status, "%s", tr.done.RawJSON())
	assert.Equal(t, chatText(t, a, openai.UserMessage(big)), tr.text)
	assert.Contains(t, tr.types, "conversation.item.deleted")
	assert.Equal(t, 5.0, dropped())
	answer := tr.done.Response.Output[0].OfRealtimeConversationItemAssistantMessage.ID
	assert.EqualValues(t, len(tr.text), a.MemoryHeld())

	// Larger than a session may hold at all: refused, nothing dropped.
	msg, code := createItemErr(t, conn, strings.Repeat("x", 301))
	assert.Equal(t, codeItemTooLarge, code)
	assert.Contains(t, msg, "--realtime-max-items-bytes")
	assert.EqualValues(t, len(tr.text), a.MemoryHeld())

	// The client deletes an item itself; one it names that is gone is an error.
	require.NoError(t, conn.Send(testCtx(t), realtime.RealtimeClientEventParamOfConversationItemDelete(answer)))
	assert.Equal(t, answer, recvType(t, conn, "conversation.item.deleted").AsConversationItemDeletedEvent().ItemID)
	assert.Zero(t, a.MemoryHeld())
	require.NoError(t, conn.Send(testCtx(t), realtime.RealtimeClientEventParamOfConversationItemDelete(id)))
	recvError(t, conn, "invalid_value")
}

// TestRealtimeInputBufferLimit: an append past MaxInputAudioBytes is an
// error event (input_audio_buffer_full) and leaves the buffer as it was:
// the commit then holds exactly what was appended before.
func TestRealtimeInputBufferLimit(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{})
	a, _ := rtAPI(t, c, Config{Realtime: RealtimeConfig{MaxInputAudioBytes: 4000}})
	conn := connect(t, a)
	sessionUpdate(t, conn, "", "text")
	appendAudio(t, conn, make([]byte, 3000)) // silence: server VAD commits nothing
	appendAudio(t, conn, make([]byte, 2000))
	assert.Contains(t, recvError(t, conn, codeBufferFull), "at most 4000 bytes")
	assert.LessOrEqual(t, a.MemoryHeld(), int64(4000))
	assert.GreaterOrEqual(t, a.MemoryHeld(), int64(3000))
	appendAudio(t, conn, make([]byte, 1000)) // exactly the limit
	commitAudio(t, conn)
	recvType(t, conn, "input_audio_buffer.committed")
	recvType(t, conn, "conversation.item.added")
	recvType(t, conn, "conversation.item.done")
	assert.EqualValues(t, 4000+wavHeaderSize, a.MemoryHeld(), "the item is the buffer's 4000 bytes as WAV; the buffer holds nothing")
	assert.Equal(t, 1.0, testutil.ToFloat64(a.cfg.Metrics.realtime.limitHits.WithLabelValues(limitInputAudio)))
}

// TestRealtimeMemoryBudget: the sessions of a head share one budget; a
// session whose append or item would pass it gets memory_budget_exceeded
// and keeps what it had; what another session gives back (a clear, its
// end) is free again. The head never holds more than the budget.
func TestRealtimeMemoryBudget(t *testing.T) {
	const budget = 64 << 10
	c := startCluster(t, orchestratortest.Options{})
	a, reg := rtAPI(t, c, Config{Realtime: RealtimeConfig{MemoryBudget: budget}})
	first, second := connect(t, a), connect(t, a)
	sessionUpdate(t, first, "", "text")
	sessionUpdate(t, second, "", "text")
	appendAudio(t, first, make([]byte, 40<<10))
	// The append has been handled once the next event is answered.
	require.NoError(t, first.Send(testCtx(t), realtime.RealtimeClientEventParamOfConversationItemCreate(realtime.RealtimeConversationItemUserMessageParam{
		Content: []realtime.RealtimeConversationItemUserMessageContentParam{{Type: "input_text", Text: openai.String("hi")}}})))
	recvType(t, first, "conversation.item.added")
	recvType(t, first, "conversation.item.done")
	assert.EqualValues(t, 40<<10+2, a.MemoryHeld())

	appendAudio(t, second, make([]byte, 30<<10))
	msg := recvError(t, second, codeBudget)
	assert.Contains(t, msg, "--realtime-memory-budget")
	assert.LessOrEqual(t, a.MemoryHeld(), int64(budget))
	_, code := createItemErr(t, second, strings.Repeat("t", 30<<10))
	assert.Equal(t, codeBudget, code)
	commitAudio(t, second)
	recvError(t, second, "input_audio_buffer_commit_empty") // the refused append left the buffer empty

	require.NoError(t, first.Send(testCtx(t), realtime.RealtimeClientEventUnionParam{OfInputAudioBufferClear: &realtime.InputAudioBufferClearEventParam{}}))
	recvType(t, first, "input_audio_buffer.cleared")
	assert.EqualValues(t, 2, a.MemoryHeld())
	appendAudio(t, second, make([]byte, 30<<10))
	commitAudio(t, second)
	recvType(t, second, "input_audio_buffer.committed")
	assert.EqualValues(t, 2+30<<10+wavHeaderSize, a.MemoryHeld())
	assert.Equal(t, 2.0, testutil.ToFloat64(a.cfg.Metrics.realtime.limitHits.WithLabelValues(limitBudget)))
	n, err := testutil.GatherAndCount(reg, "troupe_realtime_buffered_bytes")
	require.NoError(t, err)
	assert.Equal(t, 1, n)
	assert.EqualValues(t, a.MemoryHeld(), testutil.ToFloat64(a.cfg.Metrics.realtime.buffered))
}

// createItemErr sends a user text item that the head refuses and returns
// the error's code.
func createItemErr(t *testing.T, conn *realtime.RealtimeConnection, text string) (string, string) {
	t.Helper()
	require.NoError(t, conn.Send(testCtx(t), realtime.RealtimeClientEventParamOfConversationItemCreate(realtime.RealtimeConversationItemUserMessageParam{
		Content: []realtime.RealtimeConversationItemUserMessageContentParam{{Type: "input_text", Text: openai.String(text)}}})))
	ev := recvType(t, conn, "error").AsRealtimeErrorEvent()
	return ev.Error.Message, ev.Error.Code
}

// TestRealtimeMemoryReleased: once a session has closed, nothing holds
// its conversation: the budget is back at 0 and its audio item, which a
// turn sent through the pipeline, is collected (a weak pointer to its
// WAV is cleared by the collector).
func TestRealtimeMemoryReleased(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{StallTimeout: 2 * time.Second})
	a, _ := rtAPI(t, c, Config{})
	conn := connect(t, a)
	sessionUpdate(t, conn, "", "text")
	appendAudio(t, conn, tone(1000, 0.01)) // 48000 bytes, under server VAD's threshold
	commitAudio(t, conn)
	recvType(t, conn, "input_audio_buffer.committed")
	recvType(t, conn, "conversation.item.added")
	recvType(t, conn, "conversation.item.done")
	tr := respond(t, conn, nil)
	require.Equal(t, realtime.RealtimeResponseStatus("completed"), tr.done.Response.Status, "%s", tr.done.RawJSON())
	appendAudio(t, conn, make([]byte, 10000)) // and a buffer left uncommitted
	sayUser(t, conn, "bye")
	require.Greater(t, a.MemoryHeld(), int64(48000+10000))

	var wav weak.Pointer[byte]
	a.rt.mu.Lock()
	require.Len(t, a.rt.sessions, 1)
	for s := range a.rt.sessions {
		s.mu.Lock()
		wav = weak.Make(&s.items[0].parts[0].Data[0])
		s.mu.Unlock()
	}
	a.rt.mu.Unlock()

	require.NoError(t, conn.Close())
	require.Eventually(t, func() bool { return testutil.ToFloat64(a.cfg.Metrics.realtime.active) == 0 }, wait, time.Millisecond)
	assert.Zero(t, a.MemoryHeld(), "the session gave back all it held")
	assert.Zero(t, testutil.ToFloat64(a.cfg.Metrics.realtime.buffered))
	// A weak pointer is cleared by the first collection that finds its
	// object unreachable. The turn's request stays reachable until its
	// stage attempt's stall timer would have fired (Go keeps a stopped
	// timer's callback, which reaches the attempt, until then): within a
	// stall timeout.
	require.Eventually(t, func() bool {
		runtime.GC()
		return wav.Value() == nil
	}, wait, 50*time.Millisecond, "the closed session's audio item is still reachable")
}
