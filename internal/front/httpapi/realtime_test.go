package httpapi

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/coder/websocket"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/realtime"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"

	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/tokenizers"
	"github.com/troupe-serving/troupe/worker/sim"
)

// rtAPI is an API whose HTTP metrics (realtime ones included) are on reg.
func rtAPI(t *testing.T, c *orchestratortest.Cluster, cfg Config) (*api, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg)
	require.NoError(t, err)
	cfg.Metrics = m
	return startAPI(t, c, cfg, nil, nil), reg
}

// connect opens a realtime session with the official client and reads its
// session.created.
func connect(t *testing.T, a *api) *realtime.RealtimeConnection {
	t.Helper()
	client := a.openai()
	conn, err := client.Realtime.Connect(testCtx(t), realtime.RealtimeConnectionOptions{})
	require.NoError(t, err)
	t.Cleanup(conn.Abort)
	ev, err := conn.Recv(testCtx(t))
	require.NoError(t, err)
	require.Equal(t, "session.created", ev.Type)
	return conn
}

func sessionUpdate(t *testing.T, conn *realtime.RealtimeConnection, instructions, modality string) {
	t.Helper()
	require.NoError(t, conn.Send(testCtx(t), realtime.RealtimeClientEventParamOfSessionUpdate(realtime.RealtimeSessionCreateRequestParam{
		Instructions: openai.String(instructions), OutputModalities: []string{modality}})))
	ev, err := conn.Recv(testCtx(t))
	require.NoError(t, err)
	require.Equal(t, "session.updated", ev.Type, "%s", ev.RawJSON())
	assert.Contains(t, ev.RawJSON(), `"output_modalities":["`+modality+`"]`)
}

func sayUser(t *testing.T, conn *realtime.RealtimeConnection, text string) {
	t.Helper()
	require.NoError(t, conn.Send(testCtx(t), realtime.RealtimeClientEventParamOfConversationItemCreate(realtime.RealtimeConversationItemUserMessageParam{
		Content: []realtime.RealtimeConversationItemUserMessageContentParam{{Type: "input_text", Text: openai.String(text)}}})))
	for _, want := range []string{"conversation.item.added", "conversation.item.done"} {
		ev, err := conn.Recv(testCtx(t))
		require.NoError(t, err)
		require.Equal(t, want, ev.Type, "%s", ev.RawJSON())
	}
}

// turn is what a response sent.
type turn struct {
	text, transcript string
	audio            []byte
	done             realtime.ResponseDoneEvent
	types            []string
}

// respond sends response.create and reads until response.done; onEvent,
// when not nil, sees every event first.
func respond(t *testing.T, conn *realtime.RealtimeConnection, onEvent func(realtime.RealtimeServerEventUnion)) turn {
	t.Helper()
	require.NoError(t, conn.Send(testCtx(t), realtime.RealtimeClientEventUnionParam{OfResponseCreate: &realtime.ResponseCreateEventParam{}}))
	var tr turn
	var text, transcript strings.Builder
	for {
		ev, err := conn.Recv(testCtx(t))
		require.NoError(t, err)
		if onEvent != nil {
			onEvent(ev)
		}
		tr.types = append(tr.types, ev.Type)
		switch ev.Type {
		case "response.output_text.delta":
			text.WriteString(ev.AsResponseTextDeltaEvent().Delta)
		case "response.output_audio_transcript.delta":
			transcript.WriteString(ev.AsResponseAudioTranscriptDeltaEvent().Delta)
		case "response.output_audio.delta":
			pcm, err := base64.StdEncoding.DecodeString(ev.AsResponseAudioDeltaEvent().Delta)
			require.NoError(t, err)
			tr.audio = append(tr.audio, pcm...)
		case "error":
			t.Fatalf("error event: %s", ev.RawJSON())
		case "response.done":
			tr.text, tr.transcript, tr.done = text.String(), transcript.String(), ev.AsResponseDoneEvent()
			return tr
		}
	}
}

// chatText is what a chat request with msgs answers.
func chatText(t *testing.T, a *api, msgs ...openai.ChatCompletionMessageParamUnion) string {
	t.Helper()
	client := a.openai()
	res, err := client.Chat.Completions.New(testCtx(t), openai.ChatCompletionNewParams{Model: a.cluster.Head.Pipeline().Model, Messages: msgs})
	require.NoError(t, err)
	return res.Choices[0].Message.Content
}

// TestRealtimeAudioTurn: a text turn answered in audio runs every stage,
// streams PCM16 and the transcript, which is what a chat request with the
// same conversation answers, in GA event order.
func TestRealtimeAudioTurn(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{})
	a, reg := rtAPI(t, c, Config{})
	conn := connect(t, a)
	sessionUpdate(t, conn, "Be brief.", "audio")
	sayUser(t, conn, "Say hello.")
	tr := respond(t, conn, nil)

	require.Equal(t, realtime.RealtimeResponseStatus("completed"), tr.done.Response.Status, "%s", tr.done.RawJSON())
	assert.Equal(t, chatText(t, a, openai.SystemMessage("Be brief."), openai.UserMessage("Say hello.")), tr.transcript)
	assert.NotEmpty(t, tr.audio)
	assert.Zero(t, len(tr.audio)%2, "PCM16")
	assert.Positive(t, tr.done.Response.Usage.OutputTokens)
	assert.Equal(t, []string{"response.created", "response.output_item.added", "conversation.item.added", "response.content_part.added"}, tr.types[:4])
	assert.Equal(t, []string{"response.output_audio.done", "response.output_audio_transcript.done", "response.content_part.done",
		"response.output_item.done", "conversation.item.done", "response.done"}, tr.types[len(tr.types)-6:])
	assert.Equal(t, 1.0, testutil.ToFloat64(a.cfg.Metrics.realtime.turns.WithLabelValues("completed")))
	assert.Equal(t, 1.0, testutil.ToFloat64(a.cfg.Metrics.realtime.active))
	n, err := testutil.GatherAndCount(reg, "troupe_realtime_time_to_first_audio_seconds")
	require.NoError(t, err)
	assert.Equal(t, 1, n)
}

// TestRealtimeHistory: each turn, the thinker sees the whole conversation
// so far, its own answers included: three turns answer what chat requests
// with the same history answer.
func TestRealtimeHistory(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{})
	a, _ := rtAPI(t, c, Config{})
	conn := connect(t, a)
	sessionUpdate(t, conn, "You are terse.", "text")
	history := []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("You are terse.")}
	for _, q := range []string{"One?", "Two?", "Three?"} {
		sayUser(t, conn, q)
		history = append(history, openai.UserMessage(q))
		tr := respond(t, conn, nil)
		require.Equal(t, realtime.RealtimeResponseStatus("completed"), tr.done.Response.Status)
		assert.Empty(t, tr.audio, "a text session has no audio")
		assert.Equal(t, chatText(t, a, history...), tr.text, "turn %q", q)
		history = append(history, openai.AssistantMessage(tr.text))
	}
}

// TestRealtimeHistoryBudget: past the byte budget the oldest items are
// dropped, whole, and the newest kept.
func TestRealtimeHistoryBudget(t *testing.T) {
	c := &rtSessionConn{cfg: RealtimeConfig{HistoryBytes: 10}, instructions: "sys"}
	c.items = []*historyItem{{role: "user", text: "aaaa"}, {role: "assistant", text: "bbbb"}, {role: "user", text: "cccc"}}
	msgs, prompt := c.conversationLocked()
	require.Len(t, msgs, 3)
	assert.Equal(t, "system: sys\nassistant: bbbb\nuser: cccc", prompt)
	c.items = []*historyItem{{role: "user", text: strings.Repeat("x", 50)}}
	msgs, _ = c.conversationLocked()
	assert.Len(t, msgs, 2, "the newest item is kept whatever its size")

	// An audio item counts its WAV bytes.
	c.items = []*historyItem{{role: "assistant", text: "bbbb"}, {role: "user", parts: []*stagepb.ContentPart{{Kind: stagepb.PartAudio, Data: make([]byte, 8), Format: "wav"}}}}
	msgs, prompt = c.conversationLocked()
	require.Len(t, msgs, 2, "4 bytes of text and 8 of audio are over 10")
	assert.Equal(t, "system: sys\nuser: ", prompt)
	require.Len(t, msgs[1].Parts, 1)
	assert.Equal(t, "wav", msgs[1].Parts[0].GetFormat())
	c.cfg.HistoryBytes = 12
	msgs, _ = c.conversationLocked()
	assert.Len(t, msgs, 3, "12 bytes hold both")
}

// wavOf is the WAV file a realtime session makes of committed PCM.
func wavOf(t *testing.T, pcm []byte) []byte {
	t.Helper()
	wav, err := appendWAV(nil, pcm, realtimeSampleRate)
	require.NoError(t, err)
	return wav
}

// audioMessage is a chat user message of one input_audio part.
func audioMessage(wav []byte) openai.ChatCompletionMessageParamUnion {
	return openai.UserMessage([]openai.ChatCompletionContentPartUnionParam{
		openai.InputAudioContentPart(openai.ChatCompletionContentPartInputAudioInputAudioParam{Data: base64.StdEncoding.EncodeToString(wav), Format: "wav"})})
}

// recvUntil reads events until one of type last, and returns their types
// and that event; an error event fails the test.
func recvUntil(t *testing.T, conn *realtime.RealtimeConnection, last string, onEvent func(realtime.RealtimeServerEventUnion)) ([]string, realtime.RealtimeServerEventUnion) {
	t.Helper()
	var types []string
	for {
		ev, err := conn.Recv(testCtx(t))
		require.NoError(t, err)
		require.NotEqual(t, "error", ev.Type, "%s", ev.RawJSON())
		types = append(types, ev.Type)
		if onEvent != nil {
			onEvent(ev)
		}
		if ev.Type == last {
			return types, ev
		}
	}
}

// assertAudioItem asserts ev (conversation.item.added or .done) is the
// user item of committed audio id.
func assertAudioItem(t *testing.T, ev realtime.RealtimeServerEventUnion, id string) {
	t.Helper()
	var got struct {
		Item struct {
			ID, Role string
			Content  []struct{ Type string }
		}
	}
	require.NoError(t, json.Unmarshal([]byte(ev.RawJSON()), &got))
	assert.Equal(t, id, got.Item.ID, "%s", ev.RawJSON())
	assert.Equal(t, "user", got.Item.Role)
	require.Len(t, got.Item.Content, 1, "%s", ev.RawJSON())
	assert.Equal(t, "input_audio", got.Item.Content[0].Type)
}

// TestRealtimeAudioInput: a committed input audio buffer becomes a user
// item of one input_audio part, which the thinker hears as a chat
// request's input_audio part of the same PCM as WAV: the answers are
// equal, and the audio stays in the history of the next turn.
func TestRealtimeAudioInput(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{})
	a, _ := rtAPI(t, c, Config{})
	conn := connect(t, a)
	sessionUpdate(t, conn, "Be brief.", "text")
	quiet := tone(300, 0.01) // under server VAD's threshold: no speech, no automatic commit
	for _, chunk := range [][]byte{quiet[:4000], quiet[4000:]} {
		require.NoError(t, conn.Send(testCtx(t), realtime.RealtimeClientEventParamOfInputAudioBufferAppend(base64.StdEncoding.EncodeToString(chunk))))
	}
	require.NoError(t, conn.Send(testCtx(t), realtime.RealtimeClientEventUnionParam{OfInputAudioBufferCommit: &realtime.InputAudioBufferCommitEventParam{}}))
	ev, err := conn.Recv(testCtx(t))
	require.NoError(t, err)
	require.Equal(t, "input_audio_buffer.committed", ev.Type, "%s", ev.RawJSON())
	id := ev.AsInputAudioBufferCommittedEvent().ItemID
	types, done := recvUntil(t, conn, "conversation.item.done", func(ev realtime.RealtimeServerEventUnion) { assertAudioItem(t, ev, id) })
	assert.Equal(t, []string{"conversation.item.added", "conversation.item.done"}, types)
	assertAudioItem(t, done, id)

	wav := wavOf(t, quiet)
	history := []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("Be brief."), audioMessage(wav)}
	tr := respond(t, conn, nil)
	require.Equal(t, realtime.RealtimeResponseStatus("completed"), tr.done.Response.Status, "%s", tr.done.RawJSON())
	assert.NotEmpty(t, tr.text)
	assert.Equal(t, chatText(t, a, history...), tr.text)
	assert.GreaterOrEqual(t, tr.done.Response.Usage.InputTokens, int64(tokenizers.MediaTokens(wav)))

	history = append(history, openai.AssistantMessage(tr.text), openai.UserMessage("And then?"))
	sayUser(t, conn, "And then?")
	tr = respond(t, conn, nil)
	require.Equal(t, realtime.RealtimeResponseStatus("completed"), tr.done.Response.Status, "%s", tr.done.RawJSON())
	assert.Equal(t, chatText(t, a, history...), tr.text, "the audio item is in the history")
}

// TestRealtimeAudioItem: conversation.item.create with an input_audio part
// (base64 PCM16 at 24 kHz) next to a text part is a user message the
// thinker hears as a chat request's text and input_audio parts of the same
// audio as WAV; the item shown does not echo the audio back, and a
// response.create answers it.
func TestRealtimeAudioItem(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{})
	a, _ := rtAPI(t, c, Config{})
	conn := connect(t, a)
	sessionUpdate(t, conn, "Be brief.", "text")
	pcm := tone(300, 0.2)
	require.NoError(t, conn.Send(testCtx(t), realtime.RealtimeClientEventParamOfConversationItemCreate(realtime.RealtimeConversationItemUserMessageParam{
		Content: []realtime.RealtimeConversationItemUserMessageContentParam{
			{Type: "input_text", Text: openai.String("Listen:")},
			{Type: "input_audio", Audio: openai.String(base64.StdEncoding.EncodeToString(pcm))}}})))
	for _, want := range []string{"conversation.item.added", "conversation.item.done"} {
		ev, err := conn.Recv(testCtx(t))
		require.NoError(t, err)
		require.Equal(t, want, ev.Type, "%s", ev.RawJSON())
		var got struct {
			Item struct {
				Role    string
				Content []map[string]any
			}
		}
		require.NoError(t, json.Unmarshal([]byte(ev.RawJSON()), &got))
		assert.Equal(t, "user", got.Item.Role)
		require.Len(t, got.Item.Content, 2, "%s", ev.RawJSON())
		assert.Equal(t, "input_audio", got.Item.Content[1]["type"])
		assert.NotContains(t, got.Item.Content[1], "audio", "the audio is not echoed back")
	}
	tr := respond(t, conn, nil)
	require.Equal(t, realtime.RealtimeResponseStatus("completed"), tr.done.Response.Status, "%s", tr.done.RawJSON())
	wav := wavOf(t, pcm)
	assert.GreaterOrEqual(t, tr.done.Response.Usage.InputTokens, int64(tokenizers.MediaTokens(wav)))
	user := openai.UserMessage([]openai.ChatCompletionContentPartUnionParam{openai.TextContentPart("Listen:"),
		openai.InputAudioContentPart(openai.ChatCompletionContentPartInputAudioInputAudioParam{Data: base64.StdEncoding.EncodeToString(wav), Format: "wav"})})
	assert.NotEmpty(t, tr.text)
	assert.Equal(t, chatText(t, a, openai.SystemMessage("Be brief."), user), tr.text)
	// Without the text part the thinker answers otherwise: both parts reached it.
	assert.NotEqual(t, chatText(t, a, openai.SystemMessage("Be brief."), audioMessage(wav)), tr.text, "the text part reaches the thinker")
}

// TestRealtimeVADTurn: with server_vad (create_response by default),
// speech then silence is detected, committed as an audio item and
// answered without a response.create.
func TestRealtimeVADTurn(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{})
	a, _ := rtAPI(t, c, Config{})
	conn := connect(t, a)
	sessionUpdate(t, conn, "Be brief.", "text")
	speech, silence := tone(400, 0.3), tone(600, 0)
	for _, chunk := range [][]byte{speech, silence} {
		require.NoError(t, conn.Send(testCtx(t), realtime.RealtimeClientEventParamOfInputAudioBufferAppend(base64.StdEncoding.EncodeToString(chunk))))
	}
	var id string
	var text strings.Builder
	types, ev := recvUntil(t, conn, "response.done", func(ev realtime.RealtimeServerEventUnion) {
		switch ev.Type {
		case "input_audio_buffer.committed":
			id = ev.AsInputAudioBufferCommittedEvent().ItemID
		case "conversation.item.added", "conversation.item.done":
			if strings.Contains(ev.RawJSON(), `"role":"user"`) {
				assertAudioItem(t, ev, id)
			}
		case "response.output_text.delta":
			text.WriteString(ev.AsResponseTextDeltaEvent().Delta)
		}
	})
	require.GreaterOrEqual(t, len(types), 7)
	assert.Equal(t, []string{"input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped", "input_audio_buffer.committed",
		"conversation.item.added", "conversation.item.done", "response.created"}, types[:6])
	done := ev.AsResponseDoneEvent()
	require.Equal(t, realtime.RealtimeResponseStatus("completed"), done.Response.Status, "%s", ev.RawJSON())
	// The committed buffer is all the audio appended: the speech, and the
	// silence whose chunk ended it.
	wav := wavOf(t, append(slices.Clone(speech), silence...))
	assert.NotEmpty(t, text.String())
	assert.Equal(t, chatText(t, a, openai.SystemMessage("Be brief."), audioMessage(wav)), text.String())
}

// allIdle reports whether no stage runs a request.
func allIdle(c *orchestratortest.Cluster) bool {
	for i := range c.Head.Pipeline().Stages {
		if inFlight(c, i) != 0 {
			return false
		}
	}
	return true
}

func waitIdle(t testing.TB, c *orchestratortest.Cluster) {
	t.Helper()
	require.Eventually(t, func() bool { return allIdle(c) }, wait, time.Millisecond, "stages still busy")
}

// TestRealtimeBargeIn: response.cancel mid-audio stops every stage, the
// response ends cancelled with the text the client was sent kept in the
// conversation, and the next turn runs at once.
func TestRealtimeBargeIn(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{Sim: sim.Config{DecodeTokenLatency: 20 * time.Millisecond}})
	a, _ := rtAPI(t, c, Config{})
	conn := connect(t, a)
	sessionUpdate(t, conn, "", "audio")
	sayUser(t, conn, "Tell me a long story.")
	cancelled := false
	tr := respond(t, conn, func(ev realtime.RealtimeServerEventUnion) {
		if ev.Type == "response.output_audio.delta" && !cancelled {
			cancelled = true
			require.NoError(t, conn.Send(testCtx(t), realtime.RealtimeClientEventUnionParam{OfResponseCancel: &realtime.ResponseCancelEventParam{}}))
		}
	})
	require.True(t, cancelled)
	require.Equal(t, realtime.RealtimeResponseStatus("cancelled"), tr.done.Response.Status, "%s", tr.done.RawJSON())
	assert.Contains(t, tr.done.RawJSON(), `"reason":"client_cancelled"`)
	waitIdle(t, c)
	assert.Equal(t, 1.0, testutil.ToFloat64(a.cfg.Metrics.realtime.bargeIns))
	assert.Equal(t, uint64(1), histCount(t, a.cfg.Metrics.realtime.cancelLatency))
	// The item holds what was sent, which the next turn's thinker sees.
	item := tr.done.Response.Output[0].AsRealtimeConversationItemAssistantMessage()
	assert.Equal(t, tr.transcript, item.Content[0].Transcript)
	assert.Equal(t, realtime.RealtimeConversationItemAssistantMessageStatus("incomplete"), item.Status)

	// The client played half the audio it got: the item keeps that share
	// of its transcript.
	audioMs := int64(len(tr.audio)/2) * 1000 / realtimeSampleRate
	require.Positive(t, audioMs)
	require.NoError(t, conn.Send(testCtx(t), realtime.RealtimeClientEventParamOfConversationItemTruncate(audioMs/2, 0, item.ID)))
	ev, err := conn.Recv(testCtx(t))
	require.NoError(t, err)
	require.Equal(t, "conversation.item.truncated", ev.Type, "%s", ev.RawJSON())
	runes := []rune(tr.transcript)
	heard := string(runes[:int64(len(runes))*(audioMs/2)/audioMs])

	sessionUpdate(t, conn, "", "text")
	sayUser(t, conn, "Go on.")
	next := respond(t, conn, nil)
	require.Equal(t, realtime.RealtimeResponseStatus("completed"), next.done.Response.Status)
	assert.Equal(t, chatText(t, a, openai.UserMessage("Tell me a long story."), openai.AssistantMessage(heard), openai.UserMessage("Go on.")), next.text)
}

// TestRealtimeSpans: the session has a span, each turn a span under it,
// and the turn's pipeline request runs under the turn.
func TestRealtimeSpans(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()), sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	c := startCluster(t, orchestratortest.Options{HeadTracer: tp})
	a, _ := rtAPI(t, c, Config{TracerProvider: tp})
	conn := connect(t, a)
	sessionUpdate(t, conn, "", "text")
	for range 2 {
		sayUser(t, conn, "Hi.")
		respond(t, conn, nil)
	}
	require.NoError(t, conn.Close())
	var session sdktrace.ReadOnlySpan
	require.Eventually(t, func() bool {
		for _, s := range rec.Ended() {
			if s.Name() == SpanRealtimeSession {
				session = s
				return true
			}
		}
		return false
	}, wait, time.Millisecond)
	turns := map[trace.SpanID]bool{}
	for _, s := range rec.Ended() {
		if s.Name() == SpanRealtimeTurn {
			assert.Equal(t, session.SpanContext().SpanID(), s.Parent().SpanID())
			turns[s.SpanContext().SpanID()] = true
		}
	}
	assert.Len(t, turns, 2)
	requests := 0
	for _, s := range rec.Ended() {
		if s.Name() == "troupe.request" {
			assert.True(t, turns[s.Parent().SpanID()], "a turn's request runs under the turn")
			requests++
		}
	}
	assert.Equal(t, 2, requests)
}

func histCount(t *testing.T, h prometheus.Histogram) uint64 {
	t.Helper()
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(h))
	fams, err := reg.Gather()
	require.NoError(t, err)
	return fams[0].GetMetric()[0].GetHistogram().GetSampleCount()
}

// TestRealtimeClientGone: a client that vanishes mid-turn ends the
// response on every stage; nothing leaks (goleak in TestMain).
func TestRealtimeClientGone(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{Sim: sim.Config{DecodeTokenLatency: 20 * time.Millisecond}})
	a, _ := rtAPI(t, c, Config{})
	conn := connect(t, a)
	sayUser(t, conn, "Talk.")
	require.NoError(t, conn.Send(testCtx(t), realtime.RealtimeClientEventUnionParam{OfResponseCreate: &realtime.ResponseCreateEventParam{}}))
	for {
		ev, err := conn.Recv(testCtx(t))
		require.NoError(t, err)
		if ev.Type == "response.output_audio.delta" {
			break
		}
	}
	conn.Abort()
	waitIdle(t, c)
	require.Eventually(t, func() bool { return testutil.ToFloat64(a.cfg.Metrics.realtime.active) == 0 }, wait, time.Millisecond)
}

// rawConn is a session over a plain WebSocket, for events the typed
// client would not send.
func rawConn(t *testing.T, a *api) *websocket.Conn {
	t.Helper()
	conn, _, err := websocket.Dial(testCtx(t), "ws"+strings.TrimPrefix(a.base, "http")+"/v1/realtime", nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.CloseNow() })
	require.Equal(t, "session.created", readRaw(t, conn)["type"])
	return conn
}

func readRaw(t *testing.T, conn *websocket.Conn) map[string]any {
	t.Helper()
	_, data, err := conn.Read(testCtx(t))
	require.NoError(t, err)
	var ev map[string]any
	require.NoError(t, json.Unmarshal(data, &ev))
	return ev
}

// TestRealtimeBadEvents: every bad event is answered with an error event
// in OpenAI's shape, naming the client's event_id, and the session goes on.
func TestRealtimeBadEvents(t *testing.T) {
	// Slow decoding keeps the first response running while the second
	// response.create arrives; an instant response could finish first.
	c := startCluster(t, orchestratortest.Options{Sim: sim.Config{DecodeTokenLatency: 50 * time.Millisecond}})
	a, _ := rtAPI(t, c, Config{})
	conn := rawConn(t, a)
	for _, tc := range []struct{ event, code string }{
		{`{"type":"session.update"`, "invalid_json"},
		{`{"type":"no.such.event","event_id":"e1"}`, "unknown_event"},
		{`{"event_id":"e1"}`, "missing_field"},
		{`{"type":"input_audio_buffer.append","event_id":"e1","audio":"***"}`, "invalid_base64"},
		{`{"type":"response.cancel","event_id":"e1"}`, "response_cancel_not_active"},
		{`{"type":"input_audio_buffer.commit","event_id":"e1"}`, "input_audio_buffer_commit_empty"},
		{`{"type":"session.update","event_id":"e1","session":{"type":"realtime","audio":{"output":{"format":{"type":"audio/pcmu"}}}}}`, "invalid_value"},
		{`{"type":"session.update","event_id":"e1","session":{"type":"realtime","output_modalities":["video"]}}`, "invalid_value"},
		{`{"type":"conversation.item.create","event_id":"e1","item":{"type":"message","role":"user","content":[{"type":"input_audio","audio":"***"}]}}`, "invalid_base64"},
		{`{"type":"conversation.item.create","event_id":"e1","item":{"type":"message","role":"user","content":[{"type":"input_audio","audio":"AA=="}]}}`, "invalid_value"},
		{`{"type":"conversation.item.create","event_id":"e1","item":{"type":"message","role":"assistant","content":[{"type":"input_audio","audio":"AAAA"}]}}`, "invalid_value"},
		{`{"type":"conversation.item.truncate","event_id":"e1","item_id":"nope","content_index":0,"audio_end_ms":10}`, "invalid_value"},
	} {
		require.NoError(t, conn.Write(testCtx(t), websocket.MessageText, []byte(tc.event)))
		ev := readRaw(t, conn)
		require.Equal(t, "error", ev["type"], "%s: %v", tc.event, ev)
		e := ev["error"].(map[string]any)
		assert.Equal(t, tc.code, e["code"], tc.event)
		assert.Equal(t, "invalid_request_error", e["type"])
		assert.NotEmpty(t, e["message"])
		assert.Contains(t, e, "param")
		if strings.Contains(tc.event, `"e1"`) {
			assert.Equal(t, "e1", e["event_id"], tc.event)
		}
	}
	// A second response.create while one runs is out of order.
	require.NoError(t, conn.Write(testCtx(t), websocket.MessageText, []byte(`{"type":"session.update","session":{"type":"realtime","output_modalities":["text"]}}`)))
	require.Equal(t, "session.updated", readRaw(t, conn)["type"])
	require.NoError(t, conn.Write(testCtx(t), websocket.MessageText, []byte(`{"type":"response.create","event_id":"r"}`)))
	require.Equal(t, "response.created", readRaw(t, conn)["type"])
	require.NoError(t, conn.Write(testCtx(t), websocket.MessageText, []byte(`{"type":"response.create","event_id":"r"}`)))
	sawBusy := false
	for {
		ev := readRaw(t, conn)
		if ev["type"] == "error" {
			assert.Equal(t, "conversation_already_has_active_response", ev["error"].(map[string]any)["code"])
			sawBusy = true
		}
		if ev["type"] == "response.done" {
			break
		}
	}
	assert.True(t, sawBusy)
}

// TestRealtimeLimits: the message size limit closes with 1009, the session
// limit with 1013, idle sessions with 4000, the drain with 1001; the key
// passes as the subprotocol.
func TestRealtimeLimits(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{})
	a, _ := rtAPI(t, c, Config{APIKey: "k", Realtime: RealtimeConfig{MaxSessions: 1, MaxMessageBytes: 1024, IdleTimeout: time.Second}})
	url := "ws" + strings.TrimPrefix(a.base, "http") + "/v1/realtime"
	_, resp, err := websocket.Dial(testCtx(t), url, nil)
	require.Error(t, err, "no key")
	assert.Equal(t, 401, resp.StatusCode)

	conn, _, err := websocket.Dial(testCtx(t), url, &websocket.DialOptions{Subprotocols: []string{"realtime", realtimeKeyPrefix + "k"}})
	require.NoError(t, err)
	defer conn.CloseNow()
	assert.Equal(t, "realtime", conn.Subprotocol())
	require.Equal(t, "session.created", readRaw(t, conn)["type"])

	second, _, err := websocket.Dial(testCtx(t), url, &websocket.DialOptions{Subprotocols: []string{realtimeKeyPrefix + "k"}})
	require.NoError(t, err)
	_, _, err = second.Read(testCtx(t))
	assert.Equal(t, websocket.StatusCode(closeTryAgain), websocket.CloseStatus(err), "%v", err)
	var ce websocket.CloseError
	require.ErrorAs(t, err, &ce)
	assert.Contains(t, ce.Reason, "limit of 1 realtime sessions")

	require.NoError(t, conn.Write(testCtx(t), websocket.MessageText, []byte(`{"type":"x","pad":"`+strings.Repeat("a", 2000)+`"}`)))
	_, _, err = conn.Read(testCtx(t))
	assert.Equal(t, websocket.StatusMessageTooBig, websocket.CloseStatus(err), "%v", err)

	idle := dialWhenFree(t, url)
	_, _, err = idle.Read(testCtx(t))
	assert.Equal(t, websocket.StatusCode(closeIdle), websocket.CloseStatus(err), "%v", err)

	draining := dialWhenFree(t, url)
	a.Drain()
	_, _, err = draining.Read(testCtx(t))
	assert.Equal(t, websocket.StatusGoingAway, websocket.CloseStatus(err), "%v", err)
	require.NoError(t, a.WaitRealtime(testCtx(t)), "every session ended")
	refused, _, err := websocket.Dial(testCtx(t), url, &websocket.DialOptions{Subprotocols: []string{realtimeKeyPrefix + "k"}})
	require.NoError(t, err)
	_, _, err = refused.Read(testCtx(t))
	assert.Equal(t, websocket.StatusCode(closeTryAgain), websocket.CloseStatus(err), "a draining head takes no session")
	require.ErrorAs(t, err, &ce)
	assert.Contains(t, ce.Reason, "draining", "it says why, not that it is full")
}

// TestRealtimeDrainBusy: a session whose response runs when the head
// drains is closed with 1001 once the response has ended, not before.
func TestRealtimeDrainBusy(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{Sim: sim.Config{DecodeTokenLatency: 5 * time.Millisecond}})
	a, _ := rtAPI(t, c, Config{})
	conn := rawConn(t, a)
	for _, ev := range []string{`{"type":"session.update","session":{"type":"realtime","output_modalities":["text"]}}`,
		`{"type":"conversation.item.create","item":{"type":"message","role":"user","content":[{"type":"input_text","text":"Talk."}]}}`,
		`{"type":"response.create"}`} {
		require.NoError(t, conn.Write(testCtx(t), websocket.MessageText, []byte(ev)))
	}
	drained, done := false, false
	for {
		_, data, err := conn.Read(testCtx(t))
		if err != nil {
			assert.Equal(t, websocket.StatusGoingAway, websocket.CloseStatus(err), "%v", err)
			break
		}
		typ := eventType(data)
		if typ == "response.output_text.delta" && !drained {
			drained = true
			a.Drain()
		}
		if typ == "response.done" {
			require.True(t, drained)
			assert.Contains(t, string(data), `"status":"completed"`, "the running response finishes")
			done = true
		}
	}
	assert.True(t, done, "response.done came before the close")
	require.NoError(t, a.WaitRealtime(testCtx(t)))
}

// dialWhenFree opens a session once the head's one slot is free, and reads
// its session.created.
func dialWhenFree(t *testing.T, url string) *websocket.Conn {
	t.Helper()
	var conn *websocket.Conn
	require.Eventually(t, func() bool {
		c, _, err := websocket.Dial(testCtx(t), url, &websocket.DialOptions{Subprotocols: []string{realtimeKeyPrefix + "k"}})
		require.NoError(t, err)
		_, data, err := c.Read(testCtx(t))
		if err != nil {
			return false
		}
		require.Contains(t, string(data), "session.created")
		conn = c
		return true
	}, wait, 5*time.Millisecond, "no free session slot")
	t.Cleanup(func() { _ = conn.CloseNow() })
	return conn
}

// TestRealtimeSpeechBargeIn: with server_vad, speech appended while a
// response plays cancels it (turn_detected) on every stage; the speech's
// end commits the buffer, which this pipeline, whose thinker takes no audio,
// answers with an error event (the head's refusal), keeping no item.
func TestRealtimeSpeechBargeIn(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{Sim: sim.Config{DecodeTokenLatency: 20 * time.Millisecond, TextOnly: true}})
	a, _ := rtAPI(t, c, Config{})
	conn := connect(t, a)
	sayUser(t, conn, "Tell me a long story.")
	sent := false
	tr := respond(t, conn, func(ev realtime.RealtimeServerEventUnion) {
		if ev.Type == "response.output_audio.delta" && !sent {
			sent = true
			speech := base64.StdEncoding.EncodeToString(tone(200, 0.3))
			require.NoError(t, conn.Send(testCtx(t), realtime.RealtimeClientEventParamOfInputAudioBufferAppend(speech)))
		}
	})
	require.Equal(t, realtime.RealtimeResponseStatus("cancelled"), tr.done.Response.Status, "%s", tr.done.RawJSON())
	assert.Contains(t, tr.done.RawJSON(), `"reason":"turn_detected"`)
	assert.Contains(t, tr.types, "input_audio_buffer.speech_started")
	require.Eventually(t, func() bool { return allIdle(c) }, wait, time.Millisecond, "stages still busy")

	silence := base64.StdEncoding.EncodeToString(tone(600, 0))
	require.NoError(t, conn.Send(testCtx(t), realtime.RealtimeClientEventParamOfInputAudioBufferAppend(silence)))
	var types []string
	for len(types) < 3 {
		ev, err := conn.Recv(testCtx(t))
		require.NoError(t, err)
		types = append(types, ev.Type)
		if ev.Type == "error" {
			assert.Equal(t, "audio_input_unsupported", ev.AsRealtimeErrorEvent().Error.Code)
		}
	}
	assert.Equal(t, []string{"input_audio_buffer.speech_stopped", "input_audio_buffer.committed", "error"}, types)

	// An audio item is refused the same way, and kept out of the history.
	require.NoError(t, conn.Send(testCtx(t), realtime.RealtimeClientEventParamOfConversationItemCreate(realtime.RealtimeConversationItemUserMessageParam{
		Content: []realtime.RealtimeConversationItemUserMessageContentParam{{Type: "input_audio", Audio: openai.String(silence)}}})))
	ev, err := conn.Recv(testCtx(t))
	require.NoError(t, err)
	require.Equal(t, "error", ev.Type, "%s", ev.RawJSON())
	assert.Equal(t, "audio_input_unsupported", ev.AsRealtimeErrorEvent().Error.Code)
}

// TestRealtimeCancelSpan: a cancelled turn's span has a cancel event, and
// the workers' server spans of every stage under the turn end after it:
// the interval BenchmarkRealtimeCancel reports.
func TestRealtimeCancelSpan(t *testing.T) {
	c, tp, rec := benchTracedCluster(t, orchestratortest.Options{Sim: sim.Config{DecodeTokenLatency: 20 * time.Millisecond}})
	a, _ := rtAPI(t, c, Config{TracerProvider: tp})
	conn := connect(t, a)
	sayUser(t, conn, "Tell me a long story.")
	cancelled := false
	tr := respond(t, conn, func(ev realtime.RealtimeServerEventUnion) {
		if ev.Type == "response.output_audio.delta" && !cancelled {
			cancelled = true
			require.NoError(t, conn.Send(testCtx(t), realtime.RealtimeClientEventUnionParam{OfResponseCancel: &realtime.ResponseCancelEventParam{}}))
		}
	})
	require.Equal(t, realtime.RealtimeResponseStatus("cancelled"), tr.done.Response.Status, "%s", tr.done.RawJSON())
	waitIdle(t, c)
	var lat []time.Duration
	require.Eventually(t, func() bool {
		lat = workerCancelLatencies(rec, len(c.Head.Pipeline().Stages))
		return len(lat) == 1
	}, wait, 10*time.Millisecond, "one cancelled turn, its workers' spans ended")
	assert.GreaterOrEqual(t, lat[0], time.Duration(0), "the last stage stopped after the cancel reached the head")
}

// BenchmarkRealtimeCancel: barge-in latency measured at the workers, and
// time to first audio, with n sessions of the official client
// (client.Realtime.Connect) each running audio turns cancelled
// (response.cancel) at their first audio delta. cancel_p50_ms and
// cancel_p99_ms are, per turn, the time from the cancel reaching the head
// (the turn span's cancel event) to the last worker server span under the
// turn ending: every stage's call has returned at its worker, the engine's
// request aborted. ttfa_* is response.create sent to the first
// response.output_audio.delta received, at the client. Tracing is on for
// the spans (every span sampled), which the figures include.
func BenchmarkRealtimeCancel(b *testing.B) {
	for _, n := range []int{1, 8, 32} {
		b.Run(fmt.Sprintf("sessions=%d", n), func(b *testing.B) { benchCancel(b, n) })
	}
}

// benchTracedCluster is a cluster whose head and workers record their
// spans on rec, propagated over every hop (as orchestrator's tracing tests).
func benchTracedCluster(b testing.TB, opts orchestratortest.Options) (*orchestratortest.Cluster, *sdktrace.TracerProvider, *tracetest.SpanRecorder) {
	rec := tracetest.NewSpanRecorder()
	headTP := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()), sdktrace.WithSpanProcessor(rec))
	workerTP := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.NeverSample())), sdktrace.WithSpanProcessor(rec))
	b.Cleanup(func() {
		_ = headTP.Shutdown(context.Background())
		_ = workerTP.Shutdown(context.Background())
	})
	prop := propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	opts.HeadTracer = headTP
	opts.HeadDialOptions = []grpc.DialOption{grpc.WithStatsHandler(otelgrpc.NewClientHandler(otelgrpc.WithTracerProvider(headTP), otelgrpc.WithPropagators(prop)))}
	opts.WorkerServerOptions = []grpc.ServerOption{grpc.StatsHandler(otelgrpc.NewServerHandler(otelgrpc.WithTracerProvider(workerTP), otelgrpc.WithPropagators(prop)))}
	return startCluster(b, opts), headTP, rec
}

func benchCancel(b *testing.B, sessions int) {
	c, tp, rec := benchTracedCluster(b, orchestratortest.Options{Sim: sim.Config{DecodeTokenLatency: 5 * time.Millisecond, MaxNumSeqs: 64}})
	m, err := NewMetrics(prometheus.NewRegistry())
	require.NoError(b, err)
	srv := New(c.Head, Config{Logger: slog.New(slog.DiscardHandler), Metrics: m, TracerProvider: tp})
	hs := httptest.NewServer(srv.Handler())
	defer hs.Close()
	client := openai.NewClient(option.WithBaseURL(hs.URL+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	var mu sync.Mutex
	var ttfa []time.Duration
	var next atomic.Int64
	g, gctx := errgroup.WithContext(ctx)
	b.ResetTimer()
	for range sessions {
		g.Go(func() error {
			ttfas, err := benchSession(gctx, client, &next, int64(b.N))
			mu.Lock()
			ttfa = append(ttfa, ttfas...)
			mu.Unlock()
			return err
		})
	}
	require.NoError(b, g.Wait())
	b.StopTimer()
	waitIdle(b, c)
	var lat []time.Duration
	stages := len(c.Head.Pipeline().Stages)
	require.Eventually(b, func() bool {
		lat = workerCancelLatencies(rec, stages)
		return len(lat) == len(ttfa)
	}, wait, 10*time.Millisecond, "every cancelled turn's worker spans ended")
	b.ReportMetric(quantileMs(lat, 50), "cancel_p50_ms")
	b.ReportMetric(quantileMs(lat, 99), "cancel_p99_ms")
	b.ReportMetric(quantileMs(ttfa, 50), "ttfa_p50_ms")
	b.ReportMetric(quantileMs(ttfa, 99), "ttfa_p99_ms")
}

// benchSession runs audio turns on one session until next passes n, each
// cancelled at its first audio delta, and returns their times to first
// audio.
func benchSession(ctx context.Context, client openai.Client, next *atomic.Int64, n int64) ([]time.Duration, error) {
	conn, err := client.Realtime.Connect(ctx, realtime.RealtimeConnectionOptions{})
	if err != nil {
		return nil, err
	}
	defer conn.Abort()
	if err := conn.Send(ctx, realtime.RealtimeClientEventParamOfConversationItemCreate(realtime.RealtimeConversationItemUserMessageParam{
		Content: []realtime.RealtimeConversationItemUserMessageContentParam{{Type: "input_text", Text: openai.String("Talk.")}}})); err != nil {
		return nil, err
	}
	var out []time.Duration
	for next.Add(1) <= n {
		start := time.Now()
		if err := conn.Send(ctx, realtime.RealtimeClientEventUnionParam{OfResponseCreate: &realtime.ResponseCreateEventParam{}}); err != nil {
			return out, err
		}
		first := false
		for {
			ev, err := conn.Recv(ctx)
			if err != nil {
				return out, err
			}
			if ev.Type == "error" {
				return out, fmt.Errorf("error event: %s", ev.RawJSON())
			}
			if ev.Type == "response.output_audio.delta" && !first {
				first = true
				out = append(out, time.Since(start))
				if err := conn.Send(ctx, realtime.RealtimeClientEventUnionParam{OfResponseCancel: &realtime.ResponseCancelEventParam{}}); err != nil {
					return out, err
				}
			}
			if ev.Type == "response.done" {
				if !first {
					return out, fmt.Errorf("a response ended before its first audio: %s", ev.RawJSON())
				}
				break
			}
		}
	}
	return out, nil
}

// workerCancelLatencies is, for each turn span with a cancel event whose
// subtree holds a worker server span of every stage, the time from the
// cancel to the last of those spans' ends.
func workerCancelLatencies(rec *tracetest.SpanRecorder, stages int) []time.Duration {
	spans := rec.Ended()
	children := map[trace.SpanID][]sdktrace.ReadOnlySpan{}
	for _, s := range spans {
		children[s.Parent().SpanID()] = append(children[s.Parent().SpanID()], s)
	}
	var out []time.Duration
	for _, s := range spans {
		if s.Name() != SpanRealtimeTurn {
			continue
		}
		var cancelAt time.Time
		for _, e := range s.Events() {
			if e.Name == EventRealtimeCancel {
				cancelAt = e.Time
			}
		}
		if cancelAt.IsZero() {
			continue
		}
		var last time.Time
		servers := 0
		queue := []sdktrace.ReadOnlySpan{s}
		for len(queue) > 0 {
			sp := queue[0]
			queue = queue[1:]
			if sp.SpanKind() == trace.SpanKindServer {
				servers++
				if sp.EndTime().After(last) {
					last = sp.EndTime()
				}
			}
			queue = append(queue, children[sp.SpanContext().SpanID()]...)
		}
		if servers < stages {
			return nil // a worker's span has not ended yet
		}
		out = append(out, last.Sub(cancelAt))
	}
	return out
}

// quantileMs is the q-th percentile of ds, in milliseconds.
func quantileMs(ds []time.Duration, q int) float64 {
	ds = slices.Clone(ds)
	slices.Sort(ds)
	return float64(ds[(len(ds)-1)*q/100].Microseconds()) / 1000
}

func eventType(data []byte) string {
	var ev struct {
		Type string `json:"type"`
	}
	_ = json.Unmarshal(data, &ev)
	return ev.Type
}

// TestRealtimeFailedTurn: a response past the request timeout ends failed,
// its error in response.done, and the session goes on.
func TestRealtimeFailedTurn(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{Sim: sim.Config{DecodeTokenLatency: 50 * time.Millisecond}})
	a, _ := rtAPI(t, c, Config{RequestTimeout: 20 * time.Millisecond})
	conn := connect(t, a)
	sessionUpdate(t, conn, "", "text")
	sayUser(t, conn, "Talk.")
	tr := respond(t, conn, nil)
	require.Equal(t, realtime.RealtimeResponseStatus("failed"), tr.done.Response.Status, "%s", tr.done.RawJSON())
	assert.Contains(t, tr.done.RawJSON(), `"code":"timeout"`)
	assert.Equal(t, 1.0, testutil.ToFloat64(a.cfg.Metrics.realtime.turns.WithLabelValues("failed")))
	sessionUpdate(t, conn, "still here", "text")
}
