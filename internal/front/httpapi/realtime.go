package httpapi

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/coder/websocket"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	nooptrace "go.opentelemetry.io/otel/trace/noop"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// Realtime limits' defaults (RealtimeConfig).
const (
	DefaultRealtimeMaxSessions     = 256
	DefaultRealtimeIdleTimeout     = 10 * time.Minute
	DefaultRealtimeMaxMessageBytes = 1 << 20
	DefaultRealtimeHistoryBytes    = 32 << 10
	// DefaultRealtimeMaxInputAudioBytes bounds a session's input audio
	// buffer: OpenAI's 15 MiB.
	DefaultRealtimeMaxInputAudioBytes = 15 << 20
	// DefaultRealtimeMaxItems and DefaultRealtimeMaxItemsBytes bound a
	// session's conversation; the bytes hold a full input audio buffer's
	// commit (its WAV file) with room to spare.
	DefaultRealtimeMaxItems      = 1024
	DefaultRealtimeMaxItemsBytes = 16 << 20
	// DefaultRealtimeMemoryBudget bounds what every session of a head
	// holds together: half the head's default soft memory limit.
	DefaultRealtimeMemoryBudget = 256 << 20
	// realtimeSampleRate is the rate of troupe's audio/pcm, in and out.
	realtimeSampleRate = 24000
	// realtimeSubprotocol is the subprotocol browsers offer, and the
	// prefix of the one that carries the API key.
	realtimeSubprotocol = "realtime"
	realtimeKeyPrefix   = "openai-insecure-api-key."
)

// Span names of a realtime session (docs/contracts.md).
const (
	SpanRealtimeSession = "troupe.realtime.session"
	SpanRealtimeTurn    = "troupe.realtime.turn"
	// EventRealtimeCancel is the turn span's event at the time a cancel
	// (response.cancel, or speech detected) reached the head.
	EventRealtimeCancel = "cancel"
)

// RealtimeConfig bounds GET /v1/realtime. The zero value uses the defaults.
type RealtimeConfig struct {
	// MaxSessions is the most sessions the head holds at once; one more is
	// accepted and closed at once with 1013 (try again later). <= 0:
	// DefaultRealtimeMaxSessions.
	MaxSessions int
	// IdleTimeout closes (4000) a session that sent no event for this
	// long. <= 0: DefaultRealtimeIdleTimeout.
	IdleTimeout time.Duration
	// MaxMessageBytes bounds one client message; a bigger one closes the
	// session with 1009. <= 0: DefaultRealtimeMaxMessageBytes.
	MaxMessageBytes int64
	// HistoryBytes bounds the conversation sent to the thinker each turn
	// (the text of its items, and the WAV bytes of its audio items: 48000
	// a second); the oldest items are dropped first, the
	// newest user item always kept. <= 0: DefaultRealtimeHistoryBytes.
	HistoryBytes int
	// MaxItems and MaxItemsBytes bound the conversation a session holds
	// (MaxItemsBytes counts items' text and their audio's WAV files): an
	// item that would pass either drops the oldest items first, each
	// announced with conversation.item.deleted. <= 0: DefaultRealtimeMaxItems,
	// DefaultRealtimeMaxItemsBytes.
	MaxItems      int
	MaxItemsBytes int
	// MaxInputAudioBytes bounds a session's input audio buffer; an append
	// past it is refused (input_audio_buffer_full) and the buffer kept. At
	// most MaxItemsBytes less a WAV header, so that a full buffer's commit
	// fits the conversation. <= 0: DefaultRealtimeMaxInputAudioBytes.
	MaxInputAudioBytes int
	// MemoryBudget bounds the bytes of every session of the Server
	// together (their items and input buffers); what would pass it is
	// refused (memory_budget_exceeded). <= 0: DefaultRealtimeMemoryBudget.
	MemoryBudget int64
}

func (c RealtimeConfig) withDefaults() RealtimeConfig {
	if c.MaxSessions <= 0 {
		c.MaxSessions = DefaultRealtimeMaxSessions
	}
	if c.IdleTimeout <= 0 {
		c.IdleTimeout = DefaultRealtimeIdleTimeout
	}
	if c.MaxMessageBytes <= 0 {
		c.MaxMessageBytes = DefaultRealtimeMaxMessageBytes
	}
	if c.HistoryBytes <= 0 {
		c.HistoryBytes = DefaultRealtimeHistoryBytes
	}
	if c.MaxItems <= 0 {
		c.MaxItems = DefaultRealtimeMaxItems
	}
	if c.MaxItemsBytes <= 0 {
		c.MaxItemsBytes = DefaultRealtimeMaxItemsBytes
	}
	if c.MaxInputAudioBytes <= 0 {
		c.MaxInputAudioBytes = DefaultRealtimeMaxInputAudioBytes
	}
	c.MaxInputAudioBytes = max(2, min(c.MaxInputAudioBytes, c.MaxItemsBytes-wavHeaderSize))
	if c.MemoryBudget <= 0 {
		c.MemoryBudget = DefaultRealtimeMemoryBudget
	}
	return c
}

// realtimeHub is a Server's realtime sessions: their count, their memory
// budget and, for the drain, a way to close each.
type realtimeHub struct {
	budget   rtBudget // realtime_memory.go
	mu       sync.Mutex
	sessions map[*rtSessionConn]struct{}
	draining bool
	// gone is closed once the hub drains and holds no session.
	gone chan struct{}
}

// realtimeMetrics are the realtime sessions' metrics (docs/observability.md).
type realtimeMetrics struct {
	active        prometheus.Gauge
	turns         *prometheus.CounterVec
	bargeIns      prometheus.Counter
	cancelLatency prometheus.Histogram
	firstAudio    prometheus.Histogram
	buffered      prometheus.Gauge
	limitHits     *prometheus.CounterVec
}

func newRealtimeMetrics() *realtimeMetrics {
	m := &realtimeMetrics{
		active: prometheus.NewGauge(prometheus.GaugeOpts{Name: "troupe_realtime_sessions_active",
			Help: "Realtime (WebSocket) sessions the head holds now."}),
		turns: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "troupe_realtime_turns_total",
			Help: "Realtime responses finished, by status (completed, cancelled, failed)."}, []string{"status"}),
		bargeIns: prometheus.NewCounter(prometheus.CounterOpts{Name: "troupe_realtime_barge_ins_total",
			Help: "Realtime responses cut short by the client: response.cancel or speech detected while one ran."}),
		cancelLatency: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "troupe_realtime_cancel_latency_seconds",
			Help:    "Time from a realtime cancel (event or detected speech) to every stage of the response stopped.",
			Buckets: []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1}}),
		firstAudio: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "troupe_realtime_time_to_first_audio_seconds",
			Help:    "Time from response.create to the response's first audio delta sent.",
			Buckets: httpDurationBuckets}),
		buffered: prometheus.NewGauge(prometheus.GaugeOpts{Name: "troupe_realtime_buffered_bytes",
			Help: "Bytes realtime sessions hold now (conversation items and input audio buffers), against --realtime-memory-budget."}),
		limitHits: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "troupe_realtime_limit_hits_total",
			Help: "Realtime memory limits acting: items dropped to make room (item_dropped), and events refused (input_audio, item_too_large, budget)."}, []string{"limit"}),
	}
	for _, limit := range []string{limitDropped, limitInputAudio, limitItemTooLarge, limitBudget} {
		m.limitHits.WithLabelValues(limit)
	}
	for _, status := range []string{"completed", "cancelled", "failed"} {
		m.turns.WithLabelValues(status) // every status exists from the start, at 0
	}
	return m
}

func (m *realtimeMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.active, m.turns, m.bargeIns, m.cancelLatency, m.firstAudio, m.buffered, m.limitHits}
}

// realtimeKey returns the API key a browser sends as the subprotocol
// "openai-insecure-api-key.<key>" ("" when none): the middleware accepts it
// on /v1/realtime in place of the Authorization header.
func realtimeKey(r *http.Request) string {
	if r.URL.Path != "/v1/realtime" {
		return ""
	}
	for _, h := range r.Header.Values("Sec-WebSocket-Protocol") {
		for p := range strings.SplitSeq(h, ",") {
			if k, ok := strings.CutPrefix(strings.TrimSpace(p), realtimeKeyPrefix); ok {
				return k
			}
		}
	}
	return ""
}

// Errors that end a response: the cause of its context's cancel.
var (
	errClientCancel = errors.New("httpapi: response.cancel")
	errTurnDetected = errors.New("httpapi: speech detected while the response ran")
	errSessionEnded = errors.New("httpapi: the session ended")
)

// realtime serves GET /v1/realtime: it upgrades to a WebSocket and runs one
// session until either side closes it.
func (s *Server) realtime(w http.ResponseWriter, r *http.Request) {
	cfg := s.cfg.Realtime.withDefaults()
	conn, err := websocket.Accept(w, r, &websocket.AcceptOptions{
		Subprotocols:    []string{realtimeSubprotocol},
		CompressionMode: websocket.CompressionDisabled,
		// Browsers send an Origin; the API key, not the origin, admits a
		// client (as for every other route).
		InsecureSkipVerify: true,
	})
	if err != nil {
		return // Accept has answered
	}
	defer conn.CloseNow()
	c := &rtSessionConn{s: s, conn: conn, cfg: cfg, id: "sess_" + newResponseID()[:24], voice: "alloy",
		modalities: []string{"audio"}, away: make(chan struct{}), turnDetection: &rtTurnDetection{Type: "server_vad"}}
	if ok, draining := s.rt.add(c, cfg.MaxSessions); !ok {
		why := fmt.Sprintf("the head is at its limit of %d realtime sessions; retry shortly", cfg.MaxSessions)
		if draining {
			why = "the head is draining (stopping); connect again, to another head"
		}
		_ = conn.Close(closeTryAgain, why)
		return
	}
	defer s.rt.remove(c)
	if m := s.rtMetrics(); m != nil {
		m.active.Inc()
		defer m.active.Dec()
	}
	conn.SetReadLimit(cfg.MaxMessageBytes)
	tp := s.cfg.TracerProvider
	if tp == nil {
		tp = nooptrace.NewTracerProvider()
	}
	c.tracer = tp.Tracer("troupe/httpapi")
	ctx, span := c.tracer.Start(r.Context(), SpanRealtimeSession, trace.WithAttributes(attribute.String("troupe.realtime.session_id", c.id)))
	defer span.End()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	c.run(ctx)
	c.release() // every response has ended (run waits for them)
}

// rtMetrics is nil without Config.Metrics.
func (s *Server) rtMetrics() *realtimeMetrics {
	if s.cfg.Metrics == nil {
		return nil
	}
	return s.cfg.Metrics.realtime
}

func (h *realtimeHub) add(c *rtSessionConn, limit int) (ok, draining bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.draining || len(h.sessions) >= limit {
		return false, h.draining
	}
	if h.sessions == nil {
		h.sessions = map[*rtSessionConn]struct{}{}
	}
	h.sessions[c] = struct{}{}
	return true, false
}

func (h *realtimeHub) remove(c *rtSessionConn) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.sessions, c)
	h.closeGoneLocked()
}

func (h *realtimeHub) closeGoneLocked() {
	if h.draining && len(h.sessions) == 0 {
		select {
		case <-h.gone:
		default:
			close(h.gone)
		}
	}
}

// drain closes every session with 1001 once its running response (if any)
// has finished, and refuses new ones with 1013.
func (h *realtimeHub) drain() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.draining {
		h.draining, h.gone = true, make(chan struct{})
	}
	for c := range h.sessions {
		c.goAway()
	}
	h.closeGoneLocked()
}

// WaitRealtime waits, after Drain, until every realtime session has ended
// (net/http's Shutdown does not wait for them: their connections are
// hijacked). When ctx ends first, it drops the connections of the sessions
// left, which end their responses on every stage, and returns ctx's error.
// Before Drain it returns at once.
func (s *Server) WaitRealtime(ctx context.Context) error {
	s.rt.mu.Lock()
	gone := s.rt.gone
	s.rt.mu.Unlock()
	if gone == nil {
		return nil
	}
	select {
	case <-gone:
		return nil
	case <-ctx.Done():
	}
	s.rt.mu.Lock()
	defer s.rt.mu.Unlock()
	for c := range s.rt.sessions {
		_ = c.conn.CloseNow()
	}
	return fmt.Errorf("httpapi: realtime sessions still open at the drain timeout: %w", ctx.Err())
}

// rtSessionConn is one realtime session. The handler's goroutine reads and
// handles the client's events; each response runs in a goroutine of its
// own that the session waits for before it ends.
type rtSessionConn struct {
	s      *Server
	conn   *websocket.Conn
	cfg    RealtimeConfig
	id     string
	tracer trace.Tracer
	seq    atomic.Uint64

	mu            sync.Mutex // guards the fields below
	instructions  string
	modalities    []string
	voice         string
	turnDetection *rtTurnDetection // nil: none
	items         []*historyItem
	// byID is the last item of each id in items, so that an event naming
	// an item finds it without a walk of the whole conversation.
	byID map[string]*historyItem
	turn *rtTurn // the running response; nil when none
	// lastDone is closed when the latest response has sent its last
	// event: the next one waits for it, so responses never interleave.
	lastDone  chan struct{}
	goingAway bool          // drain: close once no response runs
	away      chan struct{} // closed by goAway
	// audioIn is the input audio buffer; its capacity is taken from the
	// budget (growBufferLocked).
	audioIn []byte
	vad     *vad
	// itemBytes is the sum of items' held bytes (realtime_memory.go).
	itemBytes int
}

// historyItem is one message of the conversation.
type historyItem struct {
	id, role, text string
	// parts is, for a user item with audio, its parts in order as a chat
	// request's content carries them: each input_audio part a WAV file
	// (PCM16 24 kHz mono), each text part as text (text joins them too).
	// A committed input audio buffer is one audio part and no text. nil:
	// text only.
	parts []*stagepb.ContentPart
	// audioMs is the audio the client received of an assistant item.
	audioMs int64
	// held is the bytes the session counts for the item (memBytes when it
	// was admitted), and in whether it is in the conversation; both are
	// the session's, under its mu.
	held int
	in   bool
}

// rtTurn is a running response.
type rtTurn struct {
	id       string
	item     *historyItem
	cancel   context.CancelCauseFunc
	done     chan struct{}
	cancelAt atomic.Int64 // unix nanos of the cancel; 0: none
}

func (c *rtSessionConn) run(ctx context.Context) {
	ctx, cancel := context.WithCancel(ctx)
	idle := time.NewTimer(c.cfg.IdleTimeout) // reset by every client event
	defer idle.Stop()
	var watcher sync.WaitGroup
	watcher.Go(func() { c.watch(ctx, idle.C) })
	defer watcher.Wait()
	defer cancel()
	defer c.endTurn()
	c.send(ctx, &serverEvent{Type: "session.created", Session: c.session()})
	for {
		_, data, err := c.conn.Read(ctx)
		if err != nil {
			return
		}
		idle.Reset(c.cfg.IdleTimeout)
		c.handle(ctx, data)
	}
}

// watch closes the session when it has been idle too long (4000), or when
// the head drains and no response runs (1001; a running response's end
// closes a busy session). It returns when it has closed it or ctx ends.
func (c *rtSessionConn) watch(ctx context.Context, idle <-chan time.Time) {
	away := c.away
	for {
		select {
		case <-idle:
			_ = c.conn.Close(closeIdle, fmt.Sprintf("idle timeout: no client event for %s", c.cfg.IdleTimeout))
			return
		case <-away:
			away = nil // a busy session: keep watching for idleness
			c.mu.Lock()
			busy := c.turn != nil
			c.mu.Unlock()
			if !busy {
				c.closeGoingAway()
				return
			}
		case <-ctx.Done():
			return
		}
	}
}

// endTurn cancels the running response, if any, and waits until every
// response has sent its last event (each waits for the one before it).
func (c *rtSessionConn) endTurn() {
	c.mu.Lock()
	t, last := c.turn, c.lastDone
	c.mu.Unlock()
	if t != nil {
		t.cancel(errSessionEnded)
	}
	if last != nil {
		<-last
	}
}

// goAway closes the session with 1001 now (its watcher, in run), or when
// its response ends. The caller holds the hub's lock.
func (c *rtSessionConn) goAway() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.goingAway {
		c.goingAway = true
		close(c.away)
	}
}

func (c *rtSessionConn) closeGoingAway() {
	_ = c.conn.Close(closeGoingAway, "the head is shutting down; reconnect")
}

// send writes one event; a write that fails or stalls for
// WriteStallTimeout ends the connection (the reader then ends the session).
func (c *rtSessionConn) send(ctx context.Context, ev *serverEvent) {
	ev.EventID = "event_" + c.id[5:13] + strconv.FormatUint(c.seq.Add(1), 10)
	data, err := json.Marshal(ev)
	if err != nil {
		panic(fmt.Sprintf("httpapi: encoding a realtime event: %v", err)) // every field is encodable
	}
	wctx, cancel := context.WithTimeout(ctx, c.s.cfg.WriteStallTimeout)
	defer cancel()
	if err := c.conn.Write(wctx, websocket.MessageText, data); err != nil {
		_ = c.conn.CloseNow()
	}
}

// fail sends an error event about the client event ev.
func (c *rtSessionConn) fail(ctx context.Context, ev *clientEvent, code, param, format string, args ...any) {
	e := &rtError{Type: typeInvalidRequest, Code: code, Message: fmt.Sprintf(format, args...)}
	if param != "" {
		e.Param = &param
	}
	if ev != nil {
		e.EventID = ev.EventID
	}
	c.send(ctx, &serverEvent{Type: "error", Error: e})
}

func (c *rtSessionConn) session() *rtSession {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.sessionLocked()
}

func (c *rtSessionConn) sessionLocked() *rtSession {
	instr, voice := c.instructions, c.voice
	td := c.turnDetection
	pcm := &rtFormat{Type: "audio/pcm", Rate: realtimeSampleRate}
	return &rtSession{Type: "realtime", Object: "realtime.session", ID: c.id, Model: c.s.b.Pipeline().Model,
		Instructions: &instr, OutputModalities: c.modalities,
		Audio: &rtSessionAudio{Input: &rtAudioIn{Format: pcm, TurnDetection: &td}, Output: &rtAudioOut{Format: pcm, Voice: &voice}}}
}

// handle answers one client message.
func (c *rtSessionConn) handle(ctx context.Context, data []byte) {
	var ev clientEvent
	if err := json.Unmarshal(data, &ev); err != nil {
		c.fail(ctx, nil, "invalid_json", "", "the event is not valid JSON, or a field has the wrong type: %v", err)
		return
	}
	switch ev.Type {
	case "session.update":
		c.sessionUpdate(ctx, &ev)
	case "conversation.item.create":
		c.itemCreate(ctx, &ev)
	case "conversation.item.truncate":
		c.itemTruncate(ctx, &ev)
	case "conversation.item.delete":
		c.itemDelete(ctx, &ev)
	case "response.create":
		c.responseCreate(ctx, &ev)
	case "response.cancel":
		c.mu.Lock()
		t := c.turn
		c.mu.Unlock()
		if t == nil {
			c.fail(ctx, &ev, "response_cancel_not_active", "", "response.cancel: no response is in progress")
			return
		}
		c.cancelTurn(t, errClientCancel)
	case "input_audio_buffer.append":
		c.audioAppend(ctx, &ev)
	case "input_audio_buffer.commit":
		c.audioCommit(ctx, &ev)
	case "input_audio_buffer.clear":
		c.mu.Lock()
		c.dropBufferLocked()
		c.mu.Unlock()
		c.send(ctx, &serverEvent{Type: "input_audio_buffer.cleared"})
	case "":
		c.fail(ctx, &ev, "missing_field", "type", "the event has no type")
	default:
		c.fail(ctx, &ev, "unknown_event", "type", "unsupported event type %q (docs/api.md lists the realtime events troupe speaks)", ev.Type)
	}
}

// cancelTurn cancels t, counting a barge-in and timing the stop.
func (c *rtSessionConn) cancelTurn(t *rtTurn, cause error) {
	if t.cancelAt.CompareAndSwap(0, time.Now().UnixNano()) {
		if m := c.s.rtMetrics(); m != nil {
			m.bargeIns.Inc()
		}
	}
	t.cancel(cause)
}

func (c *rtSessionConn) sessionUpdate(ctx context.Context, ev *clientEvent) {
	var u rtSession
	if len(ev.Session) == 0 {
		c.fail(ctx, ev, "missing_field", "session", "session.update needs a session")
		return
	}
	if err := json.Unmarshal(ev.Session, &u); err != nil {
		c.fail(ctx, ev, "invalid_value", "session", "invalid session: %v", err)
		return
	}
	if u.Type != "" && u.Type != "realtime" {
		c.fail(ctx, ev, "invalid_value", "session.type", "session type %q is not supported: only realtime", u.Type)
		return
	}
	for _, m := range u.OutputModalities {
		if m != "text" && m != "audio" {
			c.fail(ctx, ev, "invalid_value", "session.output_modalities", "unknown output modality %q: expected text or audio", m)
			return
		}
	}
	if len(u.OutputModalities) > 1 {
		c.fail(ctx, ev, "invalid_value", "session.output_modalities", "output_modalities takes one of text or audio")
		return
	}
	var td **rtTurnDetection
	if a := u.Audio; a != nil {
		for _, f := range []struct {
			param string
			f     *rtFormat
		}{{"session.audio.input.format", formatOf(a.Input)}, {"session.audio.output.format", formatOfOut(a.Output)}} {
			if f.f != nil && (f.f.Type != "audio/pcm" || (f.f.Rate != 0 && f.f.Rate != realtimeSampleRate)) {
				c.fail(ctx, ev, "invalid_value", f.param, "troupe's realtime audio is audio/pcm at %d Hz", realtimeSampleRate)
				return
			}
		}
		if a.Input != nil && a.Input.TurnDetection != nil {
			td = a.Input.TurnDetection
			if *td != nil && (*td).Type != "server_vad" {
				c.fail(ctx, ev, "invalid_value", "session.audio.input.turn_detection.type", "turn detection %q is not supported: server_vad or null", (*td).Type)
				return
			}
		}
	}
	c.mu.Lock()
	if u.Instructions != nil {
		c.instructions = *u.Instructions
	}
	if len(u.OutputModalities) > 0 {
		c.modalities = u.OutputModalities
	}
	if u.Audio != nil && u.Audio.Output != nil && u.Audio.Output.Voice != nil {
		c.voice = *u.Audio.Output.Voice
	}
	if td != nil {
		c.turnDetection, c.vad = *td, nil
	}
	s := c.sessionLocked()
	c.mu.Unlock()
	c.send(ctx, &serverEvent{Type: "session.updated", Session: s})
}

func formatOf(in *rtAudioIn) *rtFormat {
	if in == nil {
		return nil
	}
	return in.Format
}

func formatOfOut(out *rtAudioOut) *rtFormat {
	if out == nil {
		return nil
	}
	return out.Format
}

func (c *rtSessionConn) itemCreate(ctx context.Context, ev *clientEvent) {
	it := ev.Item
	if it == nil {
		c.fail(ctx, ev, "missing_field", "item", "conversation.item.create needs an item")
		return
	}
	if it.Type != "message" {
		c.fail(ctx, ev, "invalid_value", "item.type", "item type %q is not supported: only message", it.Type)
		return
	}
	switch it.Role {
	case "user", "system", "assistant":
	default:
		c.fail(ctx, ev, "invalid_value", "item.role", "unknown role %q: expected user, system or assistant", it.Role)
		return
	}
	var texts []string
	var parts []*stagepb.ContentPart
	audioBytes := 0
	content := make([]rtContent, 0, len(it.Content))
	for i, p := range it.Content {
		switch p.Type {
		case "input_text", "text", "output_text":
			texts = append(texts, p.Text)
			parts = append(parts, &stagepb.ContentPart{Kind: stagepb.PartText, Text: p.Text})
		case "input_audio":
			if it.Role != "user" {
				c.fail(ctx, ev, "invalid_value", fmt.Sprintf("item.content[%d].type", i), "input_audio is a user message's part, not a %s one", it.Role)
				return
			}
			b, err := base64.StdEncoding.DecodeString(p.Audio)
			if err != nil {
				c.fail(ctx, ev, "invalid_base64", fmt.Sprintf("item.content[%d].audio", i), "audio is not valid base64: %v", err)
				return
			}
			if code, msg := rtAudioProblem(b); code != "" {
				c.fail(ctx, ev, code, fmt.Sprintf("item.content[%d].audio", i), "%s", msg)
				return
			}
			if audioBytes+len(b) > c.cfg.MaxInputAudioBytes {
				c.fail(ctx, ev, "invalid_value", fmt.Sprintf("item.content[%d].audio", i), "an item holds at most %d bytes of audio", c.cfg.MaxInputAudioBytes)
				return
			}
			audioBytes += len(b)
			wav, err := appendWAV(nil, b, realtimeSampleRate)
			if err != nil {
				panic(fmt.Sprintf("httpapi: %v", err)) // the message limit keeps the audio far below RIFF's 4 GiB
			}
			parts = append(parts, &stagepb.ContentPart{Kind: stagepb.PartAudio, Data: wav, Format: "wav"})
		case "audio", "output_audio":
			// An assistant's audio is kept as its transcript, as the
			// assistant items troupe makes are.
			if p.Transcript != nil {
				texts = append(texts, *p.Transcript)
				parts = append(parts, &stagepb.ContentPart{Kind: stagepb.PartText, Text: *p.Transcript})
			}
		default:
			c.fail(ctx, ev, "invalid_value", fmt.Sprintf("item.content[%d].type", i), "unknown content type %q", p.Type)
			return
		}
		p.Audio = "" // the item shown does not echo the audio back
		content = append(content, p)
	}
	h := &historyItem{id: it.ID, role: it.Role, text: strings.Join(texts, "\n")}
	if h.id == "" {
		h.id = "item_" + newResponseID()[:24]
	}
	if audioBytes > 0 {
		h.parts = parts // as a chat request with a media part carries them
		var pe *orchestrator.PartError
		if refused := c.s.b.CheckParts([]*stagepb.ChatMessage{h.message()}); errors.As(refused, &pe) {
			c.fail(ctx, ev, "audio_input_unsupported", "item.content", "audio input needs a pipeline whose first stage takes audio: stage %q takes no audio parts; send the user's words as an input_text item", pe.Stage)
			return
		}
	}
	prev, ok := c.keepItem(ctx, ev, h, 0, nil)
	if !ok {
		return
	}
	out := &rtItem{ID: h.id, Object: "realtime.item", Type: "message", Status: "completed", Role: h.role, Content: content}
	c.send(ctx, &serverEvent{Type: "conversation.item.added", PreviousItemID: prev, Item: out})
	c.send(ctx, &serverEvent{Type: "conversation.item.done", PreviousItemID: prev, Item: out})
}

// keepItem adds h, a new item, to the conversation and returns the
// previous item's id, once it has announced the items dropped to make room
// (conversation.item.deleted). credit is bytes the caller took from the
// budget for it; kept, when not nil, runs under c.mu once h is kept. When
// h cannot be kept it sends an error event about ev and reports false.
func (c *rtSessionConn) keepItem(ctx context.Context, ev *clientEvent, h *historyItem, credit int64, kept func()) (*string, bool) {
	c.mu.Lock()
	dropped, lim := c.admitLocked(h, h.memBytes(), true, credit)
	var prev *string
	if lim == nil {
		if n := len(c.items); n > 1 {
			prev = &c.items[n-2].id
		}
		if kept != nil {
			kept()
		}
	}
	c.mu.Unlock()
	if lim != nil {
		c.fail(ctx, ev, lim.code, "", "%s", lim.msg)
		return nil, false
	}
	c.announce(ctx, dropped)
	return prev, true
}

// announce tells the client of items dropped from the conversation.
func (c *rtSessionConn) announce(ctx context.Context, dropped []*historyItem) {
	for _, it := range dropped {
		c.send(ctx, &serverEvent{Type: "conversation.item.deleted", ItemID: it.id})
	}
}

// itemDelete deletes an item the client names (conversation.item.delete):
// any but the running response's.
func (c *rtSessionConn) itemDelete(ctx context.Context, ev *clientEvent) {
	c.mu.Lock()
	h := c.byID[ev.ItemID]
	if h == nil || (c.turn != nil && c.turn.item == h) {
		c.mu.Unlock()
		c.fail(ctx, ev, "invalid_value", "item_id", "no item %q to delete (the running response's item is deleted once it is done)", ev.ItemID)
		return
	}
	c.removeLocked(h)
	c.mu.Unlock()
	c.send(ctx, &serverEvent{Type: "conversation.item.deleted", ItemID: h.id})
}

func (c *rtSessionConn) lastItemIDLocked() *string {
	if n := len(c.items); n > 0 {
		return &c.items[n-1].id
	}
	return nil
}

// itemTruncate keeps of an assistant item the text the client heard: the
// share of the transcript that audio_end_ms is of the audio sent.
func (c *rtSessionConn) itemTruncate(ctx context.Context, ev *clientEvent) {
	if ev.AudioEndMs == nil || *ev.AudioEndMs < 0 {
		c.fail(ctx, ev, "missing_field", "audio_end_ms", "conversation.item.truncate needs audio_end_ms >= 0")
		return
	}
	c.mu.Lock()
	h := c.byID[ev.ItemID]
	running := c.turn != nil && c.turn.item == h
	if h == nil || h.role != "assistant" || running || *ev.AudioEndMs > h.audioMs {
		c.mu.Unlock()
		c.fail(ctx, ev, "invalid_value", "item_id", "no finished assistant item %q with %d ms of audio", ev.ItemID, *ev.AudioEndMs)
		return
	}
	if h.audioMs > 0 {
		runes := []rune(h.text)
		h.text = string(runes[:int64(len(runes))**ev.AudioEndMs/h.audioMs])
		h.audioMs = *ev.AudioEndMs
		c.shrinkLocked(h)
	}
	c.mu.Unlock()
	zero := 0
	c.send(ctx, &serverEvent{Type: "conversation.item.truncated", ItemID: h.id, ContentIndex: &zero, AudioEndMs: ev.AudioEndMs})
}

func (c *rtSessionConn) audioAppend(ctx context.Context, ev *clientEvent) {
	if ev.Audio == nil {
		c.fail(ctx, ev, "missing_field", "audio", "input_audio_buffer.append needs audio")
		return
	}
	pcm, err := base64.StdEncoding.DecodeString(*ev.Audio)
	if err != nil {
		c.fail(ctx, ev, "invalid_base64", "audio", "audio is not valid base64: %v", err)
		return
	}
	if code, msg := rtAudioProblem(pcm); code != "" {
		c.fail(ctx, ev, code, "audio", "%s", msg)
		return
	}
	c.mu.Lock()
	if lim := c.growBufferLocked(len(pcm)); lim != nil {
		c.mu.Unlock()
		c.fail(ctx, ev, lim.code, "audio", "%s", lim.msg)
		return
	}
	c.audioIn = append(c.audioIn, pcm...)
	td, v := c.turnDetection, c.vad
	if td != nil && v == nil {
		v = newVAD(realtimeSampleRate, td)
		c.vad = v
	}
	turn := c.turn
	c.mu.Unlock()
	if v == nil {
		return
	}
	var events []vadEvent
	v.feed(pcm, func(e vadEvent) { events = append(events, e) })
	for _, e := range events {
		switch e {
		case vadStarted:
			ms := v.startMs
			c.send(ctx, &serverEvent{Type: "input_audio_buffer.speech_started", AudioStartMs: &ms})
			if turn != nil && (td.InterruptResponse == nil || *td.InterruptResponse) {
				c.cancelTurn(turn, errTurnDetected)
			}
		case vadStopped:
			ms := v.stopMs
			c.send(ctx, &serverEvent{Type: "input_audio_buffer.speech_stopped", AudioEndMs: &ms})
			if c.audioCommit(ctx, nil) && (td.CreateResponse == nil || *td.CreateResponse) {
				c.autoRespond(ctx)
			}
		}
	}
}

// rtAudioProblem checks audio a session takes as raw PCM16 (an append, an
// input_audio item part): the error event's code and message, or "" when
// it is whole samples. A WAV (or other audio) file is refused rather than
// heard header and all.
func rtAudioProblem(b []byte) (code, msg string) {
	switch c := containerOf(b); {
	case c != "":
		return "invalid_audio", fmt.Sprintf("audio must be PCM16 mono at %d Hz (audio/pcm), not a %s file: send the samples without the file's header", realtimeSampleRate, c)
	case len(b) == 0 || len(b)%2 != 0:
		return "invalid_value", fmt.Sprintf("audio must be PCM16 mono at %d Hz (audio/pcm): a non-empty, even number of bytes (got %d)", realtimeSampleRate, len(b))
	}
	return "", ""
}

// audioCommit commits the input audio buffer (ev is nil for server VAD's
// commit): a user message item of one input_audio part, the buffer's PCM as
// a WAV file, which reaches the thinker as a chat request's input_audio
// part does. It reports whether the item was kept. A pipeline whose stage 0
// does not take audio (the head's refusal, Backend.CheckParts) gets the
// commit followed by an audio_input_unsupported error, and the item is not
// kept.
func (c *rtSessionConn) audioCommit(ctx context.Context, ev *clientEvent) bool {
	c.mu.Lock()
	n := len(c.audioIn)
	var wav []byte
	var err error
	if n > 0 {
		wav, err = appendWAV(nil, c.audioIn, realtimeSampleRate)
	}
	credit := int64(cap(c.audioIn)) // the buffer's bytes become the item's
	c.mu.Unlock()
	if n == 0 {
		c.fail(ctx, ev, "input_audio_buffer_commit_empty", "", "the input audio buffer is empty")
		return false
	}
	if err != nil {
		panic(fmt.Sprintf("httpapi: %v", err)) // MaxInputAudioBytes keeps the buffer far below RIFF's 4 GiB
	}
	h := &historyItem{id: "item_" + newResponseID()[:24], role: "user",
		parts: []*stagepb.ContentPart{{Kind: stagepb.PartAudio, Data: wav, Format: "wav"}}}
	var pe *orchestrator.PartError
	if refused := c.s.b.CheckParts([]*stagepb.ChatMessage{h.message()}); errors.As(refused, &pe) {
		c.mu.Lock()
		c.dropBufferLocked()
		prev := c.lastItemIDLocked()
		c.mu.Unlock()
		c.send(ctx, &serverEvent{Type: "input_audio_buffer.committed", ItemID: h.id, PreviousItemID: prev})
		c.fail(ctx, ev, "audio_input_unsupported", "", "audio input needs a pipeline whose first stage takes audio: stage %q takes no audio parts; send the user's words as an input_text item", pe.Stage)
		return false
	}
	// Only this goroutine (the session's reader) changes the buffer, so it
	// is still what the WAV was made of. A commit that cannot be kept
	// leaves the buffer as it was.
	prev, ok := c.keepItem(ctx, ev, h, credit, func() {
		c.audioIn = nil
		if c.vad != nil {
			c.vad.reset()
		}
	})
	if !ok {
		return false
	}
	c.send(ctx, &serverEvent{Type: "input_audio_buffer.committed", ItemID: h.id, PreviousItemID: prev})
	out := &rtItem{ID: h.id, Object: "realtime.item", Type: "message", Status: "completed", Role: "user", Content: []rtContent{{Type: "input_audio"}}}
	c.send(ctx, &serverEvent{Type: "conversation.item.added", PreviousItemID: prev, Item: out})
	c.send(ctx, &serverEvent{Type: "conversation.item.done", PreviousItemID: prev, Item: out})
	return true
}

// autoRespond starts the response to speech server VAD committed. A
// response the speech cancelled (barge-in) is waited for first; one that
// still runs (interrupt_response false) keeps the floor, and none starts.
func (c *rtSessionConn) autoRespond(ctx context.Context) {
	c.mu.Lock()
	t := c.turn
	c.mu.Unlock()
	if t != nil {
		if t.cancelAt.Load() == 0 {
			return
		}
		select {
		case <-t.done:
		case <-ctx.Done():
			return
		}
	}
	c.responseCreate(ctx, nil)
}

func (c *rtSessionConn) responseCreate(ctx context.Context, ev *clientEvent) {
	c.mu.Lock()
	if c.turn != nil {
		c.mu.Unlock()
		c.fail(ctx, ev, "conversation_already_has_active_response", "", "a response is already in progress: wait for response.done or send response.cancel")
		return
	}
	if c.goingAway {
		c.mu.Unlock()
		c.fail(ctx, ev, "shutting_down", "", "the head is shutting down: reconnect to start a response")
		return
	}
	msgs, prompt := c.conversationLocked()
	audio := len(c.modalities) == 1 && c.modalities[0] == "audio"
	modalities, voice := c.modalities, c.voice
	tctx, cancel := context.WithCancelCause(ctx)
	t := &rtTurn{id: "resp_" + newResponseID()[:24], cancel: cancel, done: make(chan struct{}),
		item: &historyItem{id: "item_" + newResponseID()[:24], role: "assistant"}}
	c.turn = t
	after := c.lastDone
	c.lastDone = t.done
	c.mu.Unlock()
	go c.runTurn(ctx, tctx, t, after, msgs, prompt, audio, modalities, voice)
}

// message is the item as a chat request's message: its text, and with
// audio its parts, each input_audio one of format wav (content.go's
// decoding).
func (h *historyItem) message() *stagepb.ChatMessage {
	m := &stagepb.ChatMessage{Role: h.role, Content: h.text}
	m.Parts = h.parts
	return m
}

// size is what the item counts against HistoryBytes: its text's bytes and
// its WAV files'.
func (h *historyItem) size() int {
	n := len(h.text)
	for _, p := range h.parts {
		n += len(p.GetData())
	}
	return n
}

// conversationLocked is what the thinker gets: the instructions as the
// system message, then the newest items whose size fits HistoryBytes
// (whole items, oldest dropped first; the newest item always), rendered as
// a chat request's messages are (chatPrompt).
func (c *rtSessionConn) conversationLocked() ([]*stagepb.ChatMessage, string) {
	budget, first := c.cfg.HistoryBytes, len(c.items)
	for first > 0 {
		n := c.items[first-1].size()
		if first < len(c.items) && n > budget {
			break
		}
		budget -= n
		first--
	}
	var msgs []*stagepb.ChatMessage
	if c.instructions != "" {
		msgs = append(msgs, &stagepb.ChatMessage{Role: "system", Content: c.instructions})
	}
	for _, it := range c.items[first:] {
		msgs = append(msgs, it.message())
	}
	var b strings.Builder
	for i, m := range msgs {
		if i > 0 {
			b.WriteByte('\n')
		}
		b.WriteString(m.Role)
		b.WriteString(": ")
		b.WriteString(m.Content)
	}
	return msgs, b.String()
}

// runTurn runs one response through the pipeline, streamed as a chat
// request with audio is, and reports it; the session waits for it.
//
// Events go out on the session's context sctx: a cancelled response still
// reports its end. Nothing of a response is sent once it is cancelled, so
// its item keeps exactly what the client was sent.
func (c *rtSessionConn) runTurn(sctx, ctx context.Context, t *rtTurn, after <-chan struct{}, msgs []*stagepb.ChatMessage, prompt string, audio bool, modalities []string, voice string) {
	defer close(t.done)
	if after != nil {
		<-after // the previous response's events all go out first
	}
	start := time.Now()
	ctx, span := c.tracer.Start(ctx, SpanRealtimeTurn, trace.WithAttributes(attribute.String("troupe.realtime.response_id", t.id)))
	defer span.End()
	ev := turnEvents{c: c, ctx: sctx, t: t, audio: audio}
	item := &rtItem{ID: t.item.id, Object: "realtime.item", Type: "message", Status: "in_progress", Role: "assistant", Content: []rtContent{}}
	c.send(sctx, &serverEvent{Type: "response.created", Response: &rtResponse{Object: "realtime.response", ID: t.id, Status: "in_progress", Output: []*rtItem{}, OutputModalities: modalities}})
	c.mu.Lock()
	dropped, _ := c.admitLocked(t.item, 0, true, 0) // an empty item: the others make room
	var prev *string
	if n := len(c.items); n > 1 {
		prev = &c.items[n-2].id
	}
	c.mu.Unlock()
	c.announce(sctx, dropped)
	c.send(sctx, &serverEvent{Type: "response.output_item.added", ResponseID: t.id, OutputIndex: &zeroIndex, Item: item})
	c.send(sctx, &serverEvent{Type: "conversation.item.added", PreviousItemID: prev, Item: item})
	ev.part("response.content_part.added", &rtContent{Type: ev.partType()})

	var text strings.Builder // stage 0's text sent, touched only by onText until Execute returns
	var audioBytes int       // touched only by OnAudio until Execute returns
	req := orchestrator.Request{ID: t.id, Prompt: prompt, Messages: msgs, Voice: voice, Stages: 1, SessionKey: c.id}
	if audio {
		req.Stages = len(c.s.b.Pipeline().Stages)
		req.OnAudio = func(pcm []byte, rate int) error {
			if err := ctx.Err(); err != nil {
				return err // nothing is sent after a cancel
			}
			if rate != realtimeSampleRate {
				return &apiError{Status: http.StatusBadGateway, Type: typeServer, Code: "unsupported_sample_rate",
					Message: fmt.Sprintf("the pipeline's audio is %d Hz; realtime sessions carry audio/pcm at %d Hz", rate, realtimeSampleRate)}
			}
			if m := c.s.rtMetrics(); m != nil && audioBytes == 0 {
				m.firstAudio.Observe(time.Since(start).Seconds())
			}
			audioBytes += len(pcm)
			ev.delta("response.output_audio.delta", base64.StdEncoding.EncodeToString(pcm))
			return nil
		}
	}
	rctx, cancel := context.WithTimeout(ctx, c.s.cfg.RequestTimeout)
	res, err := c.s.b.Execute(rctx, req, func(delta string) error {
		if err := ctx.Err(); err != nil || delta == "" {
			return err
		}
		text.WriteString(delta)
		ev.delta(ev.textDeltaType(), delta)
		return nil
	})
	timedOut := rctx.Err() != nil && ctx.Err() == nil
	cancel()
	if cancelAt := t.cancelAt.Load(); cancelAt != 0 {
		if m := c.s.rtMetrics(); m != nil {
			m.cancelLatency.Observe(time.Since(time.Unix(0, cancelAt)).Seconds())
		}
		// When the cancel reached the head: the workers' server spans under
		// the turn end when each stage's work stopped (BenchmarkRealtimeCancel).
		span.AddEvent(EventRealtimeCancel, trace.WithTimestamp(time.Unix(0, cancelAt)))
	}
	if err == nil && audio && audioBytes == 0 {
		err = errNoAudio
	}
	resp := c.turnOutcome(t, err, context.Cause(ctx), timedOut, res)
	resp.OutputModalities = modalities
	span.SetAttributes(attribute.String("troupe.realtime.status", resp.Status))
	if resp.Status == "failed" {
		span.SetStatus(codes.Error, err.Error())
	}

	// The item keeps what the client was sent, if the session's limits
	// and the budget let it (else it is deleted once it is done).
	said := text.String()
	c.mu.Lock()
	t.item.text, t.item.audioMs = said, int64(audioBytes/2)*1000/realtimeSampleRate
	lost := false
	if t.item.in {
		var lim *rtLimit
		if dropped, lim = c.admitLocked(t.item, t.item.memBytes()-t.item.held, false, 0); lim != nil {
			c.removeLocked(t.item)
			lost = true
		}
	}
	c.mu.Unlock()
	c.announce(sctx, dropped)
	resp.Output = []*rtItem{ev.end(prev, said, resp.Status)}
	if m := c.s.rtMetrics(); m != nil {
		m.turns.WithLabelValues(resp.Status).Inc()
	}
	c.mu.Lock()
	c.turn = nil
	away := c.goingAway
	c.mu.Unlock()
	c.send(sctx, &serverEvent{Type: "response.done", Response: resp})
	if lost {
		c.send(sctx, &serverEvent{Type: "conversation.item.deleted", ItemID: t.item.id})
	}
	if away {
		c.closeGoingAway()
	}
}

// turnOutcome is a finished turn's response: completed, cancelled (cause
// says by whom) or failed.
func (c *rtSessionConn) turnOutcome(t *rtTurn, err, cause error, timedOut bool, res *orchestrator.Result) *rtResponse {
	resp := &rtResponse{Object: "realtime.response", ID: t.id, Status: "completed"}
	switch {
	case err == nil:
	case errors.Is(cause, errClientCancel), errors.Is(cause, errTurnDetected), errors.Is(cause, errSessionEnded):
		reason := "client_cancelled"
		if errors.Is(cause, errTurnDetected) {
			reason = "turn_detected"
		}
		resp.Status, resp.StatusDetails = "cancelled", &rtStatusDetails{Type: "cancelled", Reason: reason}
	case timedOut:
		resp.Status, resp.StatusDetails = "failed", &rtStatusDetails{Type: "failed", Error: &rtError{Type: typeServer, Code: "timeout",
			Message: fmt.Sprintf("the response ran past the request timeout of %s", c.s.cfg.RequestTimeout)}}
	default:
		e := fromBackend(err, t.id)
		resp.Status, resp.StatusDetails = "failed", &rtStatusDetails{Type: "failed", Error: &rtError{Type: e.Type, Code: e.Code, Message: e.Message}}
	}
	if res != nil {
		resp.Usage = &rtUsage{InputTokens: res.PromptTokens, OutputTokens: res.CompletionTokens, TotalTokens: res.PromptTokens + res.CompletionTokens}
	}
	return resp
}

// zeroIndex is every output_index and content_index: a response has one
// item of one part.
var zeroIndex = 0

// turnEvents writes the events of one response's item and part.
type turnEvents struct {
	c     *rtSessionConn
	ctx   context.Context // the session's: a cancelled response still reports its end
	t     *rtTurn
	audio bool
}

func (e turnEvents) partType() string {
	if e.audio {
		return "audio"
	}
	return "text"
}

func (e turnEvents) textDeltaType() string {
	if e.audio {
		return "response.output_audio_transcript.delta"
	}
	return "response.output_text.delta"
}

func (e turnEvents) at(ev *serverEvent) {
	ev.ResponseID, ev.ItemID, ev.OutputIndex, ev.ContentIndex = e.t.id, e.t.item.id, &zeroIndex, &zeroIndex
	e.c.send(e.ctx, ev)
}

func (e turnEvents) delta(typ, delta string) { e.at(&serverEvent{Type: typ, Delta: delta}) }

func (e turnEvents) part(typ string, p *rtContent) { e.at(&serverEvent{Type: typ, Part: p}) }

// end sends the done events of the part and the item, which holds what was
// said, and returns the item.
func (e turnEvents) end(prev *string, said, status string) *rtItem {
	part := rtContent{Type: e.partType()}
	if e.audio {
		part.Transcript = &said
		e.at(&serverEvent{Type: "response.output_audio.done"})
		e.at(&serverEvent{Type: "response.output_audio_transcript.done", Transcript: &said})
	} else {
		part.Text = said
		e.at(&serverEvent{Type: "response.output_text.done", Text: &said})
	}
	e.part("response.content_part.done", &part)
	itemStatus := "completed"
	if status != "completed" {
		itemStatus = "incomplete"
	}
	done := &rtItem{ID: e.t.item.id, Object: "realtime.item", Type: "message", Status: itemStatus, Role: "assistant", Content: []rtContent{part}}
	e.c.send(e.ctx, &serverEvent{Type: "response.output_item.done", ResponseID: e.t.id, OutputIndex: &zeroIndex, Item: done})
	e.c.send(e.ctx, &serverEvent{Type: "conversation.item.done", PreviousItemID: prev, Item: done})
	return done
}
