package httpapi

import (
	"encoding/json"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"
)

// The request and response structs are the one table of the API's JSON
// fields. These helpers walk them by reflection, as encoding/json does, so
// that the tests cover a field as soon as it is declared: the fast decoder
// and ignoredFields must take a body with every request field set, the
// hand encoder must write every response field set.

// jsonFields are the fields of the struct type t that encoding/json sees:
// exported, not "-", promoted from embedded structs; with their JSON
// names.
func jsonFields(t reflect.Type) (fields []reflect.StructField, names []string) {
	for _, f := range reflect.VisibleFields(t) {
		if f.Anonymous && isStruct(f.Type) || !f.IsExported() {
			continue
		}
		tag := f.Tag.Get("json")
		if tag == "-" {
			continue
		}
		name, _, _ := strings.Cut(tag, ",")
		if name == "" {
			name = f.Name
		}
		fields = append(fields, f)
		names = append(names, name)
	}
	return fields, names
}

// everyFieldSet returns a value of type typ with every field encoding/json
// sees set, down to the leaves: pointers point, slices hold one element,
// numbers are not 0. Strings are plain (no escapes), as in the usual
// request. It fails on a type it does not know, naming the field.
func everyFieldSet(t testing.TB, typ reflect.Type, path string) reflect.Value {
	t.Helper()
	v := reflect.New(typ).Elem()
	if typ == reflect.TypeFor[json.RawMessage]() {
		v.Set(reflect.ValueOf(json.RawMessage(`"raw"`)))
		return v
	}
	switch typ.Kind() {
	case reflect.String:
		v.SetString("set")
	case reflect.Bool:
		v.SetBool(true)
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		v.SetInt(7)
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		v.SetUint(7)
	case reflect.Float32, reflect.Float64:
		v.SetFloat(0.5)
	case reflect.Pointer:
		p := reflect.New(typ.Elem())
		p.Elem().Set(everyFieldSet(t, typ.Elem(), path))
		v.Set(p)
	case reflect.Slice:
		v.Set(reflect.Append(v, everyFieldSet(t, typ.Elem(), path+"[0]")))
	case reflect.Interface: // the chunks' usage: nil, nullUsage or *usage
		v.Set(everyFieldSet(t, reflect.TypeFor[*usage](), path))
	case reflect.Struct:
		fields, names := jsonFields(typ)
		for i, f := range fields {
			v.FieldByIndex(f.Index).Set(everyFieldSet(t, f.Type, path+"."+names[i]))
		}
	default:
		t.Fatalf("%s: everyFieldSet does not know the type %s", path, typ)
	}
	return v
}

// drawValue draws a value of type typ, each field set or not, with any
// string (escapes, invalid UTF-8), any number.
func drawValue(t *rapid.T, typ reflect.Type, label string) reflect.Value {
	v := reflect.New(typ).Elem()
	if typ == reflect.TypeFor[[]byte]() {
		if rapid.Bool().Draw(t, label+"-set") {
			v.SetBytes(rapid.SliceOf(rapid.Byte()).Draw(t, label))
		}
		return v
	}
	switch typ.Kind() {
	case reflect.String:
		v.SetString(anyString.Draw(t, label))
	case reflect.Bool:
		v.SetBool(rapid.Bool().Draw(t, label))
	case reflect.Int, reflect.Int64:
		v.SetInt(rapid.Int64().Draw(t, label))
	case reflect.Pointer:
		if rapid.Bool().Draw(t, label+"-set") {
			p := reflect.New(typ.Elem())
			p.Elem().Set(drawValue(t, typ.Elem(), label))
			v.Set(p)
		}
	case reflect.Slice:
		if rapid.Bool().Draw(t, label+"-set") {
			v.Set(reflect.MakeSlice(typ, 0, 2))
			for range rapid.IntRange(0, 2).Draw(t, label+"-len") {
				v.Set(reflect.Append(v, drawValue(t, typ.Elem(), label+"-el")))
			}
		}
	case reflect.Interface: // the chunks' usage: nil, nullUsage or *usage
		switch rapid.IntRange(0, 2).Draw(t, label) {
		case 1:
			v.Set(reflect.ValueOf(nullUsage))
		case 2:
			v.Set(drawValue(t, reflect.TypeFor[*usage](), label))
		}
	case reflect.Struct:
		fields, names := jsonFields(typ)
		for i, f := range fields {
			v.FieldByIndex(f.Index).Set(drawValue(t, f.Type, label+"."+names[i]))
		}
	default:
		t.Fatalf("%s: drawValue does not know the type %s", label, typ)
	}
	return v
}

// TestRequestFieldsAreTheStructs: the field lists the endpoints compare
// against are the structs' fields, shared ones included.
func TestRequestFieldsAreTheStructs(t *testing.T) {
	_, common := jsonFields(reflect.TypeFor[samplingFields]())
	for name, tc := range map[string]struct {
		typ  reflect.Type
		used []string
	}{
		"chat":       {reflect.TypeFor[chatRequest](), chatFields},
		"completion": {reflect.TypeFor[completionRequest](), completionFields},
	} {
		_, names := jsonFields(tc.typ)
		assert.ElementsMatch(t, names, tc.used, name)
		assert.Subset(t, tc.used, common, name)
		assert.Contains(t, tc.used, "model", name) // a field of samplingFields: the embedding is walked
	}
}

// TestFastDecodeCoversEveryField: a chat request (and a message) with
// every field set is taken by the fast decoder, not left to encoding/json,
// and decodes to the value it was written from, as encoding/json decodes
// it; a request of either endpoint with every field set has no ignored
// field. A field added to a request struct with a type the fast decoder
// does not know fails here.
func TestFastDecodeCoversEveryField(t *testing.T) {
	t.Run("chat", func(t *testing.T) {
		want := everyFieldSet(t, reflect.TypeFor[chatRequest](), "chat").Interface().(chatRequest)
		body, err := json.Marshal(want)
		require.NoError(t, err)
		var fast chatRequest
		ignored, ok := decodeChatFast(body, &fast)
		require.True(t, ok, "the fast decoder left %s to encoding/json; fields it does not decode: %q", body, slowFields(chatDecoder.objectDecoder))
		assert.Empty(t, ignored, string(body))
		assert.Equal(t, want, fast, string(body))
		var slow chatRequest
		require.NoError(t, json.Unmarshal(body, &slow))
		assert.Equal(t, slow, fast, string(body))
		assert.Empty(t, ignoredFields(body, chatFields), string(body))
	})
	t.Run("message", func(t *testing.T) {
		want := everyFieldSet(t, reflect.TypeFor[chatMessage](), "message").Interface().(chatMessage)
		body, err := json.Marshal(want)
		require.NoError(t, err)
		var fast chatMessage
		require.True(t, decodeMessageFast(body, &fast), "the fast decoder left %s to encoding/json; fields it does not decode: %q", body, slowFields(messageDecoder.objectDecoder))
		assert.Equal(t, want, fast, string(body))
	})
	t.Run("completion", func(t *testing.T) {
		body, err := json.Marshal(everyFieldSet(t, reflect.TypeFor[completionRequest](), "completion").Interface())
		require.NoError(t, err)
		assert.Empty(t, ignoredFields(body, completionFields), string(body))
	})
}

// slowFields are the fields, nested ones included, that d leaves to
// encoding/json.
func slowFields(d *objectDecoder) []string {
	var out []string
	for i, f := range d.fields {
		switch {
		case f.set == nil:
			out = append(out, d.names[i]+" ("+f.typ.String()+")")
		case f.sub != nil:
			for _, s := range slowFields(f.sub) {
				out = append(out, d.names[i]+"."+s)
			}
		}
	}
	return out
}

// TestAppendJSONCoversEveryField: the hand encoders write every field of
// their types, omitempty ones included, as encoding/json writes them when
// every field is set. A field added to a response struct and not to its
// encoder fails here.
func TestAppendJSONCoversEveryField(t *testing.T) {
	for _, typ := range appenderTypes {
		t.Run(typ.String(), func(t *testing.T) {
			v := everyFieldSet(t, typ, typ.Elem().Name()).Interface().(jsonAppender)
			want, err := json.Marshal(v)
			require.NoError(t, err)
			assert.Equal(t, string(want), string(v.appendJSON(nil)))
		})
	}
}

// appenderTypes are the types encoded by hand.
var appenderTypes = []reflect.Type{
	reflect.TypeFor[*chatCompletion](),
	reflect.TypeFor[*chatChunk](),
	reflect.TypeFor[*textCompletion](),
}

// requestKinds are the JSON kinds the chat request's fields take, at any
// depth, by name, from their Go types: what the generators of requests
// draw for a known key. A field of another type (a raw value, a type the
// fast decoder does not know) has no kind: any value is drawn for it.
func requestKinds() map[string]string {
	// Arrays of raw elements say nothing of their elements: named here.
	arrays := map[string]string{"messages": "messages", "modalities": "strings"}
	kinds := map[string]string{}
	var walk func(d *objectDecoder)
	walk = func(d *objectDecoder) {
		for i, f := range d.fields {
			name := d.names[i]
			switch f.typ {
			case reflect.TypeFor[*string]():
				kinds[name] = "string"
			case reflect.TypeFor[*bool]():
				kinds[name] = "bool"
			case reflect.TypeFor[*int64]():
				kinds[name] = "int"
			case reflect.TypeFor[*float64]():
				kinds[name] = "number"
			case reflect.TypeFor[[]json.RawMessage]():
				if kind, ok := arrays[name]; ok {
					kinds[name] = kind
				}
			default:
				if f.sub != nil {
					kinds[name] = "object"
					walk(f.sub)
				}
			}
		}
	}
	walk(chatDecoder.objectDecoder)
	walk(messageDecoder.objectDecoder)
	return kinds
}

// nestedNames are the JSON names of the fields of the objects inside a
// chat request (stream_options, audio...).
func nestedNames() []string {
	var out []string
	for _, f := range chatDecoder.fields {
		if f.sub != nil {
			out = append(out, f.sub.names...)
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// withOtherCase adds, for each name, the name with its first letter in
// upper case: a key encoding/json matches to the field and the fast
// decoder must not.
func withOtherCase(names []string) []string {
	out := slices.Clone(names)
	for _, n := range names {
		out = append(out, strings.ToUpper(n[:1])+n[1:])
	}
	return out
}
