package bench

import (
	"encoding/json"
	"errors"
	"io"

	"github.com/troupe-serving/troupe/pkg/sse"
)

// Delta is what a chunk of a streamed chat completion adds: text, and with
// audio asked for, base64 PCM16 and its transcript.
type Delta struct {
	Content string `json:"content"`
	Audio   *struct {
		Data       string `json:"data"`
		Transcript string `json:"transcript"`
	} `json:"audio"`
}

// ReadChunks reads a streamed chat completion (server-sent events) from r
// and calls onDelta with the first choice's delta of each chunk as it
// arrives. done reports whether the stream ended with "data: [DONE]".
func ReadChunks(r io.Reader, onDelta func(Delta)) (done bool, err error) {
	events := sse.NewReader(r)
	for {
		data, err := events.Next()
		if errors.Is(err, io.EOF) {
			return done, nil
		}
		if err != nil {
			return done, err
		}
		if string(data) == sse.Done {
			done = true
			continue
		}
		var ev struct {
			Choices []struct {
				Delta Delta `json:"delta"`
			} `json:"choices"`
		}
		if err := json.Unmarshal(data, &ev); err != nil {
			return done, err
		}
		if len(ev.Choices) > 0 {
			onDelta(ev.Choices[0].Delta)
		}
	}
}

// ReadDeltas is ReadChunks for text: onDelta gets each non-empty content
// delta.
func ReadDeltas(r io.Reader, onDelta func(content string)) (done bool, err error) {
	return ReadChunks(r, func(d Delta) {
		if d.Content != "" {
			onDelta(d.Content)
		}
	})
}
