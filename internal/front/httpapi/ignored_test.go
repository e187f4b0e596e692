package httpapi

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"
)

// presence records whether a field is set (the reference decoder's).
type presence struct{ set bool }

func (p *presence) UnmarshalJSON(b []byte) error {
	p.set = !isNull(b)
	return nil
}

// ignoredFieldsByDecoding is what ignoredFields must answer: encoding/json
// decoding the whole object.
func ignoredFieldsByDecoding(body []byte, used []string) []string {
	var fields map[string]presence
	if json.Unmarshal(body, &fields) != nil {
		return nil
	}
	var out []string
	for name, p := range fields {
		if p.set && !slices.Contains(used, name) {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}

func TestIgnoredFields(t *testing.T) {
	used := []string{"model", "messages"}
	for body, want := range map[string][]string{
		`{"model":"m","messages":[{"role":"user","content":"a, \"b\" } ]"}],"seed":1}`: {"seed"},
		` { "model" : "m" , "top_k" : null , "best_of":[1,{"a":[2]}],"x":{"y":"}"}}`:   {"best_of", "x"},
		`{"seed":1,"seed":null}`:                 nil, // the last occurrence counts
		`{"seed":null,"seed":true}`:              {"seed"},
		`{"s\u0065ed":1,"model\n":2}`:            {"model\n", "seed"},
		`{}`:                                     nil,
		`{"a":"\\","b":-1.5e3,"c":false,"d":""}`: {"a", "b", "c", "d"},
	} {
		require.True(t, json.Valid([]byte(body)), body)
		assert.Equal(t, want, ignoredFields([]byte(body), used), body)
		assert.Equal(t, ignoredFieldsByDecoding([]byte(body), used), ignoredFields([]byte(body), used), body)
	}
}

// TestIgnoredFieldsMatchesDecoding: for any JSON object, walking its top
// level finds what decoding it whole finds.
func TestIgnoredFieldsMatchesDecoding(t *testing.T) {
	keys := []string{"model", "messages", "seed", "top_k", "n", "é", `q"uote`, `back\slash`, "model"}
	var value func(t *rapid.T, depth int) any
	value = func(t *rapid.T, depth int) any {
		switch k := rapid.IntRange(0, 6).Draw(t, "kind"); {
		case k == 0:
			return nil
		case k == 1:
			return rapid.Bool().Draw(t, "b")
		case k == 2:
			return rapid.Float64().Draw(t, "f")
		case k == 3:
			return rapid.StringOf(rapid.RuneFrom([]rune("ab{}[],:\"\\ \n\té"))).Draw(t, "s")
		case k == 4 && depth < 3:
			return []any{value(t, depth+1), value(t, depth+1)}
		case k == 5 && depth < 3:
			return map[string]any{rapid.SampledFrom(keys).Draw(t, "k"): value(t, depth+1)}
		}
		return "leaf"
	}
	rapid.Check(t, func(t *rapid.T) {
		var b strings.Builder
		b.WriteString("{")
		n := rapid.IntRange(0, 8).Draw(t, "fields")
		for i := range n {
			if i > 0 {
				b.WriteString(rapid.SampledFrom([]string{",", " ,", ",\n "}).Draw(t, "comma"))
			}
			k, _ := json.Marshal(rapid.SampledFrom(keys).Draw(t, "key"))
			v, err := json.Marshal(value(t, 0))
			if err != nil {
				t.Skip(err) // NaN and the like: not JSON
			}
			b.Write(k)
			b.WriteString(rapid.SampledFrom([]string{":", " : ", ":\t"}).Draw(t, "colon"))
			b.Write(v)
		}
		b.WriteString(rapid.SampledFrom([]string{"}", " }", "\n}"}).Draw(t, "close"))
		body := []byte(b.String())
		if !json.Valid(body) {
			t.Fatalf("the generator made invalid JSON: %s", body)
		}
		used := []string{"model", "messages"}
		if got, want := ignoredFields(body, used), ignoredFieldsByDecoding(body, used); !slices.Equal(got, want) {
			t.Fatalf("%s: walking finds %q, decoding %q", body, got, want)
		}
	})
}

// BenchmarkIgnoredFields is the check every chat request pays.
//
//	go test -run '^$' -bench IgnoredFields -benchmem ./internal/front/httpapi/
func BenchmarkIgnoredFields(b *testing.B) {
	body := []byte(`{"model":"troupe-omni-sim","max_tokens":16,"ignore_eos":true,"stream":false,"messages":[{"role":"user","content":"tell me a story about a fox"}],"user":"u1"}`)
	b.Run("walk", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			ignoredFields(body, chatFields)
		}
	})
	b.Run("decode", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			ignoredFieldsByDecoding(body, chatFields)
		}
	})
}

// messageContent reads a string content without escapes from its bytes; it
// must say what encoding/json says of it, for any bytes (invalid UTF-8
// included).
func TestMessageTextMatchesEncodingJSON(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		body := rapid.SliceOf(rapid.ByteRange(0x20, 0xff)).Draw(t, "body") // no control bytes: most are JSON strings
		raw := append(append([]byte{'"'}, body...), '"')
		if !json.Valid(raw) {
			t.Skip("not a JSON string: the body's decoder refuses it first")
		}
		var want string
		if err := json.Unmarshal(raw, &want); err != nil {
			t.Fatalf("valid but not decoded: %v", err)
		}
		got, parts, e := messageContent("messages[0].content", raw, newPartBudget(0, 0))
		if e != nil {
			t.Fatalf("refused: %v", e)
		}
		if got != want || parts != nil {
			t.Fatalf("messageContent %q (parts %v), encoding/json %q", got, parts, want)
		}
	})
}
