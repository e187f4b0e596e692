package httpapi

import (
	"encoding/base64"
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

func anyHead(t *rapid.T) (id, object string, created int64, model string) {
	return anyString.Draw(t, "id"), anyString.Draw(t, "object"), rapid.Int64().Draw(t, "created"), anyString.Draw(t, "model")
}

// TestAppendJSONIsEncodingJSON: the hand-written encoders write what
// encoding/json writes, byte for byte, for any value of their types (drawn
// field by field from the types themselves).
func TestAppendJSONIsEncodingJSON(t *testing.T) {
	for _, typ := range appenderTypes {
		t.Run(typ.Elem().Name(), rapid.MakeCheck(func(t *rapid.T) {
			v := drawValue(t, typ.Elem(), "response").Addr().Interface().(jsonAppender)
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

// TestAudioDeltaPCMIsItsBase64: audio given as PCM is written as the
// event encoding/json writes for its base64 data.
func TestAudioDeltaPCMIsItsBase64(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		pcm := rapid.SliceOfN(rapid.Byte(), 1, 4096).Draw(t, "pcm")
		chunk := func(a *audioDelta) *chatChunk {
			return &chatChunk{ID: "chatcmpl-1", Object: "chat.completion.chunk", Created: 1, Model: "m",
				Choices: []chatChunkChoice{{Delta: chatDelta{Audio: a}}}}
		}
		want, err := json.Marshal(chunk(&audioDelta{ID: "audio_1", Data: base64.StdEncoding.EncodeToString(pcm), ExpiresAt: 7}))
		require.NoError(t, err)
		require.Equal(t, string(want), string(chunk(&audioDelta{ID: "audio_1", pcm: pcm, ExpiresAt: 7}).appendJSON(nil)))
	})
}
