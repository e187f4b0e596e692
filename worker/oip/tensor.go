package oip

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/troupe-serving/troupe/pkg/oippb"
	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// OIP datatypes troupe uses beside the tensor types of tensorTypes.
const (
	typeBytes = "BYTES"
	typeInt16 = "INT16"
	typeInt32 = "INT32"
)

// tensorType is one element type a named tensor may have: its stagepb
// DType, its OIP datatype and the size of one element.
type tensorType struct {
	dtype stagepb.DType
	oip   string
	size  int
}

// tensorTypes are the element types of named tensors (docs/contracts.md,
// "Tensors between stages").
var tensorTypes = [...]tensorType{
	{stagepb.DType_DTYPE_FLOAT32, "FP32", 4},
	{stagepb.DType_DTYPE_FLOAT16, "FP16", 2},
	{stagepb.DType_DTYPE_BFLOAT16, "BF16", 2},
	{stagepb.DType_DTYPE_INT32, "INT32", 4},
	{stagepb.DType_DTYPE_INT64, "INT64", 8},
	{stagepb.DType_DTYPE_UINT8, "UINT8", 1},
}

// typeOfDType is the tensor type of a stagepb DType; ok is false for one
// troupe does not carry.
func typeOfDType(d stagepb.DType) (tensorType, bool) {
	for _, t := range tensorTypes {
		if t.dtype == d {
			return t, true
		}
	}
	return tensorType{}, false
}

// typeOfOIP is the tensor type of an OIP datatype; ok is false for one
// troupe does not carry as a named tensor.
func typeOfOIP(datatype string) (tensorType, bool) {
	for _, t := range tensorTypes {
		if t.oip == datatype {
			return t, true
		}
	}
	return tensorType{}, false
}

// isFloat reports whether an OIP datatype is one of the float tensor types.
func isFloat(datatype string) bool {
	return datatype == "FP32" || datatype == "FP16" || datatype == "BF16"
}

// maxElements bounds the element count a shape may declare, far above any
// message gRPC carries, so that products never overflow.
const maxElements = 1 << 40

// elements is the number of elements of a shape: the product of its
// dimensions (1 for a scalar). A negative dimension or a product past
// maxElements is an error.
func elements(shape []int64) (int64, error) {
	n := int64(1)
	for _, d := range shape {
		if d < 0 {
			return 0, fmt.Errorf("shape %v has a negative dimension", shape)
		}
		if d != 0 && n > maxElements/d {
			return 0, fmt.Errorf("shape %v has more than %d elements", shape, int64(maxElements))
		}
		n *= d
	}
	return n, nil
}

// checkData checks that data holds exactly the elements of shape, each
// size bytes.
func checkData(data []byte, shape []int64, size int, datatype string) error {
	n, err := elements(shape)
	if err != nil {
		return err
	}
	if want := n * int64(size); int64(len(data)) != want {
		return fmt.Errorf("%d bytes of data, want %d (shape %v of %s, %d bytes each)", len(data), want, shape, datatype, size)
	}
	return nil
}

// encodeBytes is the raw contents of a BYTES tensor: each element a 4-byte
// little-endian length, then its bytes.
func encodeBytes(elems ...[]byte) []byte {
	n := 0
	for _, e := range elems {
		n += 4 + len(e)
	}
	out := make([]byte, 0, n)
	for _, e := range elems {
		out = binary.LittleEndian.AppendUint32(out, uint32(len(e)))
		out = append(out, e...)
	}
	return out
}

// errMalformedBytes is wrapped by every error of decodeBytes.
var errMalformedBytes = errors.New("malformed BYTES contents")

// decodeBytes splits the raw contents of a BYTES tensor into its elements
// (which share raw's memory). want is the element count the tensor's shape
// declares; a different count is an error, as is a length prefix that is
// cut short or runs past the end. It never panics, whatever raw holds.
func decodeBytes(raw []byte, want int64) ([][]byte, error) {
	var elems [][]byte
	for off := 0; off < len(raw); {
		if len(raw)-off < 4 {
			return nil, fmt.Errorf("%w: element %d: a length prefix needs 4 bytes, %d left at offset %d", errMalformedBytes, len(elems), len(raw)-off, off)
		}
		n := binary.LittleEndian.Uint32(raw[off:])
		off += 4
		if uint64(n) > uint64(len(raw)-off) {
			return nil, fmt.Errorf("%w: element %d: length prefix %d at offset %d, but %d bytes follow", errMalformedBytes, len(elems), n, off-4, len(raw)-off)
		}
		elems = append(elems, raw[off:off+int(n)])
		off += int(n)
		if int64(len(elems)) > want {
			break
		}
	}
	if int64(len(elems)) != want {
		return nil, fmt.Errorf("%w: %d elements, the shape says %d", errMalformedBytes, len(elems), want)
	}
	return elems, nil
}

// tensorContents is one OIP tensor as troupe reads it: BYTES elements, or
// the little-endian bytes of any other datatype, checked against its
// shape.
type tensorContents struct {
	elems [][]byte // BYTES
	data  []byte   // every other datatype
}

// readTensor reads a tensor from its raw contents (hasRaw) or its typed
// contents, and checks it against its shape. FP16 and BF16 have only the
// raw form.
func readTensor(datatype string, shape []int64, raw []byte, hasRaw bool, c *oippb.InferTensorContents) (tensorContents, error) {
	n, err := elements(shape)
	if err != nil {
		return tensorContents{}, err
	}
	if datatype == typeBytes {
		if hasRaw {
			elems, err := decodeBytes(raw, n)
			return tensorContents{elems: elems}, err
		}
		elems := c.GetBytesContents()
		if int64(len(elems)) != n {
			return tensorContents{}, fmt.Errorf("%d BYTES elements, the shape %v says %d", len(elems), shape, n)
		}
		return tensorContents{elems: elems}, nil
	}
	size := elementSize(datatype)
	if size == 0 {
		return tensorContents{}, fmt.Errorf("datatype %s is not one troupe reads", datatype)
	}
	if !hasRaw {
		if raw, err = typedToRaw(datatype, c); err != nil {
			return tensorContents{}, err
		}
	}
	if err := checkData(raw, shape, size, datatype); err != nil {
		return tensorContents{}, err
	}
	return tensorContents{data: raw}, nil
}

// elementSize is the element size of the datatypes troupe reads besides
// BYTES; 0 for others.
func elementSize(datatype string) int {
	if datatype == typeInt16 {
		return 2
	}
	if t, ok := typeOfOIP(datatype); ok {
		return t.size
	}
	return 0
}

// typedToRaw turns typed contents into little-endian bytes.
func typedToRaw(datatype string, c *oippb.InferTensorContents) ([]byte, error) {
	var out []byte
	switch datatype {
	case typeInt16:
		for _, v := range c.GetIntContents() {
			if v < math.MinInt16 || v > math.MaxInt16 {
				return nil, fmt.Errorf("INT16 element %d out of range", v)
			}
			out = binary.LittleEndian.AppendUint16(out, uint16(int16(v)))
		}
	case "INT32":
		for _, v := range c.GetIntContents() {
			out = binary.LittleEndian.AppendUint32(out, uint32(v))
		}
	case "INT64":
		for _, v := range c.GetInt64Contents() {
			out = binary.LittleEndian.AppendUint64(out, uint64(v))
		}
	case "UINT8":
		for _, v := range c.GetUintContents() {
			if v > math.MaxUint8 {
				return nil, fmt.Errorf("UINT8 element %d out of range", v)
			}
			out = append(out, byte(v))
		}
	case "FP32":
		for _, v := range c.GetFp32Contents() {
			out = binary.LittleEndian.AppendUint32(out, math.Float32bits(v))
		}
	default: // FP16, BF16
		return nil, fmt.Errorf("%s travels only as raw contents", datatype)
	}
	return out, nil
}

// int32s reads little-endian INT32 elements as uint32 ids; a negative one
// is an error.
func int32s(data []byte) ([]uint32, error) {
	out := make([]uint32, len(data)/4)
	for i := range out {
		v := int32(binary.LittleEndian.Uint32(data[4*i:]))
		if v < 0 {
			return nil, fmt.Errorf("element %d is negative (%d)", i, v)
		}
		out[i] = uint32(v)
	}
	return out, nil
}

// rawInt32s is the raw contents of an INT32 tensor of ids; an id past
// math.MaxInt32 is an error.
func rawInt32s(ids []uint32) ([]byte, error) {
	out := make([]byte, 0, 4*len(ids))
	for i, v := range ids {
		if v > math.MaxInt32 {
			return nil, fmt.Errorf("element %d (%d) does not fit INT32", i, v)
		}
		out = binary.LittleEndian.AppendUint32(out, v)
	}
	return out, nil
}
