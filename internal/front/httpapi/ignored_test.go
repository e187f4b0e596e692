package httpapi

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"

	"github.com/troupe-serving/troupe/orchestrator/orchestratortest"
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
		// Past 32 fields ignoredFields dedupes through a set: both ways
		// are drawn.
		n := rapid.IntRange(0, 80).Draw(t, "fields")
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

// unknownFields is a JSON object of known, then n unknown top-level
// fields (u0000000, u0000001, ...), then the first unknown one again as
// null, so it counts as unset, and the sorted names it reports.
func unknownFields(known string, n int) (body []byte, ignored []string) {
	var b strings.Builder
	b.Grow(len(known) + 14*n)
	b.WriteString("{")
	b.WriteString(known)
	for i := range n {
		fmt.Fprintf(&b, `,"u%07d":%d`, i, i)
		if i > 0 {
			ignored = append(ignored, fmt.Sprintf("u%07d", i))
		}
	}
	b.WriteString(`,"u0000000":null}`)
	return []byte(b.String()), ignored
}

// TestManyUnknownFields: a body of 300,000 unknown top-level fields
// (5.3 MB) is answered as a small one is, each field reported in the
// header once, the repeated one by its last occurrence, in time linear in
// its size (BenchmarkManyUnknownFields shows the cost per field).
func TestManyUnknownFields(t *testing.T) {
	c := startCluster(t, orchestratortest.Options{Pipeline: textPipeline()})
	a := startAPI(t, c, Config{}, nil, nil)
	const n = 300_000
	for _, tc := range []struct{ path, known, object string }{
		{"/v1/chat/completions", `"model":"troupe-omni-sim","messages":[{"role":"user","content":"hi"}],"max_tokens":2`, `"chat.completion"`},
		{"/v1/completions", `"model":"troupe-omni-sim","prompt":"hi","max_tokens":2`, `"text_completion"`},
	} {
		t.Run(strings.TrimPrefix(tc.path, "/v1/"), func(t *testing.T) {
			body, want := unknownFields(tc.known, n)
			require.Len(t, want, n-1)
			resp, answer := a.post(t, tc.path, string(body))
			require.Equal(t, http.StatusOK, resp.StatusCode, "%.300s", answer)
			assert.Contains(t, string(answer), `"object":`+tc.object)
			got := strings.Split(resp.Header.Get(ignoredHeader), ", ")
			require.Len(t, got, n-1, "every set unknown field is reported once")
			assert.Equal(t, want, got)
		})
	}
}

// TestIgnoredFieldsManyRepeats: past the pairwise comparison's few
// fields, a repeated key still counts by its last occurrence.
func TestIgnoredFieldsManyRepeats(t *testing.T) {
	var b strings.Builder
	b.WriteString(`{"model":"m"`)
	for i := range 100 {
		v := "null"
		if i%3 == 0 {
			v = strconv.Itoa(i)
		}
		fmt.Fprintf(&b, `,"k%d":%s`, i%10, v) // k0..k9, ten times each
	}
	b.WriteString(`,"model":1}`)
	body := []byte(b.String())
	// The last occurrence of kj is i = 90+j: set when i is a multiple of 3.
	assert.Equal(t, []string{"k0", "k3", "k6", "k9"}, ignoredFields(body, []string{"model"}))
	assert.Equal(t, ignoredFieldsByDecoding(body, []string{"model"}), ignoredFields(body, []string{"model"}))
}

// BenchmarkManyUnknownFields is the cost of a chat body of n unknown
// top-level fields, per field: flat from 1,000 to 1,000,000 fields when
// the cost is linear in the body's size. ignored is the walk alone,
// parse the whole parse (encoding/json's decoding, then the walk).
//
//	go test -run '^$' -bench ManyUnknownFields -benchtime 3x ./internal/front/httpapi/
func BenchmarkManyUnknownFields(b *testing.B) {
	const known = `"model":"troupe-omni-sim","messages":[{"role":"user","content":"hi"}],"max_tokens":2`
	for _, n := range []int{1_000, 10_000, 100_000, 1_000_000} {
		body, want := unknownFields(known, n)
		perField := func(b *testing.B) {
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n+1), "ns/field")
		}
		b.Run("ignored/fields="+strconv.Itoa(n), func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				if got := ignoredFields(body, chatFields); len(got) != len(want) {
					b.Fatalf("%d ignored, want %d", len(got), len(want))
				}
			}
			perField(b)
		})
		b.Run("parse/fields="+strconv.Itoa(n), func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				j, e := parseChatLimited(body, model, newPartBudget(0, 0))
				if e != nil || len(j.ignored) != len(want) {
					b.Fatalf("%v: %d ignored, want %d", e, len(j.ignored), len(want))
				}
			}
			perField(b)
		})
	}
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
