package main

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/pkg/tokenizers"
	"github.com/troupe-serving/troupe/worker/espeak"
	"github.com/troupe-serving/troupe/worker/sim"
)

// lines is a stdout that tests can wait on.
type lines struct {
	mu     sync.Mutex
	buf    bytes.Buffer
	notify chan struct{}
}

func newLines() *lines { return &lines{notify: make(chan struct{}, 1)} }

func (l *lines) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.buf.Write(p)
	select {
	case l.notify <- struct{}{}:
	default:
	}
	return len(p), nil
}

// wait returns the first submatch of re in the output, waiting for it.
func (l *lines) wait(t *testing.T, re *regexp.Regexp) string {
	t.Helper()
	deadline := time.After(90 * time.Second)
	for {
		l.mu.Lock()
		m := re.FindStringSubmatch(l.buf.String())
		out := l.buf.String()
		l.mu.Unlock()
		if m != nil {
			return m[1]
		}
		select {
		case <-l.notify:
		case <-deadline:
			t.Fatalf("no %v in output:\n%s", re, out)
		}
	}
}

// background runs a subcommand until the test ends; it must then return nil.
func background(t *testing.T, name string, run func(context.Context, []string, io.Writer) error, args ...string) *lines {
	t.Helper()
	out := newLines()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx, args, out) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			assert.NoError(t, err, "troupe %s", name)
		case <-time.After(60 * time.Second):
			t.Errorf("troupe %s did not stop", name)
		}
	})
	return out
}

var (
	apiRE  = regexp.MustCompile(`API:\s+(http://\S+)/v1[\s\n]`)
	etcdRE = regexp.MustCompile(`etcd:\s+(\S+) \(data dir`)
	headRE = regexp.MustCompile(`API on (http://\S+)\n`)
	workRE = regexp.MustCompile(`troupe worker: (stage .*)\n`)
)

type chatAnswer struct {
	Choices []struct {
		Message struct {
			Content string `json:"content"`
			Audio   *struct {
				Data       string `json:"data"`
				Transcript string `json:"transcript"`
			} `json:"audio"`
		} `json:"message"`
	} `json:"choices"`
	Usage struct {
		PromptTokens     int `json:"prompt_tokens"`
		CompletionTokens int `json:"completion_tokens"`
	} `json:"usage"`
}

func chat(t *testing.T, base, body string) chatAnswer {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions", strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	resp, err := client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", data)
	var a chatAnswer
	require.NoError(t, json.Unmarshal(data, &a))
	require.Len(t, a.Choices, 1)
	return a
}

func requireEspeak(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("espeak-ng"); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("espeak-ng is required in CI (scripts/test.sh installs it): %v", err)
		}
		t.Skipf("espeak-ng is not installed; skipping outside CI: %v", err)
	}
}

// TestUpSpeech: `troupe up --speech espeak` answers an audio request with
// real speech of the thinker's text.
func TestUpSpeech(t *testing.T) {
	requireEspeak(t)
	out := background(t, "up", runUp, "--speech", "espeak", "--http", "127.0.0.1:0", "--log-level", "error")
	base := out.wait(t, apiRE)
	out.wait(t, regexp.MustCompile(`(Speech \(espeak-ng\))`))
	a := chat(t, base, `{"model":"troupe-omni-sim","modalities":["text","audio"],"audio":{"voice":"en","format":"wav"},"seed":3,
		"messages":[{"role":"user","content":"hello"}],"max_tokens":12}`)
	want, _, _ := sim.ExpectedText("user: hello", 3, 12)
	msg := a.Choices[0].Message
	assert.Equal(t, want, msg.Content)
	require.NotNil(t, msg.Audio)
	assert.Equal(t, want, msg.Audio.Transcript)
	wav, err := base64.StdEncoding.DecodeString(msg.Audio.Data)
	require.NoError(t, err)
	require.Greater(t, len(wav), 44)
	assert.Equal(t, "RIFF", string(wav[0:4]))
	assert.Equal(t, uint32(22050), binary.LittleEndian.Uint32(wav[24:28]), "espeak-ng's rate")
	pcm := wav[44:]
	seconds := float64(len(pcm)/2) / 22050
	assert.Greater(t, seconds, 0.25*float64(len(strings.Fields(want))), "about a quarter second or more per word")
	var sum float64
	for i := 0; i+1 < len(pcm); i += 2 {
		v := float64(int16(binary.LittleEndian.Uint16(pcm[i:])))
		sum += v * v
	}
	assert.Greater(t, math.Sqrt(sum/float64(len(pcm)/2)), 500.0, "not silent")

	// POST /v1/audio/speech: espeak-ng speaks the given text, a real WAV.
	resp, err := http.Post(base+"/v1/audio/speech", "application/json", strings.NewReader(`{"model":"troupe-omni-sim","input":"hello there, how are you","voice":"en"}`))
	require.NoError(t, err)
	spoken, err := io.ReadAll(resp.Body)
	require.NoError(t, resp.Body.Close())
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", spoken)
	assert.Equal(t, "audio/wav", resp.Header.Get("Content-Type"))
	require.Greater(t, len(spoken), 44)
	assert.Equal(t, "RIFF", string(spoken[0:4]))
	assert.Equal(t, uint32(22050), binary.LittleEndian.Uint32(spoken[24:28]), "espeak-ng's rate")
	assert.Greater(t, float64(len(spoken[44:])/2)/22050, 1.0, "five words: more than a second")
	sum = 0
	for i := 44; i+1 < len(spoken); i += 2 {
		v := float64(int16(binary.LittleEndian.Uint16(spoken[i:])))
		sum += v * v
	}
	assert.Greater(t, math.Sqrt(sum/float64(len(spoken[44:])/2)), 500.0, "not silent")

	// Streamed speech (pcm over SSE) reports what was spoken as its usage:
	// the input's words, and the audio's 40 ms frames.
	resp, err = http.Post(base+"/v1/audio/speech", "application/json", strings.NewReader(
		`{"model":"troupe-omni-sim","input":"hello there, how are you","voice":"en","response_format":"pcm","stream_format":"sse"}`))
	require.NoError(t, err)
	events, err := io.ReadAll(resp.Body)
	require.NoError(t, resp.Body.Close())
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", events)
	assert.Equal(t, "22050", resp.Header.Get("X-Audio-Sample-Rate"))
	var streamed []byte
	var usage *struct{ InputTokens, OutputTokens, TotalTokens int }
	for _, line := range strings.Split(string(events), "\n") {
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			continue
		}
		var ev struct {
			Type  string `json:"type"`
			Audio string `json:"audio"`
			Usage *struct {
				InputTokens  int `json:"input_tokens"`
				OutputTokens int `json:"output_tokens"`
				TotalTokens  int `json:"total_tokens"`
			} `json:"usage"`
		}
		require.NoError(t, json.Unmarshal([]byte(data), &ev), data)
		if ev.Type == "speech.audio.delta" {
			pcm, err := base64.StdEncoding.DecodeString(ev.Audio)
			require.NoError(t, err)
			streamed = append(streamed, pcm...)
		}
		if ev.Type == "speech.audio.done" && ev.Usage != nil {
			usage = &struct{ InputTokens, OutputTokens, TotalTokens int }{ev.Usage.InputTokens, ev.Usage.OutputTokens, ev.Usage.TotalTokens}
		}
	}
	require.NotNil(t, usage, "speech.audio.done carries the usage: %s", events)
	assert.Equal(t, 5, usage.InputTokens, "five words")
	assert.Equal(t, espeak.Frames(len(streamed)/2, 22050), usage.OutputTokens, "the audio's 40 ms frames")
	assert.Greater(t, usage.OutputTokens, 25, "more than a second of speech")
	assert.Equal(t, usage.InputTokens+usage.OutputTokens, usage.TotalTokens)

	// The client's voice reaches the speech stage: another voice, other audio.
	again := chat(t, base, `{"model":"troupe-omni-sim","modalities":["text","audio"],"audio":{"voice":"alloy","format":"wav"},"seed":3,
		"messages":[{"role":"user","content":"hello"}],"max_tokens":12}`)
	assert.Equal(t, msg.Audio.Data, again.Choices[0].Message.Audio.Data, "alloy is espeak's default voice, en")
	female := chat(t, base, `{"model":"troupe-omni-sim","modalities":["text","audio"],"audio":{"voice":"en+f3","format":"wav"},"seed":3,
		"messages":[{"role":"user","content":"hello"}],"max_tokens":12}`)
	assert.Equal(t, want, female.Choices[0].Message.Content)
	assert.NotEqual(t, msg.Audio.Data, female.Choices[0].Message.Audio.Data, "voice en+f3 sounds different")

	// A voice espeak-ng does not have is the client's mistake, named by
	// its field, in words for the client rather than espeak-ng's stderr.
	resp, err = http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"troupe-omni-sim","modalities":["text","audio"],
		"audio":{"voice":"zzvoice","format":"wav"},"messages":[{"role":"user","content":"hello"}],"max_tokens":4}`))
	require.NoError(t, err)
	data, err := io.ReadAll(resp.Body)
	require.NoError(t, resp.Body.Close())
	require.NoError(t, err)
	assert.Equal(t, http.StatusBadRequest, resp.StatusCode, "%s", data)
	var bad struct {
		Error struct {
			Message string  `json:"message"`
			Param   *string `json:"param"`
			Code    string  `json:"code"`
		} `json:"error"`
	}
	require.NoError(t, json.Unmarshal(data, &bad), "%s", data)
	require.NotNil(t, bad.Error.Param, "%s", data)
	assert.Equal(t, "audio.voice", *bad.Error.Param)
	assert.Equal(t, "invalid_value", bad.Error.Code)
	assert.Equal(t, "voice \"zzvoice\" is not an espeak-ng voice: want one such as en, en-us or en+f3 (`espeak-ng --voices` lists them)", bad.Error.Message)

	// The same mistake on the speech endpoint names its own field.
	resp, err = http.Post(base+"/v1/audio/speech", "application/json", strings.NewReader(`{"model":"troupe-omni-sim","input":"hello","voice":"zzvoice"}`))
	require.NoError(t, err)
	data, err = io.ReadAll(resp.Body)
	require.NoError(t, resp.Body.Close())
	require.NoError(t, err)
	assert.Equal(t, http.StatusBadRequest, resp.StatusCode, "%s", data)
	require.NoError(t, json.Unmarshal(data, &bad), "%s", data)
	require.NotNil(t, bad.Error.Param, "%s", data)
	assert.Equal(t, "voice", *bad.Error.Param)
	assert.Equal(t, "invalid_value", bad.Error.Code)

	// troupe bench --workload audio reads espeak's 22050 Hz from the server,
	// not OpenAI's 24000: the audio's length, and so its RTF, is right.
	res, table := bench(t, "--url", base, "--workload", "audio", "--voice", "en", "--concurrency", "1", "--requests", "2",
		"--max-tokens", "6", "--records")
	r := res.Runs[0]
	require.Equal(t, 2, r.OK, "errors: %v", r.Errors)
	assert.Equal(t, 22050, r.SampleRate)
	assert.Contains(t, table, "audio measured at 22050 Hz")
	for _, rec := range r.Records {
		assert.Equal(t, 22050, rec.SampleRate)
		assert.Positive(t, rec.AudioBytes)
		assert.InDelta(t, float64(rec.AudioBytes/2)/22050, rec.AudioSeconds, 1e-9)
	}
}

// TestWorkerInFrontOfUpstream: the CLI wiring of --engine openai. Head B's
// only thinker is a worker whose upstream is `troupe up` (head A, an
// OpenAI-compatible server): B answers with what A's sim says.
func TestWorkerInFrontOfUpstream(t *testing.T) {
	a := background(t, "up", runUp, "--http", "127.0.0.1:0", "--log-level", "error")
	aBase := a.wait(t, apiRE)
	etcd := a.wait(t, etcdRE)
	a.wait(t, regexp.MustCompile(`(Press Ctrl-C)`))

	keyFile := filepath.Join(t.TempDir(), "key")
	require.NoError(t, os.WriteFile(keyFile, []byte("unused-by-troupe-up\n"), 0o600))
	pipeline := filepath.Join(t.TempDir(), "pipeline.yaml")
	require.NoError(t, os.WriteFile(pipeline, []byte("model: troupe-omni-sim\nstages:\n  - name: thinker\n"), 0o600))
	b := background(t, "head", runHead, "--etcd-endpoints", etcd, "--cluster", "b", "--pipeline", pipeline, "--http", "127.0.0.1:0", "--log-level", "error")
	bBase := b.wait(t, headRE)
	w := background(t, "worker", runWorker, "--etcd-endpoints", etcd, "--cluster", "b", "--stage", "thinker", "--engine", "openai",
		"--upstream", aBase+"/v1", "--upstream-api-key-file", keyFile, "--upstream-health-interval", "1s", "--log-level", "error")
	line := w.wait(t, workRE)
	assert.Contains(t, line, "engine openai, role text")

	probe := &http.Client{Transport: &http.Transport{}, Timeout: 5 * time.Second}
	defer probe.CloseIdleConnections()
	require.Eventually(t, func() bool {
		resp, err := probe.Get(bBase + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, 60*time.Second, 20*time.Millisecond)
	got := chat(t, bBase, `{"model":"troupe-omni-sim","seed":8,"messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}],"max_tokens":10}`)
	want, tokens, _ := sim.ExpectedText("system: be brief\nuser: hi", 8, 10)
	assert.Equal(t, want, got.Choices[0].Message.Content)
	assert.Equal(t, tokens, got.Usage.CompletionTokens)
	assert.Equal(t, len(tokenizers.Sim("system: be brief\nuser: hi")), got.Usage.PromptTokens)
}

func TestWorkerEngineFlags(t *testing.T) {
	parse := func(args ...string) *workerFlags {
		fs := newFlagSet("worker")
		wf := addWorkerFlags(fs)
		require.NoError(t, parseFlags(fs, append([]string{"--stage", "thinker"}, args...)))
		return wf
	}
	log, flushLog := (&logFlags{level: "error"}).logger()
	defer flushLog()
	assert.ErrorContains(t, parse("--engine", "vllm").checkEngine(log), `unknown --engine "vllm" (supported: sim, openai, openai-speech, openai-transcription, espeak, oip)`)
	assert.ErrorContains(t, parse("--engine", "openai").checkEngine(log), "needs --upstream URL")
	assert.ErrorContains(t, parse("--engine", "openai", "--upstream", "localhost:8000").checkEngine(log), "scheme must be http or https")
	assert.ErrorContains(t, parse("--engine", "openai-speech", "--upstream", "http://h/v1", "--upstream-speech-format", "mp3").checkEngine(log), "want wav or pcm")
	assert.ErrorContains(t, parse("--engine", "espeak", "--espeak-binary", "/nonexistent/espeak").checkEngine(log), "apt-get install espeak-ng")
	assert.ErrorContains(t, parse("--engine", "openai", "--upstream", "http://h/v1", "--upstream-api-key-file", "/nonexistent").checkEngine(log), "--upstream-api-key-file")
	assert.ErrorContains(t, parse("--engine", "oip", "--model", "m").checkEngine(log), "--engine oip needs --upstream ADDR (unix:///path/engine.sock or host:port)")
	assert.ErrorContains(t, parse("--engine", "oip", "--upstream", "unix:///run/e.sock").checkEngine(log), "--engine oip needs --model NAME")
	assert.ErrorContains(t, parse("--engine", "oip", "--upstream", "http://h:8001", "--model", "m").checkEngine(log), "want unix:///path/engine.sock or host:port")
	assert.ErrorContains(t, parse("--engine", "oip", "--upstream", "unix://e.sock", "--model", "m").checkEngine(log), "want unix:///absolute/path")
	assert.ErrorContains(t, parse("--engine", "oip", "--upstream", "h:8001", "--model", "m", "--upstream-model", "x").checkEngine(log), "are for the openai engines")
	require.NoError(t, parse("--engine", "oip", "--upstream", "unix:///run/e.sock", "--model", "m").checkEngine(log))
	ocfg, err := parse("--engine", "oip", "--upstream", "127.0.0.1:8001", "--model", "talker", "--upstream-health-failures", "5").oipConfig(log)
	require.NoError(t, err)
	assert.Equal(t, "127.0.0.1:8001", ocfg.Upstream)
	assert.Equal(t, "talker", ocfg.Model)
	assert.Equal(t, 5, ocfg.HealthFailures)
	assert.Empty(t, ocfg.MetricsURL, "no scrape without --upstream-metrics")
	ocfg, err = parse("--engine", "oip", "--upstream", "127.0.0.1:8001", "--model", "m", "--upstream-metrics", "http://127.0.0.1:8002/metrics").oipConfig(log)
	require.NoError(t, err)
	assert.Equal(t, "http://127.0.0.1:8002/metrics", ocfg.MetricsURL)
	assert.ErrorContains(t, parse("--engine", "oip", "--upstream", "h:8001", "--model", "m", "--upstream-metrics", "127.0.0.1:8002").checkEngine(log), "--upstream-metrics: oip: upstream metrics \"127.0.0.1:8002\": want an http or https URL")
	for _, engine := range []string{"sim", "openai", "espeak"} {
		assert.ErrorContains(t, parse("--engine", engine, "--upstream", "http://h:8000/v1", "--upstream-metrics", "http://h:8002/metrics").checkEngine(log), "--upstream-metrics is for --engine oip", engine)
	}

	// The key: from the environment, or from the file, which wins.
	t.Setenv("TROUPE_UPSTREAM_API_KEY", "from-env")
	cfg, err := parse("--engine", "openai", "--upstream", "http://h:8000").openaiConfig(log)
	require.NoError(t, err)
	assert.Equal(t, "from-env", cfg.APIKey)
	keyFile := filepath.Join(t.TempDir(), "key")
	require.NoError(t, os.WriteFile(keyFile, []byte("  from-file\n"), 0o600))
	cfg, err = parse("--engine", "openai", "--upstream", "http://h:8000", "--upstream-api-key-file", keyFile).openaiConfig(log)
	require.NoError(t, err)
	assert.Equal(t, "from-file", cfg.APIKey)

	// Every upstream flag also reads TROUPE_<FLAG>.
	t.Setenv("TROUPE_UPSTREAM", "http://env-host:9000/v1")
	t.Setenv("TROUPE_UPSTREAM_HEALTH_FAILURES", "7")
	cfg, err = parse("--engine", "openai").openaiConfig(log)
	require.NoError(t, err)
	assert.Equal(t, "http://env-host:9000/v1", cfg.URL)
	assert.Equal(t, 7, cfg.HealthFailures)

	fs := newFlagSet("up")
	hf := addHeadFlags(fs)
	require.NoError(t, parseFlags(fs, []string{"--pipeline", "p.yaml"}))
	_, err = upPipeline(hf, "espeak")
	assert.ErrorContains(t, err, "cannot be combined")
	_, err = upPipeline(hf, "festival")
	assert.ErrorContains(t, err, `unknown --speech "festival"`)
}
