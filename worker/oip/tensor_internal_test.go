package oip

import (
	"bytes"
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/troupe-serving/troupe/pkg/oippb"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// TestDecodeBytes: the raw form of BYTES tensors, well formed and not: a
// malformed length prefix is an error that says where, never a panic.
func TestDecodeBytes(t *testing.T) {
	for _, tc := range []struct {
		name string
		raw  []byte
		want int64
		out  []string
		err  string
	}{
		{"one", []byte{2, 0, 0, 0, 'h', 'i'}, 1, []string{"hi"}, ""},
		{"two, one empty", []byte{0, 0, 0, 0, 1, 0, 0, 0, 'x'}, 2, []string{"", "x"}, ""},
		{"none", nil, 0, nil, ""},
		{"short prefix", []byte{2, 0, 0}, 1, nil, "element 0: a length prefix needs 4 bytes, 3 left at offset 0"},
		{"prefix past the end", []byte{5, 0, 0, 0, 'a', 'b'}, 1, nil, "element 0: length prefix 5 at offset 0, but 2 bytes follow"},
		{"huge prefix", []byte{0xff, 0xff, 0xff, 0xff, 'a'}, 1, nil, "length prefix 4294967295 at offset 0, but 1 bytes follow"},
		{"second cut", []byte{1, 0, 0, 0, 'a', 9}, 2, nil, "element 1: a length prefix needs 4 bytes, 1 left at offset 5"},
		{"fewer than the shape", []byte{1, 0, 0, 0, 'a'}, 2, nil, "1 elements, the shape says 2"},
		{"more than the shape", []byte{1, 0, 0, 0, 'a', 1, 0, 0, 0, 'b'}, 1, nil, "2 elements, the shape says 1"},
		{"bytes for an empty shape", []byte{0, 0, 0, 0}, 0, nil, "1 elements, the shape says 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := decodeBytes(tc.raw, tc.want)
			if tc.err != "" {
				require.ErrorIs(t, err, errMalformedBytes)
				assert.ErrorContains(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			var s []string
			for _, e := range got {
				s = append(s, string(e))
			}
			assert.Equal(t, tc.out, s)
			assert.True(t, bytes.Equal(tc.raw, encodeBytes(got...)), "encoding gives the same bytes back")
		})
	}
}

// FuzzDecodeBytes: whatever the bytes, decoding returns elements that
// encode back to exactly those bytes, or an error of malformed contents;
// it never panics.
func FuzzDecodeBytes(f *testing.F) {
	f.Add([]byte{2, 0, 0, 0, 'h', 'i'}, int64(1))
	f.Add([]byte{0xff, 0xff, 0xff, 0x7f}, int64(1))
	f.Add([]byte{1, 0, 0}, int64(3))
	f.Add([]byte{}, int64(0))
	f.Fuzz(func(t *testing.T, raw []byte, want int64) {
		got, err := decodeBytes(raw, want)
		if err != nil {
			if !errors.Is(err, errMalformedBytes) {
				t.Fatalf("error %v is not errMalformedBytes", err)
			}
			return
		}
		if int64(len(got)) != want {
			t.Fatalf("%d elements, want %d", len(got), want)
		}
		if !bytes.Equal(encodeBytes(got...), raw) {
			t.Fatalf("elements %q do not encode back to %x", got, raw)
		}
	})
}

// TestRoles: the model's outputs give the role, its inputs the input role
// (docs/contracts.md, "Engine protocol").
func TestRoles(t *testing.T) {
	tm := func(name, dt string) *oippb.ModelMetadataResponse_TensorMetadata {
		return &oippb.ModelMetadataResponse_TensorMetadata{Name: name, Datatype: dt, Shape: []int64{-1}}
	}
	type io = []*oippb.ModelMetadataResponse_TensorMetadata
	for _, tc := range []struct {
		name                string
		in, out             io
		role, inputRole     string
		inTensors, outNames []string
		continues           bool
	}{
		{"thinker", io{tm("text", "BYTES"), tm("messages", "BYTES")}, io{tm("text", "BYTES"), tm("token_ids", "INT32")}, "text", "text", nil, nil, false},
		{"talker", io{tm("text", "BYTES"), tm("context", "BYTES")}, io{tm("codes", "INT32"), tm("hidden", "BF16")}, "codes", "text", nil, []string{"hidden"}, true},
		{"vocoder", io{tm("codes", "INT32")}, io{tm("audio", "INT16")}, "audio", "codes", nil, nil, true},
		{"tensors in", io{tm("hidden", "FP32"), tm("speaker", "INT64")}, io{tm("audio", "INT16"), tm("codes", "INT32")}, "audio", "tensors", []string{"hidden", "speaker"}, nil, true},
		{"ints only are not tensors", io{tm("ids", "INT64")}, io{tm("text", "BYTES")}, "text", "text", nil, nil, false},
		{"asr", io{tm("audio", "INT16")}, io{tm("text", "BYTES")}, "text", "audio", nil, nil, false},
		{"other types dropped", io{tm("text", "BYTES"), tm("flag", "BOOL")}, io{tm("text", "BYTES"), tm("score", "FP64")}, "text", "text", nil, nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, err := modelOf(&oippb.ModelMetadataResponse{Name: "m", Inputs: tc.in, Outputs: tc.out})
			require.NoError(t, err)
			assert.Equal(t, tc.role, m.role)
			assert.Equal(t, tc.inputRole, m.inputRole)
			assert.Equal(t, tc.inTensors, m.inputTensors)
			assert.Equal(t, tc.outNames, m.outputTensors)
			assert.Equal(t, tc.continues, m.continues())
		})
	}
	_, err := modelOf(&oippb.ModelMetadataResponse{Outputs: []*oippb.ModelMetadataResponse_TensorMetadata{tm("audio", "FP32")}})
	assert.EqualError(t, err, `output "audio" is FP32; troupe reads it as INT16`)
}

// TestTensorTypes: the six types map both ways with their sizes.
func TestTensorTypes(t *testing.T) {
	for d, want := range map[stagepb.DType]struct {
		name string
		size int
	}{
		stagepb.DType_DTYPE_FLOAT32: {"FP32", 4}, stagepb.DType_DTYPE_FLOAT16: {"FP16", 2}, stagepb.DType_DTYPE_BFLOAT16: {"BF16", 2},
		stagepb.DType_DTYPE_INT32: {"INT32", 4}, stagepb.DType_DTYPE_INT64: {"INT64", 8}, stagepb.DType_DTYPE_UINT8: {"UINT8", 1},
	} {
		tt, ok := typeOfDType(d)
		require.True(t, ok, d)
		assert.Equal(t, want.name, tt.oip)
		assert.Equal(t, want.size, tt.size)
		back, ok := typeOfOIP(want.name)
		require.True(t, ok)
		assert.Equal(t, d, back.dtype)
	}
	_, ok := typeOfDType(stagepb.DType_DTYPE_UNSPECIFIED)
	assert.False(t, ok)
	_, ok = typeOfOIP("BYTES")
	assert.False(t, ok)
}
