package httpapi

import (
	"bytes"
	"encoding/binary"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"

	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
)

// requestSeeds are valid and broken request bodies the fuzzers start from.
var requestSeeds = []string{
	`{"model":"troupe","messages":[{"role":"user","content":"hi"}]}`,
	`{"model":"troupe","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"modalities":["text","audio"],"audio":{"voice":"alloy","format":"wav"}}`,
	`{"model":"troupe","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"audio":{"voice":{"id":"v"},"format":"pcm16"},"modalities":["audio"]}`,
	`{"model":"troupe","messages":[],"max_tokens":-1,"temperature":3,"stop":["a","b","c","d","e"],"n":2,"seed":1e99}`,
	`{"model":"troupe","prompt":"once upon","max_tokens":8,"echo":true,"stop":"\n","best_of":1,"suffix":""}`,
	`{"model":"troupe","prompt":["one"],"logprobs":null,"best_of":0,"user":"u","tool_choice":{"type":"function"}}`,
	`{"model":"troupe","prompt":[1,2,3]}`,
	`{"model":`, `null`, `[]`, `""`, `{"model":"troupe","messages":[{"role":"tool"}]}`,
	`{"model":"troupe","messages":[{"role":"user","content":"x"}],"max_completion_tokens":1,"top_p":0.5,"frequency_penalty":2,"presence_penalty":-2,"logprobs":true,"top_logprobs":3}`,
}

// checkAPIError is the decoders' contract: a refusal is a client error,
// never a 5xx (the request never reached the head).
func checkAPIError(t *testing.T, e *apiError) {
	t.Helper()
	if e == nil {
		return
	}
	if e.Status < 400 || e.Status > 499 {
		t.Fatalf("decoder answered status %d (%s: %s); a refused request must be a 4xx", e.Status, e.Code, e.Message)
	}
	if e.Message == "" || e.Type == "" || e.Code == "" {
		t.Fatalf("decoder answered an incomplete error: %+v", e)
	}
}

func FuzzParseChat(f *testing.F) {
	for _, s := range requestSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		j, e := parseChat(body, "troupe")
		checkAPIError(t, e)
		if _, mismatch := fastDecodeMismatch(body); mismatch != "" {
			t.Fatal(mismatch)
		}
		if e == nil && len(j.messages) == 0 {
			t.Fatalf("accepted a chat request without messages: %q", body)
		}
	})
}

func FuzzParseCompletion(f *testing.F) {
	for _, s := range requestSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		_, e := parseCompletion(body, "troupe")
		checkAPIError(t, e)
	})
}

// FuzzAdminPath sends arbitrary {stage}/{replica}/{verb}?level= paths to
// the admin routes of a real head with one sim replica per stage: the
// answer is 200 or a 4xx, never a 5xx, and never a panic.
func FuzzAdminPath(f *testing.F) {
	c := startCluster(f, orchestratortest.Options{DisableStats: true})
	s := New(c.Head, Config{Logger: slog.New(slog.DiscardHandler)})
	h := s.Handler()
	for _, seed := range []struct{ stage, replica, verb, level string }{
		{"thinker", "0", "sleep", "1"}, {"0", "0", "wake_up", ""}, {"talker", "0", "sleep", "2"},
		{"vocoder", "18446744073709551616", "sleep", "3"}, {"nope", "-1", "wake_up", "x"}, {"2", "4294967295", "sleep", ""},
		{"", "", "sleep", ""}, {"thinker", "0x1", "sleep", "01"}, {"..", "0", "wake_up", "1"},
	} {
		f.Add(seed.stage, seed.replica, seed.verb, seed.level)
	}
	f.Fuzz(func(t *testing.T, stage, replica, verb, level string) {
		target := "/v1/replicas/" + url.PathEscape(stage) + "/" + url.PathEscape(replica) + "/" + url.PathEscape(verb)
		if level != "" {
			target += "?level=" + url.QueryEscape(level)
		}
		req, err := http.NewRequest(http.MethodPost, target, nil)
		if err != nil {
			t.Skip("not a request URL")
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code >= 500 {
			t.Fatalf("POST %s: status %d: %s", target, rec.Code, rec.Body)
		}
		if rec.Code != http.StatusOK && !strings.Contains(rec.Body.String(), `"error"`) && rec.Code != http.StatusNotFound && rec.Code != http.StatusMethodNotAllowed {
			t.Fatalf("POST %s: status %d without an error body: %s", target, rec.Code, rec.Body)
		}
	})
}

// FuzzEncodeWAV checks the WAV writer against its reader's view: a RIFF
// header whose sizes match the samples kept, or an error, never a panic.
func FuzzEncodeWAV(f *testing.F) {
	f.Add([]byte{1, 2, 3, 4}, 24000)
	f.Add([]byte{1}, 16000)
	f.Add([]byte{}, 0)
	f.Add([]byte{0, 0, 0}, -1)
	f.Add([]byte{0xff, 0x7f}, 1<<24+1)
	f.Fuzz(func(t *testing.T, pcm []byte, rate int) {
		out, err := appendWAV(nil, pcm, rate)
		if err != nil {
			if rate > 0 && rate <= maxSampleRate {
				t.Fatalf("valid rate %d refused: %v", rate, err)
			}
			return
		}
		kept := len(pcm) &^ 1
		if len(out) != wavHeaderSize+kept {
			t.Fatalf("len %d, want %d", len(out), wavHeaderSize+kept)
		}
		le := binary.LittleEndian
		if string(out[0:4]) != "RIFF" || string(out[8:16]) != "WAVEfmt " || string(out[36:40]) != "data" {
			t.Fatalf("bad magic: %q", out[:44])
		}
		if int(le.Uint32(out[4:8])) != len(out)-8 || int(le.Uint32(out[40:44])) != kept || int(le.Uint32(out[24:28])) != rate {
			t.Fatalf("header sizes disagree with %d samples at %d Hz: % x", kept/2, rate, out[:44])
		}
		if int(le.Uint32(out[28:32])) != 2*rate {
			t.Fatalf("byte rate %d, want %d", le.Uint32(out[28:32]), 2*rate)
		}
		if string(out[44:]) != string(pcm[:kept]) {
			t.Fatal("samples changed")
		}
	})
}

// FuzzReadWAV: the WAV reader never panics, whatever the bytes; what it
// takes is 16-bit PCM within its limits, whose data is whole frames lying
// in the file; and it takes every file appendWAV writes, samples intact.
func FuzzReadWAV(f *testing.F) {
	pcm := []byte{1, 2, 3, 4, 5, 6}
	good, err := appendWAV(nil, pcm, 24000)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(good)
	f.Add(good[:10])
	f.Add([]byte{})
	f.Add([]byte("RIFF\xff\xff\xff\xffWAVEfmt \x10\x00\x00\x00\x01\x00\xff\xff\x00\x00\x00\x00"))
	f.Add(append(bytes.Clone(good[:36]), "LIST\x03\x00\x00\x00abc\x00data\x02\x00\x00\x00\x01\x02"...))
	f.Add(extensibleWAV(wavFormatPCM, pcm))
	f.Add(extensibleWAV(3, pcm))
	f.Fuzz(func(t *testing.T, b []byte) {
		w, err := readWAV(b)
		if err == nil {
			switch {
			case w.sampleRate < minInputSampleRate || w.sampleRate > maxInputSampleRate:
				t.Fatalf("took %d Hz", w.sampleRate)
			case w.channels < 1 || w.channels > maxInputChannels:
				t.Fatalf("took %d channels", w.channels)
			case len(w.data) == 0 || len(w.data)%(2*w.channels) != 0:
				t.Fatalf("took %d bytes of data for %d channels", len(w.data), w.channels)
			}
			if len(w.data) > len(b)-44 || !bytes.Contains(b, w.data) {
				t.Fatalf("%d bytes of data, not after a header in the %d bytes of the file", len(w.data), len(b))
			}
		} else if _, ok := err.(*audioError); !ok {
			t.Fatalf("error %T: %v", err, err)
		}
		if len(b) < 2 {
			return
		}
		wav, err := appendWAV(nil, b, 24000)
		if err != nil {
			t.Fatal(err)
		}
		back, err := readWAV(wav)
		if err != nil {
			t.Fatalf("appendWAV's file refused: %v", err)
		}
		if !bytes.Equal(back.data, b[:len(b)&^1]) || back.sampleRate != 24000 || back.channels != 1 {
			t.Fatalf("read back %d Hz, %d channels, %d bytes of %d", back.sampleRate, back.channels, len(back.data), len(b)&^1)
		}
	})
}
