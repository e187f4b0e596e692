package httpapi

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/troupe-serving/troupe/orchestrator"
	"github.com/troupe-serving/troupe/pkg/telemetry"
)

// audioTTL is the expires_at horizon announced with message.audio. troupe
// keeps no audio after answering, so the value is informational; OpenAI
// clients require it.
const audioTTL = time.Hour

// DefaultWriteStallTimeout is Config.WriteStallTimeout's default.
const DefaultWriteStallTimeout = 30 * time.Second

// chatCompletions serves POST /v1/chat/completions.
func (s *Server) chatCompletions(w http.ResponseWriter, r *http.Request) {
	body, e := s.readBody(r)
	if e != nil {
		s.reject(w, r, e)
		return
	}
	j, e := parseChatLimited(body, s.b.Pipeline().Model, newPartBudget(s.cfg.MaxContentParts, s.cfg.MaxPartBytes))
	if e != nil {
		s.reject(w, r, e)
		return
	}
	j.operation = telemetry.GenAIOperationChat
	id := s.begin(w, r, j, "chatcmpl-")
	s.execute(w, r, j, &chatResponder{id: "chatcmpl-" + id, created: time.Now().Unix(), model: j.model, includeUsage: j.includeUsage}, "audio_"+id)
}

// completions serves POST /v1/completions.
func (s *Server) completions(w http.ResponseWriter, r *http.Request) {
	body, e := s.readBody(r)
	if e != nil {
		s.reject(w, r, e)
		return
	}
	j, e := parseCompletion(body, s.b.Pipeline().Model)
	if e != nil {
		s.reject(w, r, e)
		return
	}
	j.operation = telemetry.GenAIOperationTextCompletion
	id := s.begin(w, r, j, "cmpl-")
	resp := &completionResponder{id: "cmpl-" + id, created: time.Now().Unix(), model: j.model, includeUsage: j.includeUsage}
	if j.echo {
		resp.echo = j.prompt
	}
	s.execute(w, r, j, resp, "")
}

// ignoredHeader lists, on the response, the request fields troupe accepted
// and ignored (docs/api.md says which and why).
const ignoredHeader = "X-Troupe-Ignored-Params"

// begin prepares the answer of a parsed request: the ignored-fields header
// and a new response id (returned without its prefix). The id is random
// per response, whatever X-Request-Id the client sent; the server span
// records it next to the request id.
func (s *Server) begin(w http.ResponseWriter, r *http.Request, j job, prefix string) string {
	if len(j.ignored) > 0 {
		w.Header().Set(ignoredHeader, strings.Join(j.ignored, ", "))
	}
	id := newResponseID()
	trace.SpanFromContext(r.Context()).SetAttributes(telemetry.KeyGenAIResponseID.String(prefix + id))
	return id
}

// newResponseID is 128 random bits in hex.
func newResponseID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	return hex.EncodeToString(b[:])
}

// readBody reads the whole request body (or takes what admitted read); the
// middleware has already capped it at MaxBodyBytes.
func (s *Server) readBody(r *http.Request) ([]byte, *apiError) {
	if rb, ok := r.Body.(*readBody); ok {
		return rb.body, nil // read before admission
	}
	body, err := readAll(r)
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return nil, tooLarge(s.cfg.MaxBodyBytes)
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return nil, &apiError{Status: http.StatusRequestTimeout, Type: typeInvalidRequest, Code: "body_too_slow",
				Message: s.slowBodyMessage()}
		}
		s.log.DebugContext(r.Context(), "httpapi: reading the body", "request_id", requestIDFrom(r.Context()), "err", err)
		return nil, badRequest("", "invalid_body", "cannot read the request body: the upload broke off or its framing is malformed")
	}
	return body, nil
}

// readAll reads r's body. One that announces its Content-Length (the
// middleware has refused any over MaxBodyBytes) ends in a buffer of
// exactly that size, grown by doubling from 64 KiB as the bytes arrive
// (the last doubling briefly holds 1.5 times the body), not one of up to
// twice its size as io.ReadAll's growth leaves; and a client that
// announces much and sends little costs what it sent, not what it
// announced. A chunked body grows as io.ReadAll grows it, within
// MaxBodyBytes.
func readAll(r *http.Request) ([]byte, error) {
	n := r.ContentLength
	if n <= 0 {
		return io.ReadAll(r.Body)
	}
	body := make([]byte, 0, min(n, 64<<10))
	for int64(len(body)) < n {
		if len(body) == cap(body) {
			grown := make([]byte, len(body), min(n, 2*int64(cap(body))))
			copy(grown, body)
			body = grown
		}
		m, err := r.Body.Read(body[len(body):cap(body)])
		body = body[:len(body)+m]
		if err == io.EOF && int64(len(body)) < n {
			return nil, io.ErrUnexpectedEOF
		}
		if err != nil && err != io.EOF {
			return nil, err
		}
	}
	return body, nil
}

func tooLarge(limit int64) *apiError {
	return &apiError{Status: http.StatusRequestEntityTooLarge, Type: typeInvalidRequest, Code: "request_too_large",
		Message: fmt.Sprintf("request body exceeds the limit of %d bytes (the head's --max-body-bytes)", limit)}
}

// execute runs a parsed request on the head and answers it, whole or as
// server-sent events. Nothing is written until the head either fails (an
// ordinary error response) or produces its first text (the stream begins).
func (s *Server) execute(w http.ResponseWriter, r *http.Request, j job, resp responder, audioID string) {
	ctx, cancel := context.WithTimeout(r.Context(), s.cfg.RequestTimeout)
	defer cancel()
	id := requestIDFrom(r.Context())
	req := orchestrator.Request{ID: id, Prompt: j.prompt, Messages: j.messages, Voice: j.voice, Sampling: j.sampling, Stages: 1, Operation: j.operation, SessionKey: s.sessionKey(r, j),
		Received: receivedAt(w)}
	var e *apiError
	if req.Deadline, e = deadlineOf(r); e != nil {
		s.reject(w, r, e)
		return
	}
	if j.audio {
		req.Stages = len(s.b.Pipeline().Stages)
	}

	if !j.stream {
		res, err := s.b.Execute(ctx, req, nil)
		var audio *audioOut
		if err == nil {
			audio, err = audioOf(res, j.audio, j.audioFormat, audioID)
		}
		if err != nil {
			s.fail(w, r, nil, err)
			return
		}
		extendWriteDeadline(w, s.cfg.WriteStallTimeout)
		writeJSON(w, http.StatusOK, resp.full(res, audio))
		audio.release() // encoded: its WAV buffer can serve the next answer
		return
	}

	// The head calls onText (stage 0's goroutine) and OnAudio (the last
	// stage's) concurrently: events are written one at a time.
	stream := &sseWriter{w: w, rc: http.NewResponseController(w), timeout: s.cfg.WriteStallTimeout}
	var mu sync.Mutex
	write := func(chunk func() any) error {
		mu.Lock()
		defer mu.Unlock()
		if err := stream.begin(resp); err != nil {
			return err
		}
		return stream.send(chunk())
	}
	// Events are written as they come and flushed when the head has no
	// more output at hand (Request.Flush): a burst goes out in one write,
	// a lone token at once.
	req.Flush = func() error {
		mu.Lock()
		defer mu.Unlock()
		return stream.flush()
	}
	samples := 0
	if j.audio {
		expires := time.Now().Add(audioTTL).Unix()
		req.OnAudio = func(pcm []byte, _ int) error {
			return write(func() any {
				d := &audioDelta{ID: audioID, pcm: pcm}
				if samples == 0 {
					d.ExpiresAt = expires
				}
				samples += len(pcm) / 2
				return resp.audioChunk(d)
			})
		}
	}
	res, err := s.b.Execute(ctx, req, func(delta string) error {
		if delta == "" {
			return nil
		}
		if j.audio {
			return write(func() any { return resp.transcriptChunk(delta, audioID) })
		}
		// A text delta, the event of every token: encoded around the
		// delta without a value or an allocation (appendTextChunk).
		mu.Lock()
		defer mu.Unlock()
		if err := stream.begin(resp); err != nil {
			return err
		}
		return stream.event(resp.appendTextChunk(append(stream.scratch[:0], "data: "...), delta))
	})
	if err == nil && j.audio && samples == 0 {
		err = errNoAudio
	}
	if err != nil {
		s.fail(w, r, stream, err)
		return
	}
	err = stream.begin(resp)
	if err == nil {
		err = stream.send(resp.finishChunk(finishReason(res)))
	}
	if err == nil && j.includeUsage {
		err = stream.send(resp.usageChunk(usageOf(res)))
	}
	if err == nil {
		err = stream.done()
	}
	if err == nil {
		err = stream.flush()
	}
	if err != nil {
		s.log.DebugContext(r.Context(), "httpapi: stream write failed", "request_id", id, "err", err)
	}
}

// sessionKey is the request's session key for session affinity: the
// configured header, else the body's `user` field if so configured.
func (s *Server) sessionKey(r *http.Request, j job) string {
	if s.cfg.SessionHeader != "" {
		if k := r.Header.Get(s.cfg.SessionHeader); k != "" {
			return k
		}
	}
	if s.cfg.SessionFromUser {
		return j.user
	}
	return ""
}

// fail answers an error of the head. A client that is gone gets nothing
// more; a stream that has begun gets the error as its last event (and no
// [DONE], so the client knows it is incomplete).
func (s *Server) fail(w http.ResponseWriter, r *http.Request, stream *sseWriter, err error) {
	id := requestIDFrom(r.Context())
	if r.Context().Err() != nil || (stream != nil && stream.broken) {
		s.log.InfoContext(r.Context(), "httpapi: client went away; request aborted", "request_id", id, "err", err)
		clientGone(w)
		return
	}
	e := fromBackend(err, id)
	level := slog.LevelInfo
	if e.Status >= 500 {
		level = slog.LevelWarn
	}
	s.log.Log(r.Context(), level, "httpapi: request failed", "request_id", id, "status", e.Status, "code", e.Code, "err", err)
	if stream != nil && stream.started {
		if stream.send(errorBody{Error: detailOf(e)}) == nil {
			_ = stream.flush()
		}
		return
	}
	writeError(w, e)
}

// StatusClientClosedRequest is the status a request's log line and
// troupe_http_requests_total give a request whose client went away before
// any answer was written (nginx's 499); nothing is sent.
const StatusClientClosedRequest = 499

// clientGone records, on the response's statusWriter, that its client went
// away before any status was written, so it is not counted as a 200.
func clientGone(w http.ResponseWriter) {
	for w != nil {
		if sw, ok := w.(*statusWriter); ok {
			if sw.status == 0 {
				sw.status = StatusClientClosedRequest
			}
			return
		}
		u, ok := w.(interface{ Unwrap() http.ResponseWriter })
		if !ok {
			return
		}
		w = u.Unwrap()
	}
}

// reject answers a request refused before it reached the head.
func (s *Server) reject(w http.ResponseWriter, r *http.Request, e *apiError) {
	s.log.DebugContext(r.Context(), "httpapi: request rejected", "request_id", requestIDFrom(r.Context()), "status", e.Status, "code", e.Code, "param", e.Param, "err", e.Message)
	writeError(w, e)
}

var errNoAudio = &apiError{Status: http.StatusBadGateway, Type: typeServer, Code: "no_audio",
	Message: "the pipeline produced no audio: its last stage returned no PCM samples"}

// audioOf builds message.audio, with the given id, from the pipeline's PCM,
// when asked for: a WAV file, or the raw samples for format pcm16.
func audioOf(res *orchestrator.Result, wanted bool, format, id string) (*audioOut, error) {
	if !wanted {
		return nil, nil
	}
	if len(res.PCM) < 2 || res.SampleRate <= 0 {
		return nil, errNoAudio
	}
	a := &audioOut{
		ID:         id,
		Data:       res.PCM,
		ExpiresAt:  time.Now().Add(audioTTL).Unix(),
		Transcript: res.Text,
	}
	if format != audioFormatPCM16 {
		buf := wavBuffers.Get().(*[]byte)
		wav, err := appendWAV((*buf)[:0], res.PCM, res.SampleRate)
		if err != nil {
			putWAVBuffer(buf)
			return nil, &apiError{Status: http.StatusBadGateway, Type: typeServer, Code: "invalid_audio",
				Message: fmt.Sprintf("the pipeline's audio cannot be encoded as WAV (%d bytes at %d Hz)", len(res.PCM), res.SampleRate)}
		}
		*buf = wav
		a.Data, a.wav = wav, buf
	}
	return a, nil
}

// release returns a's WAV buffer to its pool: a and its Data must not be
// used again. A nil a, or one without a WAV, has nothing to release.
func (a *audioOut) release() {
	if a == nil || a.wav == nil {
		return
	}
	putWAVBuffer(a.wav)
	a.Data, a.wav = nil, nil
}

func finishReason(res *orchestrator.Result) string {
	if res.FinishReason == "" {
		return "stop"
	}
	return res.FinishReason
}

// extendWriteDeadline gives the next write timeout to complete. The
// middleware clears the deadline when the next request on the connection
// begins.
func extendWriteDeadline(w http.ResponseWriter, timeout time.Duration) {
	_ = http.NewResponseController(w).SetWriteDeadline(time.Now().Add(timeout))
}

// sseWriter writes server-sent events into the response's buffer; flush
// sends what was written. Its users serialize their calls. After a failed
// write it writes nothing more. Each write that reaches the connection has
// timeout (Config.WriteStallTimeout) to complete: a client that reads
// nothing for that long fails the write, and with it the request, which
// the head ends on every stage as a client's cancel.
type sseWriter struct {
	w         http.ResponseWriter
	rc        *http.ResponseController
	timeout   time.Duration
	started   bool
	broken    bool
	unflushed bool   // events were written since the last flush
	scratch   []byte // the last event's buffer, reused for the next
}

// begin writes the stream's headers and the responder's first chunk, once.
func (s *sseWriter) begin(resp responder) error {
	if s.started {
		return nil
	}
	s.writeHeader()
	if first := resp.roleChunk(); first != nil {
		return s.send(first)
	}
	return nil
}

// writeHeader starts the stream: its status and headers.
func (s *sseWriter) writeHeader() {
	s.started = true
	h := s.w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no") // reverse proxies: do not buffer the stream
	s.w.WriteHeader(http.StatusOK)
	s.unflushed = true // the headers
}

func (s *sseWriter) send(v any) error {
	if a, ok := v.(jsonAppender); ok {
		return s.event(a.appendJSON(append(s.scratch[:0], "data: "...)))
	}
	data, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("httpapi: encode event: %w", err)
	}
	return s.event(append(append(s.scratch[:0], "data: "...), data...))
}

// done ends the stream as OpenAI does.
func (s *sseWriter) done() error { return s.event(append(s.scratch[:0], "data: [DONE]"...)) }

// event ends ev ("data: " and the event's data) and writes it as one
// event. ev may lie in s.scratch, which it keeps for the next event: the
// response writer copies what it is given.
func (s *sseWriter) event(ev []byte) error {
	if s.broken {
		return errors.New("httpapi: stream already broken")
	}
	ev = append(ev, '\n', '\n')
	s.scratch = ev[:0]
	// A write that fills the response buffer goes to the connection: it
	// needs the deadline too.
	_ = s.rc.SetWriteDeadline(time.Now().Add(s.timeout))
	if _, err := s.w.Write(ev); err != nil {
		s.broken = true
		return fmt.Errorf("httpapi: write event: %w", err)
	}
	s.unflushed = true
	return nil
}

// flush sends the events written since the last flush, if any.
func (s *sseWriter) flush() error {
	if !s.unflushed || s.broken {
		return nil
	}
	s.unflushed = false
	_ = s.rc.SetWriteDeadline(time.Now().Add(s.timeout))
	if err := s.rc.Flush(); err != nil {
		s.broken = true
		return fmt.Errorf("httpapi: flush event: %w", err)
	}
	return nil
}

// responder renders one request's answer in its endpoint's shape.
type responder interface {
	full(res *orchestrator.Result, audio *audioOut) any
	roleChunk() any // nil: the endpoint has no opening chunk
	// appendTextChunk appends the encoded chunk of a text delta to b.
	appendTextChunk(b []byte, delta string) []byte
	transcriptChunk(delta, audioID string) any
	audioChunk(a *audioDelta) any
	finishChunk(reason string) any
	usageChunk(u *usage) any
}

type chatResponder struct {
	id           string
	created      int64
	model        string
	includeUsage bool
	textChunk    chunkAround // made by the first appendTextChunk
}

func (c *chatResponder) full(res *orchestrator.Result, audio *audioOut) any {
	return &chatCompletion{
		ID: c.id, Object: "chat.completion", Created: c.created, Model: c.model,
		Choices: []chatChoice{{
			Message:      chatResponseMessage{Role: "assistant", Content: res.Text, Audio: audio},
			FinishReason: finishReason(res),
		}},
		Usage: usageOf(res),
	}
}

func (c *chatResponder) chunk(d chatDelta, finish *string) *chatChunk {
	ch := &chatChunk{
		ID: c.id, Object: "chat.completion.chunk", Created: c.created, Model: c.model,
		Choices: []chatChunkChoice{{Delta: d, FinishReason: finish}},
	}
	if c.includeUsage {
		ch.Usage = nullUsage
	}
	return ch
}

func (c *chatResponder) roleChunk() any {
	empty := ""
	return c.chunk(chatDelta{Role: "assistant", Content: &empty}, nil)
}

func (c *chatResponder) appendTextChunk(b []byte, delta string) []byte {
	if c.textChunk.prefix == nil {
		empty := ""
		c.textChunk = splitChunk(c.chunk(chatDelta{Content: &empty}, nil), `"choices":[{"index":0,"delta":{"content":`)
	}
	return c.textChunk.appendJSON(b, delta)
}

// transcriptChunk carries a piece of the text of an audio answer, both as
// content and as the audio's transcript, as the whole answer carries it.
func (c *chatResponder) transcriptChunk(delta, audioID string) any {
	return c.chunk(chatDelta{Content: &delta, Audio: &audioDelta{ID: audioID, Transcript: delta}}, nil)
}

func (c *chatResponder) audioChunk(a *audioDelta) any { return c.chunk(chatDelta{Audio: a}, nil) }

func (c *chatResponder) finishChunk(reason string) any { return c.chunk(chatDelta{}, &reason) }

func (c *chatResponder) usageChunk(u *usage) any {
	return &chatChunk{
		ID: c.id, Object: "chat.completion.chunk", Created: c.created, Model: c.model,
		Choices: []chatChunkChoice{}, Usage: u,
	}
}

type completionResponder struct {
	id           string
	created      int64
	model        string
	includeUsage bool
	echo         string      // the prompt, sent before the text when echo is set
	textChunk    chunkAround // made by the first appendTextChunk
}

func (c *completionResponder) full(res *orchestrator.Result, _ *audioOut) any {
	reason := finishReason(res)
	return &textCompletion{
		ID: c.id, Object: "text_completion", Created: c.created, Model: c.model,
		Choices: []completionChoice{{Text: c.echo + res.Text, FinishReason: &reason}},
		Usage:   usageOf(res),
	}
}

func (c *completionResponder) chunk(text string, finish *string) *textCompletion {
	ch := &textCompletion{
		ID: c.id, Object: "text_completion", Created: c.created, Model: c.model,
		Choices: []completionChoice{{Text: text, FinishReason: finish}},
	}
	if c.includeUsage {
		ch.Usage = nullUsage
	}
	return ch
}

// roleChunk: text completions have no role; with echo, the prompt opens
// the stream.
func (c *completionResponder) roleChunk() any {
	if c.echo == "" {
		return nil
	}
	return c.chunk(c.echo, nil)
}

func (c *completionResponder) appendTextChunk(b []byte, delta string) []byte {
	if c.textChunk.prefix == nil {
		c.textChunk = splitChunk(c.chunk("", nil), `"choices":[{"index":0,"text":`)
	}
	return c.textChunk.appendJSON(b, delta)
}

func (c *completionResponder) transcriptChunk(delta, _ string) any { return c.chunk(delta, nil) }

func (c *completionResponder) audioChunk(*audioDelta) any { return nil }

func (c *completionResponder) finishChunk(reason string) any { return c.chunk("", &reason) }

func (c *completionResponder) usageChunk(u *usage) any {
	return &textCompletion{
		ID: c.id, Object: "text_completion", Created: c.created, Model: c.model,
		Choices: []completionChoice{}, Usage: u,
	}
}
