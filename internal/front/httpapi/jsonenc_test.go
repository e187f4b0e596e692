package httpapi

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"
)

// anyString is any string: text, HTML, control bytes, U+2028 and invalid
// UTF-8 included.
var anyString = rapid.OneOf(
	rapid.String(),
	rapid.SampledFrom([]string{"", "<b>&amp;</b>", "a\u2028b\u2029", "\x00\x1f\x7f\b\f\n\r\t\"\\", "\xff\xfe", "é\xc3", "🦊"}),
	rapid.Map(rapid.SliceOf(rapid.Byte()), func(b []byte) string { return string(b) }),
)

func anyStringPtr(t *rapid.T, label string) *string {
	if rapid.Bool().Draw(t, label+"-set") {
		s := anyString.Draw(t, label)
		return &s
	}
	return nil
}

func anyLogprobs(t *rapid.T) *struct{} {
	if rapid.Bool().Draw(t, "logprobs-set") {
		return &struct{}{}
	}
	return nil
}

func anyUsage(t *rapid.T) *usage {
	if !rapid.Bool().Draw(t, "usage-set") {
		return nil
	}
	n := rapid.IntRange(-1, 1<<40)
	return &usage{PromptTokens: n.Draw(t, "prompt"), CompletionTokens: n.Draw(t, "completion"), TotalTokens: n.Draw(t, "total")}
}

func anyChunkUsage(t *rapid.T) any {
	switch rapid.IntRange(0, 2).Draw(t, "chunk-usage") {
	case 0:
		return nil
	case 1:
		return nullUsage
	}
	return &usage{PromptTokens: 3, CompletionTokens: 4, TotalTokens: 7}
}

func anyHead(t *rapid.T) (id, object string, created int64, model string) {
	return anyString.Draw(t, "id"), anyString.Draw(t, "object"), rapid.Int64().Draw(t, "created"), anyString.Draw(t, "model")
}

func anyCompletion(t *rapid.T) *chatCompletion {
	c := &chatCompletion{Usage: anyUsage(t)}
	c.ID, c.Object, c.Created, c.Model = anyHead(t)
	if rapid.Bool().Draw(t, "choices-set") {
		c.Choices = rapid.SliceOfN(rapid.Custom(func(t *rapid.T) chatChoice {
			ch := chatChoice{
				Index:        rapid.Int().Draw(t, "index"),
				Logprobs:     anyLogprobs(t),
				FinishReason: anyString.Draw(t, "finish"),
				Message: chatResponseMessage{
					Role: anyString.Draw(t, "role"), Content: anyString.Draw(t, "content"), Refusal: anyStringPtr(t, "refusal"),
				},
			}
			if rapid.Bool().Draw(t, "audio-set") {
				a := &audioOut{ID: anyString.Draw(t, "audio-id"), ExpiresAt: rapid.Int64().Draw(t, "expires"), Transcript: anyString.Draw(t, "transcript")}
				if rapid.Bool().Draw(t, "data-set") {
					a.Data = rapid.SliceOf(rapid.Byte()).Draw(t, "data")
				}
				ch.Message.Audio = a
			}
			return ch
		}), 0, 2).Draw(t, "choices")
	}
	return c
}

func anyChunk(t *rapid.T) *chatChunk {
	c := &chatChunk{Usage: anyChunkUsage(t)}
	c.ID, c.Object, c.Created, c.Model = anyHead(t)
	if rapid.Bool().Draw(t, "choices-set") {
		c.Choices = rapid.SliceOfN(rapid.Custom(func(t *rapid.T) chatChunkChoice {
			ch := chatChunkChoice{Index: rapid.Int().Draw(t, "index"), Logprobs: anyLogprobs(t), FinishReason: anyStringPtr(t, "finish")}
			if rapid.Bool().Draw(t, "role-set") {
				ch.Delta.Role = anyString.Draw(t, "role")
			}
			ch.Delta.Content = anyStringPtr(t, "content")
			if rapid.Bool().Draw(t, "audio-set") {
				a := &audioDelta{ID: anyString.Draw(t, "audio-id")}
				if rapid.Bool().Draw(t, "data-set") {
					a.Data = anyString.Draw(t, "data")
				}
				if rapid.Bool().Draw(t, "transcript-set") {
					a.Transcript = anyString.Draw(t, "transcript")
				}
				if rapid.Bool().Draw(t, "expires-set") {
					a.ExpiresAt = rapid.Int64().Draw(t, "expires")
				}
				ch.Delta.Audio = a
			}
			return ch
		}), 0, 2).Draw(t, "choices")
	}
	return c
}

func anyTextCompletion(t *rapid.T) *textCompletion {
	c := &textCompletion{Usage: anyChunkUsage(t)}
	c.ID, c.Object, c.Created, c.Model = anyHead(t)
	if rapid.Bool().Draw(t, "choices-set") {
		c.Choices = rapid.SliceOfN(rapid.Custom(func(t *rapid.T) completionChoice {
			return completionChoice{Index: rapid.Int().Draw(t, "index"), Text: anyString.Draw(t, "text"), Logprobs: anyLogprobs(t), FinishReason: anyStringPtr(t, "finish")}
		}), 0, 2).Draw(t, "choices")
	}
	return c
}

// TestAppendJSONIsEncodingJSON: the hand-written encoders write what
// encoding/json writes, byte for byte, for any value of their types.
func TestAppendJSONIsEncodingJSON(t *testing.T) {
	for name, draw := range map[string]func(*rapid.T) jsonAppender{
		"chat.completion":       func(t *rapid.T) jsonAppender { return anyCompletion(t) },
		"chat.completion.chunk": func(t *rapid.T) jsonAppender { return anyChunk(t) },
		"text_completion":       func(t *rapid.T) jsonAppender { return anyTextCompletion(t) },
	} {
		t.Run(name, rapid.MakeCheck(func(t *rapid.T) {
			v := draw(t)
			want, err := json.Marshal(v)
			require.NoError(t, err)
			prefix := []byte("data: ")
			got := v.appendJSON(prefix)
			require.Equal(t, string(want), string(got[len(prefix):]))
			require.True(t, json.Valid(got[len(prefix):]))
		}))
	}
}

func BenchmarkAppendJSON(b *testing.B) {
	content := "Once upon a time, a fox crossed the river and met a heron, who said: \"the water is cold today\"."
	reason := "stop"
	c := &chatCompletion{
		ID: "chatcmpl-0123456789abcdef0123456789abcdef", Object: "chat.completion", Created: 1764633600, Model: "troupe-omni-sim",
		Choices: []chatChoice{{Message: chatResponseMessage{Role: "assistant", Content: content}, FinishReason: reason}},
		Usage:   &usage{PromptTokens: 12, CompletionTokens: 16, TotalTokens: 28},
	}
	b.Run("append", func(b *testing.B) {
		b.ReportAllocs()
		var buf []byte
		for b.Loop() {
			buf = c.appendJSON(buf[:0])
		}
	})
	b.Run("encoding-json", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := json.Marshal(c); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// TestAppendTextChunkIsTheChunk: a token's event, encoded around its
// delta, is the chunk encoding/json writes, for the first delta of an
// answer and the ones after it.
func TestAppendTextChunkIsTheChunk(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		id, _, created, model := anyHead(t)
		includeUsage := rapid.Bool().Draw(t, "include-usage")
		chat := &chatResponder{id: id, created: created, model: model, includeUsage: includeUsage}
		text := &completionResponder{id: id, created: created, model: model, includeUsage: includeUsage}
		for _, delta := range []string{anyString.Draw(t, "first"), anyString.Draw(t, "second")} {
			want, err := json.Marshal(chat.chunk(chatDelta{Content: &delta}, nil))
			require.NoError(t, err)
			require.Equal(t, string(want), string(chat.appendTextChunk(nil, delta)))

			want, err = json.Marshal(text.chunk(delta, nil))
			require.NoError(t, err)
			require.Equal(t, string(want), string(text.appendTextChunk([]byte("data: "), delta)[len("data: "):]))
		}
	})
}

func BenchmarkAppendTextChunk(b *testing.B) {
	c := &chatResponder{id: "chatcmpl-0123456789abcdef0123456789abcdef", created: 1764633600, model: "troupe-omni-sim"}
	b.ReportAllocs()
	buf := c.appendTextChunk(nil, "")
	for b.Loop() {
		buf = c.appendTextChunk(buf[:0], " fox")
	}
}
