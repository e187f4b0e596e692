package bench

import (
	"encoding/json"
	"errors"
	"io"

	"github.com/troupe-serving/troupe/pkg/sse"
)

// ReadDeltas reads a streamed chat completion (server-sent events) from r
// and calls onDelta with each non-empty content delta as it arrives. done
// reports whether the stream ended with "data: [DONE]".
func ReadDeltas(r io.Reader, onDelta func(content string)) (done bool, err error) {
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
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
		}
		if err := json.Unmarshal(data, &ev); err != nil {
			return done, err
		}
		if len(ev.Choices) > 0 && ev.Choices[0].Delta.Content != "" {
			onDelta(ev.Choices[0].Delta.Content)
		}
	}
}
