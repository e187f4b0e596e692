// Command vsnginx is the two halves of scripts/bench-vs-nginx.sh:
//
//	vsnginx backend -listen 127.0.0.1:9100 [-audio-body answer.json]
//	vsnginx load -target troupe -url http://127.0.0.1:8080 -c 32 -d 10s -pids 12,13 [-stream] [-audio]
//	vsnginx report < runs.jsonl
//
// backend is a minimal OpenAI-compatible server: POST /v1/chat/completions
// answers a fixed 16-token completion, as one JSON body or, with
// "stream": true, as one SSE event per token. A request for audio
// ("modalities" with "audio") gets the body of -audio-body: the script
// captures one of troupe's own audio answers, so nginx moves as many bytes
// as the head. It is what nginx proxies to.
//
// load posts chat completions (16 tokens, ignore_eos; with -audio, text
// and a WAV, which troupe makes through all three stages) from -c
// concurrent keep-alive clients for -d, checks each answer, and prints one
// line of JSON labelled -target (nginx, troupe, baseline): requests, req/s,
// p50/p99 latency, and the CPU the processes
// named by -pids (the proxy) spent per request, read from /proc/PID/stat
// (utime+stime of the process, its threads included) before and after.
//
// report turns load's lines into two Markdown tables: means per mode and
// target over the runs, and the troupe/nginx, baseline/nginx and
// troupe/baseline ratios (docs/benchmarks.md, "Against nginx", quotes them).
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/troupe-serving/troupe/test/bench"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: vsnginx backend|load|report [flags]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "backend":
		err = backend(os.Args[2:])
	case "load":
		err = load(os.Args[2:])
	case "report":
		err = runReport()
	default:
		err = fmt.Errorf("vsnginx: unknown command %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

// tokens is the backend's fixed answer, one word per token.
var tokens = strings.Fields("the quick brown fox jumps over the lazy dog and it runs back home to sleep")

func backend(args []string) error {
	fs := flag.NewFlagSet("backend", flag.ExitOnError)
	listen := fs.String("listen", "127.0.0.1:9100", "listen address")
	audioBody := fs.String("audio-body", "", "file whose content answers audio requests")
	_ = fs.Parse(args)
	var audio []byte
	if *audioBody != "" {
		var err error
		if audio, err = os.ReadFile(*audioBody); err != nil {
			return fmt.Errorf("vsnginx: %w", err)
		}
	}
	full := strings.Join(tokens, " ")
	nonStream, err := json.Marshal(map[string]any{
		"id": "chatcmpl-bench", "object": "chat.completion", "model": "bench",
		"choices": []map[string]any{{"index": 0, "finish_reason": "length",
			"message": map[string]any{"role": "assistant", "content": full}}},
		"usage": map[string]int{"prompt_tokens": 1, "completion_tokens": len(tokens), "total_tokens": len(tokens) + 1},
	})
	if err != nil {
		return err
	}
	events := make([][]byte, len(tokens))
	for i, t := range tokens {
		if i > 0 {
			t = " " + t
		}
		b, err := json.Marshal(map[string]any{
			"id": "chatcmpl-bench", "object": "chat.completion.chunk", "model": "bench",
			"choices": []map[string]any{{"index": 0, "delta": map[string]any{"content": t}}},
		})
		if err != nil {
			return err
		}
		events[i] = append(append([]byte("data: "), b...), '\n', '\n')
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Stream     bool     `json:"stream"`
			Modalities []string `json:"modalities"`
		}
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		if slices.Contains(req.Modalities, "audio") {
			if audio == nil {
				http.Error(w, "no -audio-body", http.StatusBadRequest)
				return
			}
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write(audio)
			return
		}
		if !req.Stream {
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write(nonStream)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		f := w.(http.Flusher)
		for _, e := range events {
			_, _ = w.Write(e)
			f.Flush() // one event per token, as an engine sends them
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	})
	return http.ListenAndServe(*listen, mux)
}

type result struct {
	Target      string  `json:"target"`
	Mode        string  `json:"mode"`
	Stream      bool    `json:"stream"`
	Requests    int     `json:"requests"`
	Errors      int     `json:"errors"`
	Seconds     float64 `json:"seconds"`
	ReqPerSec   float64 `json:"req_per_s"`
	P50Ms       float64 `json:"p50_ms"`
	P99Ms       float64 `json:"p99_ms"`
	CPUUsPerReq float64 `json:"cpu_us_per_req"`
}

func load(args []string) error {
	fs := flag.NewFlagSet("load", flag.ExitOnError)
	url := fs.String("url", "http://127.0.0.1:8000", "base URL of the proxy")
	target := fs.String("target", "", "label of this run in the output")
	model := fs.String("model", "troupe-omni-sim", "model of the requests")
	conc := fs.Int("c", 32, "concurrent clients")
	dur := fs.Duration("d", 10*time.Second, "duration of the measured run")
	warm := fs.Duration("warmup", time.Second, "unmeasured load before the run")
	stream := fs.Bool("stream", false, "ask for a streamed (SSE) answer")
	audio := fs.Bool("audio", false, "ask for text and audio (every stage of the pipeline): a WAV, or with -stream pcm16 chunks")
	pidList := fs.String("pids", "", "comma-separated pids of the proxy's processes whose CPU is counted")
	_ = fs.Parse(args)
	var pids []int
	for _, p := range strings.Split(*pidList, ",") {
		if p == "" {
			continue
		}
		n, err := strconv.Atoi(p)
		if err != nil {
			return fmt.Errorf("vsnginx: bad pid %q: %w", p, err)
		}
		pids = append(pids, n)
	}
	reqBody := map[string]any{
		"model": *model, "max_tokens": 16, "ignore_eos": true, "stream": *stream,
		"messages": []map[string]string{{"role": "user", "content": "tell me a story about a fox"}},
	}
	mode := "non-stream"
	switch {
	case *stream && *audio:
		mode = "stream-audio"
		reqBody["modalities"] = []string{"text", "audio"}
		reqBody["audio"] = map[string]string{"format": "pcm16"}
	case *stream:
		mode = "stream"
	case *audio:
		mode = "audio"
		reqBody["modalities"] = []string{"text", "audio"}
		reqBody["audio"] = map[string]string{"format": "wav"}
	}
	body, err := json.Marshal(reqBody)
	if err != nil {
		return err
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: *conc, MaxConnsPerHost: *conc}}
	do := func() error {
		resp, err := client.Post(*url+"/v1/chat/completions", "application/json", bytes.NewReader(body))
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			b, _ := io.ReadAll(resp.Body)
			return fmt.Errorf("vsnginx: status %d: %s", resp.StatusCode, b)
		}
		return check(resp.Body, *stream, *audio)
	}
	if err := do(); err != nil { // fail fast on a broken setup
		return err
	}
	run := func(d time.Duration) ([]time.Duration, int) {
		ctx, cancel := context.WithTimeout(context.Background(), d)
		defer cancel()
		var mu sync.Mutex
		var all []time.Duration
		errs := 0
		var wg sync.WaitGroup
		for range *conc {
			wg.Go(func() {
				var lat []time.Duration
				bad := 0
				for ctx.Err() == nil {
					t0 := time.Now()
					if err := do(); err != nil {
						bad++
						if bad == 1 {
							fmt.Fprintln(os.Stderr, err)
						}
						continue
					}
					lat = append(lat, time.Since(t0))
				}
				mu.Lock()
				all = append(all, lat...)
				errs += bad
				mu.Unlock()
			})
		}
		wg.Wait()
		return all, errs
	}
	run(*warm)
	cpu0, err := cpuTicks(pids)
	if err != nil {
		return err
	}
	t0 := time.Now()
	lat, errs := run(*dur)
	secs := time.Since(t0).Seconds()
	cpu1, err := cpuTicks(pids)
	if err != nil {
		return err
	}
	slices.Sort(lat)
	r := result{Target: *target, Mode: mode, Stream: *stream, Requests: len(lat), Errors: errs, Seconds: secs,
		ReqPerSec: float64(len(lat)) / secs, P50Ms: ms(pct(lat, 50)), P99Ms: ms(pct(lat, 99))}
	if len(lat) > 0 {
		r.CPUUsPerReq = float64(cpu1-cpu0) * 1e6 / clockTicks / float64(len(lat))
	}
	return json.NewEncoder(os.Stdout).Encode(r)
}

// check reads an answer and verifies it holds 16 tokens of content (and,
// for audio, a transcript and audio data).
func check(r io.Reader, stream, audio bool) error {
	if !stream {
		var out struct {
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
				CompletionTokens int `json:"completion_tokens"`
			} `json:"usage"`
		}
		if err := json.NewDecoder(r).Decode(&out); err != nil {
			return err
		}
		if out.Usage.CompletionTokens != 16 || len(out.Choices) != 1 {
			return fmt.Errorf("vsnginx: bad answer: %+v", out)
		}
		msg := out.Choices[0].Message
		switch {
		case audio && (msg.Audio == nil || msg.Audio.Data == "" || msg.Audio.Transcript == ""):
			return fmt.Errorf("vsnginx: an answer without audio and its transcript")
		case !audio && msg.Content == "":
			return fmt.Errorf("vsnginx: an answer without content")
		}
		return nil
	}
	if audio {
		return checkStreamedAudio(r)
	}
	deltas := 0
	done, err := bench.ReadDeltas(r, func(string) { deltas++ })
	if err != nil {
		return err
	}
	if !done || deltas == 0 {
		return errors.New("vsnginx: stream ended without content or [DONE]")
	}
	return nil
}

// clockTicks is USER_HZ, the unit of /proc/PID/stat's times (100 on Linux).
const clockTicks = 100

// cpuTicks sums utime+stime of pids.
func cpuTicks(pids []int) (int64, error) {
	var sum int64
	for _, pid := range pids {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return 0, fmt.Errorf("vsnginx: %w", err)
		}
		// Fields after the command name, which is in parentheses and may
		// hold spaces: state is field 3, utime 14, stime 15.
		s := string(b)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
		u, err1 := strconv.ParseInt(f[11], 10, 64)
		st, err2 := strconv.ParseInt(f[12], 10, 64)
		if err := errors.Join(err1, err2); err != nil {
			return 0, fmt.Errorf("vsnginx: /proc/%d/stat: %w", pid, err)
		}
		sum += u + st
	}
	return sum, nil
}

func pct(s []time.Duration, p int) time.Duration {
	if len(s) == 0 {
		return 0
	}
	i := (len(s)*p+99)/100 - 1
	return s[max(i, 0)]
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// checkStreamedAudio reads a streamed answer with audio and verifies it
// brought audio data and a transcript before [DONE].
func checkStreamedAudio(r io.Reader) error {
	var audioBytes, transcript int
	done, err := bench.ReadChunks(r, func(d bench.Delta) {
		if d.Audio != nil {
			audioBytes += len(d.Audio.Data)
			transcript += len(d.Audio.Transcript)
		}
	})
	if err != nil {
		return fmt.Errorf("vsnginx: %w", err)
	}
	if !done || audioBytes == 0 || transcript == 0 {
		return fmt.Errorf("vsnginx: streamed audio ended without audio (%d), transcript (%d) or [DONE]", audioBytes, transcript)
	}
	return nil
}
