package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/realtime"
)

// talkDetail is the help's text after the summary.
const talkDetail = `Opens one realtime session (GET /v1/realtime) and runs its turns: the first is --text or
--wav (else a line of stdin), the next ones are lines of stdin, up to --turns turns or EOF.
Each answer's transcript (or text) is printed as it streams, then a line with the time to
first audio, the audio's seconds and the response status. --wav takes PCM16 mono 24000 Hz
(no resampling). The API key comes from --api-key-file or TROUPE_API_KEY, never the command line.`

// talkSampleRate is the realtime API's PCM16 rate, in and out.
const talkSampleRate = 24000

// talkChunkBytes is the PCM sent per input_audio_buffer.append: half a
// second, far under the head's 1 MiB message limit once base64.
const talkChunkBytes = talkSampleRate

type talkFlags struct {
	url, apiKeyFile, text, wav, out, voice, instructions string
	textOnly                                             bool
	turns                                                int
	timeout                                              time.Duration
}

// runTalk runs `troupe talk`, reading further user lines from os.Stdin.
func runTalk(ctx context.Context, args []string, stdout io.Writer) error {
	return talk(ctx, args, os.Stdin, stdout)
}

// talk is runTalk with its stdin given.
func talk(ctx context.Context, args []string, stdin io.Reader, stdout io.Writer) error {
	fs := newFlagSet("talk")
	var f talkFlags
	fs.StringVar(&f.url, "url", "http://127.0.0.1:8000", "the head's `base` URL, with or without /v1")
	fs.StringVar(&f.apiKeyFile, "api-key-file", "", "`file` holding the API key (default: $TROUPE_API_KEY)")
	fs.StringVar(&f.text, "text", "", "the first user `message`")
	fs.StringVar(&f.wav, "wav", "", "the first user turn as audio: a PCM16 mono 24000 Hz WAV `file`")
	fs.StringVar(&f.out, "out", "", "write the answers' audio, every turn's in order, as a 24000 Hz WAV `file`")
	fs.StringVar(&f.voice, "voice", "", "the `voice` of the answers (default: the head's)")
	fs.StringVar(&f.instructions, "instructions", "", "the session's `instructions` (its system message)")
	fs.BoolVar(&f.textOnly, "text-only", false, "answer in text (output_modalities [\"text\"]): no audio")
	fs.IntVar(&f.turns, "turns", 1, "at most `n` turns; past the first, lines of stdin (0: until EOF)")
	fs.DurationVar(&f.timeout, "timeout", 5*time.Minute, "limit of one turn (0: none)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	switch {
	case f.text != "" && f.wav != "":
		return errors.New("talk: --text and --wav both given (one first turn)")
	case f.turns < 0:
		return fmt.Errorf("talk: --turns %d: not 0 or more", f.turns)
	case f.textOnly && f.out != "":
		return errors.New("talk: --out with --text-only: a text answer has no audio")
	}
	key := os.Getenv("TROUPE_API_KEY")
	if f.apiKeyFile != "" {
		k, err := readKeyFile("--api-key-file", f.apiKeyFile)
		if err != nil {
			return fmt.Errorf("talk: %w", err)
		}
		key = k
	}
	var firstPCM []byte
	if f.wav != "" {
		b, err := os.ReadFile(f.wav)
		if err != nil {
			return fmt.Errorf("talk: --wav: %w", err)
		}
		if firstPCM, err = readPCM16WAV(b); err != nil {
			return fmt.Errorf("talk: --wav %s: %w", f.wav, err)
		}
	}

	s, err := dialTalk(ctx, f, key)
	if err != nil {
		return err
	}
	defer s.conn.Abort()

	lines := bufio.NewScanner(stdin)
	lines.Buffer(make([]byte, 64<<10), 1<<20)
	var audio []byte
	var failed error
turns:
	for n := 0; f.turns == 0 || n < f.turns; n++ {
		say := func(ctx context.Context) error { return s.sayText(ctx, f.text) }
		switch {
		case n == 0 && firstPCM != nil:
			say = func(ctx context.Context) error { return s.sayAudio(ctx, firstPCM) }
		case n == 0 && f.text != "":
		case lines.Scan():
			line := lines.Text()
			say = func(ctx context.Context) error { return s.sayText(ctx, line) }
		case lines.Err() != nil:
			return fmt.Errorf("talk: stdin: %w", lines.Err())
		case n == 0:
			return errors.New("talk: nothing to say: give --text, --wav or a line on stdin")
		default:
			break turns // EOF ends the session
		}
		r, err := s.turn(ctx, f.timeout, say, stdout)
		if err != nil {
			return err
		}
		audio = append(audio, r.audio...)
		fmt.Fprintln(stdout, r.summary())
		if r.status != "completed" && failed == nil {
			failed = fmt.Errorf("talk: response %s: %s", r.status, r.reason)
		}
	}
	if f.out != "" {
		if err := os.WriteFile(f.out, pcm16WAV(audio, talkSampleRate), 0o644); err != nil {
			return fmt.Errorf("talk: --out: %w", err)
		}
	}
	return failed
}

// talkSession is one realtime session of troupe talk.
type talkSession struct{ conn *realtime.RealtimeConnection }

// dialTalk connects, reads session.created and configures the session:
// instructions, modality, voice, and no turn detection (talk commits the
// audio and asks for each response itself).
func dialTalk(ctx context.Context, f talkFlags, key string) (*talkSession, error) {
	base := strings.TrimSuffix(strings.TrimSuffix(f.url, "/"), "/v1") + "/v1/"
	if key == "" {
		key = "none" // the client refuses an empty key; a head without --api-key ignores it
	}
	client := openai.NewClient(option.WithBaseURL(base), option.WithAPIKey(key), option.WithMaxRetries(0))
	conn, err := client.Realtime.Connect(ctx, realtime.RealtimeConnectionOptions{})
	if err != nil {
		return nil, fmt.Errorf("talk: connect %s: %w", base+"realtime", err)
	}
	s := &talkSession{conn: conn}
	if _, err := s.await(ctx, "session.created"); err != nil {
		conn.Abort()
		return nil, err
	}
	modality := "audio"
	if f.textOnly {
		modality = "text"
	}
	type output struct {
		Voice string `json:"voice,omitempty"`
	}
	session := map[string]any{
		"type": "realtime", "output_modalities": []string{modality},
		"audio": map[string]any{"input": map[string]any{"turn_detection": nil}, "output": output{Voice: f.voice}},
	}
	if f.instructions != "" {
		session["instructions"] = f.instructions
	}
	raw, err := json.Marshal(map[string]any{"type": "session.update", "session": session})
	if err == nil {
		err = conn.SendRaw(ctx, raw)
	}
	if err == nil {
		_, err = s.await(ctx, "session.updated")
	}
	if err != nil {
		conn.Abort()
		return nil, fmt.Errorf("talk: session.update: %w", err)
	}
	return s, nil
}

// await reads events up to one of type want and returns it; an error
// event (the head refused what talk sent) is an error.
func (s *talkSession) await(ctx context.Context, want string) (realtime.RealtimeServerEventUnion, error) {
	for {
		ev, err := s.conn.Recv(ctx)
		if err != nil {
			return ev, fmt.Errorf("talk: waiting for %s: %w", want, err)
		}
		switch ev.Type {
		case want:
			return ev, nil
		case "error":
			e := ev.AsRealtimeErrorEvent().Error
			return ev, fmt.Errorf("talk: the head answered %s: %s (%s)", e.Code, e.Message, e.Type)
		}
	}
}

// sayText adds a user message to the conversation.
func (s *talkSession) sayText(ctx context.Context, text string) error {
	err := s.conn.Send(ctx, realtime.RealtimeClientEventParamOfConversationItemCreate(realtime.RealtimeConversationItemUserMessageParam{
		Content: []realtime.RealtimeConversationItemUserMessageContentParam{{Type: "input_text", Text: openai.String(text)}}}))
	if err != nil {
		return fmt.Errorf("talk: conversation.item.create: %w", err)
	}
	_, err = s.await(ctx, "conversation.item.done")
	return err
}

// sayAudio appends pcm to the input audio buffer and commits it: a user
// input_audio item.
func (s *talkSession) sayAudio(ctx context.Context, pcm []byte) error {
	for len(pcm) > 0 {
		n := min(len(pcm), talkChunkBytes)
		if err := s.conn.Send(ctx, realtime.RealtimeClientEventParamOfInputAudioBufferAppend(base64.StdEncoding.EncodeToString(pcm[:n]))); err != nil {
			return fmt.Errorf("talk: input_audio_buffer.append: %w", err)
		}
		pcm = pcm[n:]
	}
	if err := s.conn.Send(ctx, realtime.RealtimeClientEventUnionParam{OfInputAudioBufferCommit: &realtime.InputAudioBufferCommitEventParam{}}); err != nil {
		return fmt.Errorf("talk: input_audio_buffer.commit: %w", err)
	}
	_, err := s.await(ctx, "conversation.item.done")
	return err
}

// turn says the user's part, then asks for and prints the response, all
// within timeout (0: none).
func (s *talkSession) turn(ctx context.Context, timeout time.Duration, say func(context.Context) error, stdout io.Writer) (talkResult, error) {
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	if err := say(ctx); err != nil {
		return talkResult{}, err
	}
	return s.respond(ctx, stdout)
}

// talkResult is what one response sent.
type talkResult struct {
	audio          []byte
	firstAudio     time.Duration // 0: no audio
	status, reason string
}

// summary is the line printed after a response.
func (r talkResult) summary() string {
	ttfa := "-"
	if r.firstAudio > 0 {
		ttfa = r.firstAudio.Round(time.Millisecond).String()
	}
	return fmt.Sprintf("[time to first audio %s, audio %.2fs, status %s]", ttfa,
		float64(len(r.audio)/2)/talkSampleRate, r.status)
}

// respond sends response.create and prints the answer's text as it
// streams, up to response.done.
func (s *talkSession) respond(ctx context.Context, stdout io.Writer) (talkResult, error) {
	start := time.Now()
	var r talkResult
	if err := s.conn.Send(ctx, realtime.RealtimeClientEventUnionParam{OfResponseCreate: &realtime.ResponseCreateEventParam{}}); err != nil {
		return r, fmt.Errorf("talk: response.create: %w", err)
	}
	for {
		ev, err := s.conn.Recv(ctx)
		if err != nil {
			return r, fmt.Errorf("talk: waiting for response.done: %w", err)
		}
		switch ev.Type {
		case "response.output_text.delta":
			fmt.Fprint(stdout, ev.AsResponseTextDeltaEvent().Delta)
		case "response.output_audio_transcript.delta":
			fmt.Fprint(stdout, ev.AsResponseAudioTranscriptDeltaEvent().Delta)
		case "response.output_audio.delta":
			pcm, err := base64.StdEncoding.DecodeString(ev.AsResponseAudioDeltaEvent().Delta)
			if err != nil {
				return r, fmt.Errorf("talk: response.output_audio.delta: %w", err)
			}
			if r.firstAudio == 0 {
				r.firstAudio = time.Since(start)
			}
			r.audio = append(r.audio, pcm...)
		case "error":
			e := ev.AsRealtimeErrorEvent().Error
			return r, fmt.Errorf("talk: the head answered %s: %s (%s)", e.Code, e.Message, e.Type)
		case "response.done":
			// status_details is read from the raw event: the client
			// types it as a string.
			var done struct {
				Response struct {
					Status        string
					StatusDetails struct {
						Reason string
						Error  struct{ Code string }
					} `json:"status_details"`
				}
			}
			if err := json.Unmarshal([]byte(ev.RawJSON()), &done); err != nil {
				return r, fmt.Errorf("talk: response.done: %w", err)
			}
			r.status, r.reason = done.Response.Status, done.Response.StatusDetails.Reason
			if c := done.Response.StatusDetails.Error.Code; c != "" {
				r.reason = c
			}
			fmt.Fprintln(stdout)
			return r, nil
		}
	}
}

// readPCM16WAV returns the samples of a PCM16 mono WAV file at 24000 Hz;
// it refuses any other format or rate rather than resample.
func readPCM16WAV(b []byte) ([]byte, error) {
	if len(b) < 12 || string(b[0:4]) != "RIFF" || string(b[8:12]) != "WAVE" {
		return nil, errors.New("not a RIFF/WAVE file")
	}
	sawFmt := false
	for p := b[12:]; len(p) >= 8; {
		id, size := string(p[0:4]), int(binary.LittleEndian.Uint32(p[4:8]))
		p = p[8:]
		if id == "data" {
			if !sawFmt {
				return nil, errors.New("data chunk before the fmt chunk")
			}
			size = min(size, len(p)) // a streaming writer's placeholder size runs to the end
			return p[:size-size%2], nil
		}
		if size > len(p) {
			return nil, fmt.Errorf("%s chunk of %d bytes runs past the end", id, size)
		}
		if id == "fmt " {
			if size < 16 {
				return nil, fmt.Errorf("fmt chunk of %d bytes", size)
			}
			format, channels := binary.LittleEndian.Uint16(p[0:2]), binary.LittleEndian.Uint16(p[2:4])
			rate, bits := binary.LittleEndian.Uint32(p[4:8]), binary.LittleEndian.Uint16(p[14:16])
			if format == 0xFFFE && size >= 26 {
				format = binary.LittleEndian.Uint16(p[24:26]) // WAVE_FORMAT_EXTENSIBLE: the sub-format's first bytes
			}
			switch {
			case format != 1 || bits != 16:
				return nil, fmt.Errorf("format %#x of %d bits: want PCM16", format, bits)
			case channels != 1:
				return nil, fmt.Errorf("%d channels: want mono", channels)
			case rate != talkSampleRate:
				return nil, fmt.Errorf("%d Hz: want %d Hz (the realtime API's rate; resample it first, e.g. sox in.wav -r 24000 -c 1 -b 16 out.wav)", rate, talkSampleRate)
			}
			sawFmt = true
		}
		p = p[min(size+size%2, len(p)):]
	}
	return nil, errors.New("no data chunk")
}

// pcm16WAV wraps PCM16 mono samples in a WAV file.
func pcm16WAV(pcm []byte, sampleRate int) []byte {
	var b bytes.Buffer
	le := func(v any) { _ = binary.Write(&b, binary.LittleEndian, v) } // a bytes.Buffer does not fail
	b.WriteString("RIFF")
	le(uint32(36 + len(pcm)))
	b.WriteString("WAVEfmt ")
	le(uint32(16))
	le(uint16(1)) // PCM
	le(uint16(1)) // mono
	le(uint32(sampleRate))
	le(uint32(sampleRate * 2)) // bytes per second
	le(uint16(2))              // bytes per frame
	le(uint16(16))
	b.WriteString("data")
	le(uint32(len(pcm)))
	b.Write(pcm)
	return b.Bytes()
}
