package loadgen

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/troupe-serving/troupe/pkg/sse"
)

// Outcome is how a request ended.
type Outcome string

const (
	OutcomeOK     Outcome = "ok"
	OutcomeShed   Outcome = "shed"   // 429 or 503, or a deadline_missed error event: the server refused the load or stopped it at its target
	OutcomeFailed Outcome = "failed" // any other status, a transport error, a broken stream
)

// Record is what the client saw of one request. Durations are in
// milliseconds from the moment the request was sent; zero when not seen.
type Record struct {
	Outcome Outcome `json:"outcome"`
	Status  int     `json:"status,omitempty"`
	Error   string  `json:"error,omitempty"`
	// ScheduledMS is when the request was due, from the start of the run;
	// LateMS how much later it was sent (a client that cannot keep up).
	ScheduledMS float64 `json:"scheduled_ms"`
	LateMS      float64 `json:"late_ms,omitempty"`
	TTFTMS      float64 `json:"ttft_ms,omitempty"`
	// ITLMS are the gaps between consecutive text deltas (vllm bench
	// serve's ITL: a delta that holds several tokens is one gap).
	ITLMS  []float64 `json:"itl_ms,omitempty"`
	TTFAMS float64   `json:"ttfa_ms,omitempty"`
	E2EMS  float64   `json:"e2e_ms"`
	Deltas int       `json:"deltas,omitempty"`
	// OutputTokens is the answer's completion_tokens from its usage (asked
	// with stream_options.include_usage), or its text deltas when the
	// server reports no usage.
	OutputTokens int `json:"output_tokens,omitempty"`
	// TPOTMS is vllm bench serve's time per output token, the first
	// excluded: (E2E - TTFT) / (output tokens - 1), for streamed answers
	// of two tokens or more. An answer with audio ends its text before
	// its audio: its last text delta stands for E2E.
	TPOTMS float64 `json:"tpot_ms,omitempty"`
	// AudioBytes is the PCM16 received; AudioSeconds the same at
	// SampleRate: the answer's X-Audio-Sample-Rate, else the rate the
	// run learned or was given (Config.SampleRate).
	AudioBytes   int     `json:"audio_bytes,omitempty"`
	SampleRate   int     `json:"sample_rate,omitempty"`
	AudioSeconds float64 `json:"audio_seconds,omitempty"`
	// RTF is audio seconds per wall second from the first audio to the
	// end of the answer (the wall time at least 1 ms).
	RTF float64 `json:"rtf,omitempty"`
	// Underruns counts the moments a player that started at the first
	// audio had played everything received before more came.
	Underruns int `json:"underruns,omitempty"`
	// RetryAfterMS is a shed answer's Retry-After, in milliseconds (0:
	// none): a closed-loop client waits that long before its next request.
	RetryAfterMS float64 `json:"retry_after_ms,omitempty"`
	answer       string  // the text, for the next turn of a conversation
	// textEndMS is when the last text delta came; 0 without deltas.
	textEndMS float64
}

// burstMS: an answer whose text deltas all came within this span of its
// first came at once (see RunResult.BurstAnswers).
const burstMS = 1.0

// burst reports whether the answer's two or more text deltas all came
// within burstMS: its gaps say nothing of how fast the server decodes.
func (r Record) burst() bool { return r.Deltas >= 2 && r.textEndMS-r.TTFTMS < burstMS }

// meanITL is the request's mean inter-token latency (0: none).
func (r Record) meanITL() float64 {
	if len(r.ITLMS) == 0 {
		return 0
	}
	var s float64
	for _, v := range r.ITLMS {
		s += v
	}
	return s / float64(len(r.ITLMS))
}

// client sends requests and measures them.
type client struct {
	http       *http.Client
	url        string // the chat completions URL
	model      string
	apiKey     string
	voice      string
	sampleRate int // 0: the answer's X-Audio-Sample-Rate only
	ignoreEOS  bool
	timeout    time.Duration
	deadline   string // the X-Troupe-Deadline header; "" sends none
}

type chatBody struct {
	Model         string         `json:"model"`
	Messages      []Message      `json:"messages"`
	MaxTokens     int            `json:"max_tokens,omitempty"`
	Stream        bool           `json:"stream,omitempty"`
	Modalities    []string       `json:"modalities,omitempty"`
	Audio         map[string]any `json:"audio,omitempty"`
	User          string         `json:"user,omitempty"`
	IgnoreEOS     bool           `json:"ignore_eos,omitempty"`
	StreamOptions map[string]any `json:"stream_options,omitempty"`
}

// do sends req and measures its answer.
func (c *client) do(ctx context.Context, req Request) Record {
	body := chatBody{Model: c.model, Messages: req.Messages, MaxTokens: req.MaxTokens, Stream: req.streamed(),
		Modalities: req.Modalities, User: req.Session, IgnoreEOS: c.ignoreEOS}
	if len(body.Messages) == 0 {
		body.Messages = []Message{{Role: "user", Content: req.Prompt}}
	}
	if req.audio() {
		body.Audio = map[string]any{"voice": c.voice, "format": "pcm16"}
	}
	if body.Stream {
		// The answer's token count, for TPOT and the output throughput.
		body.StreamOptions = map[string]any{"include_usage": true}
	}
	data, err := json.Marshal(body)
	if err != nil {
		return Record{Outcome: OutcomeFailed, Error: err.Error()}
	}
	if c.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.timeout)
		defer cancel()
	}
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, c.url, bytes.NewReader(data))
	if err != nil {
		return Record{Outcome: OutcomeFailed, Error: err.Error()}
	}
	hreq.Header.Set("Content-Type", "application/json")
	if c.apiKey != "" {
		hreq.Header.Set("Authorization", "Bearer "+c.apiKey)
	}
	if c.deadline != "" {
		hreq.Header.Set("X-Troupe-Deadline", c.deadline)
	}
	start := time.Now()
	since := func() float64 { return float64(time.Since(start)) / float64(time.Millisecond) }
	var rec Record
	resp, err := c.http.Do(hreq)
	if err != nil {
		rec.Outcome, rec.Error, rec.E2EMS = OutcomeFailed, err.Error(), since()
		return rec
	}
	defer resp.Body.Close()
	rec.Status = resp.StatusCode
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		rec.Outcome, rec.E2EMS = OutcomeFailed, since()
		if resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode == http.StatusServiceUnavailable {
			rec.Outcome = OutcomeShed
			rec.RetryAfterMS = retryAfter(resp.Header.Get("Retry-After"))
		}
		rec.Error = fmt.Sprintf("status %d: %s", resp.StatusCode, strings.TrimSpace(string(msg)))
		return rec
	}
	if !req.streamed() {
		err = c.readWhole(resp.Body, &rec)
		rec.TTFTMS = since()
	} else {
		rate := c.sampleRate
		if n, perr := strconv.Atoi(resp.Header.Get(SampleRateHeader)); perr == nil && n > 0 {
			rate = n
		}
		err = c.readStream(resp.Body, &rec, rate, since)
	}
	rec.E2EMS = since()
	if req.streamed() && rec.OutputTokens > 1 && rec.Deltas > 0 {
		end := rec.E2EMS
		if rec.AudioBytes > 0 {
			end = rec.textEndMS
		}
		rec.TPOTMS = (end - rec.TTFTMS) / float64(rec.OutputTokens-1)
	}
	if err != nil {
		rec.Outcome, rec.Error = OutcomeFailed, err.Error()
		if errors.Is(err, errShedInStream) {
			rec.Outcome = OutcomeShed
		}
		return rec
	}
	rec.Outcome = OutcomeOK
	return rec
}

// SampleRateHeader is the response header that tells the rate of raw
// PCM16 (a troupe head sends it with /v1/audio/speech's pcm).
const SampleRateHeader = "X-Audio-Sample-Rate"

// usage is the part of an OpenAI usage object the client reads.
type usage struct {
	CompletionTokens int `json:"completion_tokens"`
}

// wholeAnswer is a chat completion answered whole.
type wholeAnswer struct {
	Choices []struct {
		Message struct {
			Content string `json:"content"`
			Audio   *struct {
				Data string `json:"data"`
			} `json:"audio"`
		} `json:"message"`
	} `json:"choices"`
	Usage *usage `json:"usage"`
}

func (c *client) readWhole(r io.Reader, rec *Record) error {
	var a wholeAnswer
	if err := json.NewDecoder(r).Decode(&a); err != nil {
		return fmt.Errorf("loadgen: decoding the answer: %w", err)
	}
	if len(a.Choices) == 0 {
		return fmt.Errorf("loadgen: an answer without choices")
	}
	rec.answer = a.Choices[0].Message.Content
	if a.Usage != nil {
		rec.OutputTokens = a.Usage.CompletionTokens
	}
	return nil
}

// maxRetryAfter bounds the wait a Retry-After asks of a closed-loop
// client, so that a server's odd value cannot stall a run.
const maxRetryAfter = 10 * time.Second

// retryAfter reads a Retry-After header in seconds (RFC 9110's
// delay-seconds; an HTTP date, which troupe never sends, reads as none),
// in milliseconds, at most maxRetryAfter.
func retryAfter(h string) float64 {
	n, err := strconv.Atoi(strings.TrimSpace(h))
	if err != nil || n <= 0 {
		return 0
	}
	return float64(min(time.Duration(n)*time.Second, maxRetryAfter)) / float64(time.Millisecond)
}

// shedCodes are the error codes of a troupe head that refused a request
// for its target or stopped it there (docs/api.md, Deadlines): shed, also
// when they come as an error event after the stream began (a later
// stage's admission, or first audio late after the text).
var shedCodes = map[string]bool{"deadline_missed": true, "deadline_unmeetable": true}

// errShedInStream: the stream ended with an error event of a shedCodes
// code.
var errShedInStream = errors.New("loadgen: shed after the stream began")

// player models a client playing the audio as it comes, from the first
// piece on: buffered is the audio received and not yet played.
type player struct {
	last     float64 // ms of the last piece
	buffered float64 // ms
}

// readStream reads server-sent events: text deltas, PCM16 audio deltas at
// rate Hz, and the usage.
func (c *client) readStream(r io.Reader, rec *Record, rate int, since func() float64) error {
	events := sse.NewReader(r)
	var text strings.Builder
	var lastDelta, firstAudio float64
	var p player
	done := false
	for {
		data, err := events.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("loadgen: reading the stream: %w", err)
		}
		if string(data) == sse.Done {
			done = true
			continue
		}
		var ev struct {
			Choices []struct {
				Delta struct {
					Content string `json:"content"`
					Audio   *struct {
						Data string `json:"data"`
					} `json:"audio"`
				} `json:"delta"`
			} `json:"choices"`
			Error json.RawMessage `json:"error"`
			Usage *usage          `json:"usage"`
		}
		if err := json.Unmarshal(data, &ev); err != nil {
			return fmt.Errorf("loadgen: decoding an event: %w", err)
		}
		if len(ev.Error) > 0 && string(ev.Error) != "null" {
			var e struct {
				Code string `json:"code"`
			}
			if json.Unmarshal(ev.Error, &e) == nil && shedCodes[e.Code] {
				return fmt.Errorf("%w: %s", errShedInStream, ev.Error)
			}
			return fmt.Errorf("loadgen: error event: %s", ev.Error)
		}
		if ev.Usage != nil && ev.Usage.CompletionTokens > 0 {
			rec.OutputTokens = ev.Usage.CompletionTokens
		}
		if len(ev.Choices) == 0 {
			continue
		}
		now := since()
		d := ev.Choices[0].Delta
		if d.Content != "" {
			if rec.Deltas == 0 {
				rec.TTFTMS = now
			} else {
				rec.ITLMS = append(rec.ITLMS, now-lastDelta)
			}
			rec.Deltas++
			lastDelta = now
			rec.textEndMS = now
			text.WriteString(d.Content)
		}
		if d.Audio != nil && d.Audio.Data != "" {
			n := base64.StdEncoding.DecodedLen(len(d.Audio.Data))
			pcm, err := base64.StdEncoding.DecodeString(d.Audio.Data)
			if err == nil {
				n = len(pcm)
			}
			if rate <= 0 {
				return fmt.Errorf("loadgen: audio at an unknown sample rate: no %s header, and none learned or given", SampleRateHeader)
			}
			rec.AudioBytes += n
			rec.SampleRate = rate
			sec := float64(n/2) / float64(rate)
			if rec.AudioSeconds == 0 {
				rec.TTFAMS, firstAudio = now, now
			} else {
				played := now - p.last
				if played > p.buffered {
					rec.Underruns++
					p.buffered = 0
				} else {
					p.buffered -= played
				}
			}
			p.last = now
			p.buffered += sec * 1000
			rec.AudioSeconds += sec
		}
	}
	if !done {
		return fmt.Errorf("loadgen: the stream ended without [DONE]")
	}
	if rec.AudioSeconds > 0 {
		rec.RTF = rec.AudioSeconds * 1000 / max(since()-firstAudio, 1)
	}
	if rec.OutputTokens == 0 {
		rec.OutputTokens = rec.Deltas
	}
	rec.answer = text.String()
	return nil
}
