package httpapi

import (
	"bytes"
	"encoding/json"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
	"unsafe"
)

// A chat request of the usual shape (known fields of the expected types,
// plain strings, each key once) is decoded by walking it once: reflection
// is a visible share of the head's CPU per request. Anything else (a wrong
// type, an escaped string, a key in another case, a repeated key) goes
// through encoding/json, whose errors name the field. Either way the
// request decodes to the same value: TestFastDecodeIsEncodingJSON.
//
// The request structs are the one table of the request's fields: their
// json tags name the fields, their Go types say how each decodes, and the
// embedding of samplingFields says which endpoints share them. The fast
// decoders, the field lists ignoredFields compares against, and the tests'
// generators are all derived from them, so a field added to a struct is
// decoded fast, counted as used and generated without another edit
// (TestFastDecodeCoversEveryField fails when its type is one the fast
// decoder leaves to encoding/json).

// The decoders of the request structs, and the top-level fields each
// endpoint reads: every other field is accepted, ignored and reported in
// the X-Troupe-Ignored-Params header.
var (
	chatDecoder      = decoderFor[chatRequest]()
	messageDecoder   = decoderFor[chatMessage]()
	chatFields       = chatDecoder.names
	completionFields = decoderFor[completionRequest]().names
)

// decodeChatFast decodes body into req, a zero chatRequest, and returns
// the fields it ignored, as ignoredFields would, when body has the usual
// shape; ok is false, and req to be reset, when it does not.
func decodeChatFast(body []byte, req *chatRequest) (ignored []string, ok bool) {
	if !json.Valid(body) {
		return nil, false
	}
	var unknown [8][]byte
	nUnknown := 0
	ok = chatDecoder.decode(req, body, func(key, val []byte) bool {
		// A repeat would need its last occurrence to count: left to
		// ignoredFields.
		if nUnknown == len(unknown) || slices.ContainsFunc(unknown[:nUnknown], func(k []byte) bool { return bytes.Equal(k, key) }) {
			return false
		}
		unknown[nUnknown] = key
		nUnknown++
		if !isNullLiteral(val) {
			ignored = append(ignored, string(key))
		}
		return true
	})
	if !ok {
		return nil, false
	}
	slices.Sort(ignored)
	return ignored, true
}

// decodeMessageFast decodes a message of the usual shape, as decodeValue
// would; ok is false, and m to be reset, when raw has another shape.
func decodeMessageFast(raw []byte, m *chatMessage) bool {
	return messageDecoder.decode(m, raw, nil)
}

// structDecoder is the fast decoder of the struct T. objectDecoder writes
// through unsafe pointers, at the offsets reflect gave for T's fields, with
// the setter of each field's type: sound only into a *T, which this type
// ensures.
type structDecoder[T any] struct{ *objectDecoder }

// decoderFor derives the fast decoder of T from its fields.
func decoderFor[T any]() structDecoder[T] {
	return structDecoder[T]{objectDecoderOf(reflect.TypeFor[T]())}
}

// decode decodes obj into v, a zero T, as encoding/json would; it reports
// false, leaving v to be reset, when obj has another shape than the usual
// one. unknown is called for each key no field has (nil: skipped).
func (d structDecoder[T]) decode(v *T, obj []byte, unknown func(key, val []byte) bool) bool {
	return d.objectDecoder.decode(unsafe.Pointer(v), obj, unknown)
}

// objectDecoder decodes a JSON object into the struct type it was derived
// from, field by field, writing each at its offset: reflection runs once,
// at start-up, to choose each field's setter; decoding is an indirect call
// per field, no slower than the switch on the key it replaced
// (BenchmarkParseChat).
type objectDecoder struct {
	names  []string       // the fields' JSON names, as encoding/json matches them
	fields []fieldDecoder // fields[i] is names[i]
}

type fieldDecoder struct {
	typ    reflect.Type
	offset uintptr // from the start of the struct, through embedded structs
	// set decodes val into the field at p as encoding/json decodes it into
	// typ, or reports false; nil where the fast decoder does not know typ
	// (every body holding the field then goes to encoding/json).
	set func(p unsafe.Pointer, val []byte) bool
	sub *objectDecoder // the pointed-to struct's, for a *struct field
}

// objectDecoderOf derives the decoder of the struct type t from the fields
// encoding/json decodes: exported, named by their json tag (or their Go
// name), promoted from embedded structs. It panics where encoding/json's
// rules go beyond what the fast decoder follows (two fields of one name,
// more than 64 fields): a bug every test of this package trips on.
func objectDecoderOf(t reflect.Type) *objectDecoder {
	d := &objectDecoder{}
	for _, f := range reflect.VisibleFields(t) {
		if f.Anonymous && isStruct(f.Type) || !f.IsExported() {
			continue // an embedded struct's fields are visited themselves
		}
		tag := f.Tag.Get("json")
		if tag == "-" {
			continue
		}
		name, opts, _ := strings.Cut(tag, ",")
		if name == "" {
			name = f.Name
		}
		if slices.Contains(d.names, name) {
			panic("httpapi: two fields named " + strconv.Quote(name) + " in " + t.String())
		}
		fd := fieldDecoder{typ: f.Type}
		offset, direct := fieldOffset(t, f.Index)
		fd.offset = offset
		// ",string" decodes a number from a string: left to encoding/json,
		// as is a field reached through an embedded pointer.
		if direct && !slices.Contains(strings.Split(opts, ","), "string") {
			fd.set, fd.sub = setterOf(f.Type)
		}
		d.names = append(d.names, name)
		d.fields = append(d.fields, fd)
	}
	if len(d.names) > 64 {
		panic("httpapi: " + t.String() + " has more fields than fastObject tracks")
	}
	return d
}

// isStruct reports whether t is a struct or a pointer to one: embedded, it
// promotes its fields.
func isStruct(t reflect.Type) bool {
	if t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return t.Kind() == reflect.Struct
}

// fieldOffset is the offset of the field at index in t; direct is false
// when the path goes through an embedded pointer.
func fieldOffset(t reflect.Type, index []int) (offset uintptr, direct bool) {
	for n, i := range index {
		if t.Kind() != reflect.Struct {
			return 0, false
		}
		f := t.Field(i)
		offset += f.Offset
		t = f.Type
		if n < len(index)-1 && t.Kind() == reflect.Pointer {
			return 0, false
		}
	}
	return offset, true
}

// setterOf returns the fast setter of a field of type t, nil for a type
// left to encoding/json, and for a pointer to a struct, that struct's
// decoder.
func setterOf(t reflect.Type) (func(p unsafe.Pointer, val []byte) bool, *objectDecoder) {
	switch t {
	case reflect.TypeFor[*string]():
		return func(p unsafe.Pointer, v []byte) bool { return fastString(v, (**string)(p)) }, nil
	case reflect.TypeFor[*bool]():
		return func(p unsafe.Pointer, v []byte) bool { return fastBool(v, (**bool)(p)) }, nil
	case reflect.TypeFor[*int64]():
		return func(p unsafe.Pointer, v []byte) bool { return fastNumber(v, (**int64)(p), parseInt) }, nil
	case reflect.TypeFor[*float64]():
		return func(p unsafe.Pointer, v []byte) bool { return fastNumber(v, (**float64)(p), parseFloat) }, nil
	case reflect.TypeFor[json.RawMessage]():
		return func(p unsafe.Pointer, v []byte) bool { return fastRaw(v, (*json.RawMessage)(p)) }, nil
	case reflect.TypeFor[[]json.RawMessage]():
		return func(p unsafe.Pointer, v []byte) bool { return fastRawArray(v, (*[]json.RawMessage)(p)) }, nil
	}
	if t.Kind() != reflect.Pointer || t.Elem().Kind() != reflect.Struct {
		return nil, nil
	}
	elem := t.Elem()
	sub := objectDecoderOf(elem)
	return func(p unsafe.Pointer, v []byte) bool {
		if isNullLiteral(v) {
			return true
		}
		obj := reflect.New(elem).UnsafePointer()
		*(*unsafe.Pointer)(p) = obj
		return sub.decode(obj, v, nil)
	}, sub
}

// decode decodes the JSON object obj into the struct at v, of the type d
// was derived from.
func (d *objectDecoder) decode(v unsafe.Pointer, obj []byte, unknown func(key, val []byte) bool) bool {
	return fastObject(obj, d.names, func(i int, val []byte) bool {
		f := &d.fields[i]
		return f.set != nil && f.set(unsafe.Add(v, f.offset), val)
	}, unknown)
}

// fastObject walks the JSON object obj, calling set for each of fields
// present (with its index) and unknown for every other key (nil: skipped,
// as encoding/json skips keys no field has). It reports false when obj is
// not an object, a field repeats, a key has another case than its field's
// (encoding/json would match it to the field), or a callback returns
// false.
func fastObject(obj []byte, fields []string, set func(i int, val []byte) bool, unknown func(key, val []byte) bool) bool {
	var seen uint64 // bit i: fields[i]
	return eachField(obj, func(key, val []byte) bool {
		i := slices.IndexFunc(fields, func(f string) bool { return f == string(key) })
		if i < 0 {
			if slices.ContainsFunc(fields, func(f string) bool { return bytes.EqualFold(key, []byte(f)) }) {
				return false
			}
			return unknown == nil || unknown(key, val)
		}
		if seen&(1<<i) != 0 {
			return false
		}
		seen |= 1 << i
		return set(i, val)
	})
}

// eachField calls f for each member of obj, a valid JSON value, with its
// key (unquoted) and value (without surrounding space). It reports false
// when obj is not an object, a key has escapes, or f returns false.
func eachField(obj []byte, f func(key, val []byte) bool) bool {
	i := skipSpace(obj, 0)
	if i >= len(obj) || obj[i] != '{' {
		return false
	}
	i++
	for {
		i = skipSpace(obj, i)
		if i >= len(obj) || obj[i] == '}' {
			return true
		}
		end := skipString(obj, i)
		key := obj[i+1 : end-1]
		if bytes.IndexByte(key, '\\') >= 0 {
			return false
		}
		i = skipSpace(obj, skipSpace(obj, end)+1) // past the ':'
		start := i
		i = skipValue(obj, i)
		if !f(key, obj[start:i]) {
			return false
		}
		i = skipSpace(obj, i)
		if i < len(obj) && obj[i] == ',' {
			i++
		}
	}
}

func isNullLiteral(val []byte) bool { return string(val) == "null" }

// The fast* setters decode one value as encoding/json decodes it into the
// field's type, reporting false for what they leave to encoding/json.

func fastString(val []byte, p **string) bool {
	if isNullLiteral(val) {
		return true
	}
	if val[0] != '"' {
		return false
	}
	inner := val[1 : len(val)-1]
	if bytes.IndexByte(inner, '\\') >= 0 || !utf8.Valid(inner) {
		return false
	}
	s := string(inner)
	*p = &s
	return true
}

func fastBool(val []byte, p **bool) bool {
	switch string(val) {
	case "null":
		return true
	case "true", "false":
		b := val[0] == 't'
		*p = &b
		return true
	}
	return false
}

// fastNumber decodes a number with parse, which is strconv's, as
// encoding/json parses a number for an integer or a float field.
func fastNumber[T int64 | float64](val []byte, p **T, parse func(string) (T, error)) bool {
	if isNullLiteral(val) {
		return true
	}
	if val[0] != '-' && (val[0] < '0' || val[0] > '9') {
		return false
	}
	x, err := parse(string(val))
	if err != nil {
		return false
	}
	*p = &x
	return true
}

func parseInt(s string) (int64, error)     { return strconv.ParseInt(s, 10, 64) }
func parseFloat(s string) (float64, error) { return strconv.ParseFloat(s, 64) }

// fastRaw keeps val itself (null included), as json.RawMessage does.
func fastRaw(val []byte, p *json.RawMessage) bool {
	*p = val
	return true
}

// fastRawArray splits an array into its elements, as []json.RawMessage
// does; null leaves it nil.
func fastRawArray(val []byte, p *[]json.RawMessage) bool {
	if isNullLiteral(val) {
		return true
	}
	if val[0] != '[' {
		return false
	}
	out := make([]json.RawMessage, 0, 4)
	for i := skipSpace(val, 1); i < len(val) && val[i] != ']'; {
		end := skipValue(val, i)
		out = append(out, val[i:end])
		i = skipSpace(val, end)
		if i < len(val) && val[i] == ',' {
			i = skipSpace(val, i+1)
		}
	}
	*p = out
	return true
}
