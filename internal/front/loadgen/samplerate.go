package loadgen

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
)

// probeSampleRate learns the rate of the server's audio before a run: it
// asks for one answer with audio as a whole WAV (OpenAI's
// audio.format "wav", which troupe writes at the rate of the last stage
// that made it) and reads the rate from the WAV's header. The streamed
// pcm16 of an OpenAI chat carries no rate: OpenAI's is 24000 Hz, but an
// engine such as espeak speaks at 22050 Hz, and assuming the wrong one
// misstates every audio length and real-time factor by their ratio.
func (c *client) probeSampleRate(ctx context.Context, maxTokens int) (int, error) {
	f := false
	req := Request{Prompt: "say hello", MaxTokens: min(maxTokens, 8), Modalities: []string{"text", "audio"}, Stream: &f}
	body := chatBody{Model: c.model, Messages: []Message{{Role: "user", Content: req.Prompt}}, MaxTokens: req.MaxTokens,
		Modalities: req.Modalities, Audio: map[string]any{"voice": c.voice, "format": "wav"}, IgnoreEOS: c.ignoreEOS}
	data, err := json.Marshal(body)
	if err != nil {
		return 0, err
	}
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, c.url, bytes.NewReader(data))
	if err != nil {
		return 0, err
	}
	hreq.Header.Set("Content-Type", "application/json")
	if c.apiKey != "" {
		hreq.Header.Set("Authorization", "Bearer "+c.apiKey)
	}
	resp, err := c.http.Do(hreq)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return 0, fmt.Errorf("status %d: %s", resp.StatusCode, strings.TrimSpace(string(msg)))
	}
	var a wholeAnswer
	if err := json.NewDecoder(resp.Body).Decode(&a); err != nil {
		return 0, fmt.Errorf("decoding the answer: %w", err)
	}
	if len(a.Choices) == 0 || a.Choices[0].Message.Audio == nil || a.Choices[0].Message.Audio.Data == "" {
		return 0, errors.New("the answer has no audio")
	}
	wav, err := base64.StdEncoding.DecodeString(a.Choices[0].Message.Audio.Data)
	if err != nil {
		return 0, fmt.Errorf("the answer's audio is not base64: %w", err)
	}
	return wavSampleRate(wav)
}

// wavSampleRate reads the sample rate of a RIFF WAVE file's fmt chunk.
func wavSampleRate(b []byte) (int, error) {
	if len(b) < 12 || string(b[:4]) != "RIFF" || string(b[8:12]) != "WAVE" {
		return 0, errors.New("the audio is not a RIFF WAVE file")
	}
	for off := 12; off+8 <= len(b); {
		id, size := string(b[off:off+4]), int(binary.LittleEndian.Uint32(b[off+4:off+8]))
		off += 8
		if id == "fmt " {
			if size < 16 || off+16 > len(b) {
				return 0, errors.New("the WAV's fmt chunk is short")
			}
			rate := int(binary.LittleEndian.Uint32(b[off+4 : off+8]))
			if rate <= 0 {
				return 0, fmt.Errorf("the WAV says %d Hz", rate)
			}
			return rate, nil
		}
		if size < 0 || size > len(b)-off {
			break
		}
		off += size + size%2 // chunks are padded to even sizes
	}
	return 0, errors.New("the WAV has no fmt chunk")
}
