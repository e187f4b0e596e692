"""Tensors and parameters between numpy and the Open Inference Protocol.

Elements travel little-endian, row-major and unpadded; a BYTES element is a
4-byte little-endian length and then its bytes (pkg/oippb/grpc_service.proto).
"""

import struct

import numpy as np

from .engine import InvalidInput

# The numpy dtype of each OIP datatype. FP16 is numpy's float16; BF16 has no
# numpy type and is held as its raw bits in uint16 (bf16_to_float32 and
# float32_to_bf16 convert); BYTES is an object array of bytes.
DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BF16": np.dtype("<u2"),
    "BYTES": np.dtype(object),
}

# The InferTensorContents field of each datatype that has one.
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

_LEN = struct.Struct("<I")


def bf16_to_float32(bits):
    """The float32 values of bfloat16 numbers given as their uint16 bits."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"bf16_to_float32 takes uint16 bits, not {bits.dtype}")
    return (bits.astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16(values):
    """The uint16 bits of the bfloat16 numbers nearest values (ties to even;
    NaN stays NaN)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    bits = values.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def element_count(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def shape_text(shape):
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_shape(what, shape, declared):
    """Raises InvalidInput unless shape fits declared (-1: any size)."""
    if any(d < 0 for d in shape):
        raise InvalidInput(f"{what}: shape {shape_text(shape)} has a negative dimension")
    if declared is None:
        return
    if len(shape) != len(declared) or any(
        want >= 0 and got != want for got, want in zip(shape, declared)
    ):
        raise InvalidInput(
            f"{what}: shape {shape_text(shape)} does not fit the declared {shape_text(declared)}"
        )


def decode_bytes(what, raw, count):
    """The count BYTES elements in raw, as a list of bytes."""
    out = []
    at = 0
    view = memoryview(raw)
    for i in range(count):
        if at + 4 > len(raw):
            raise InvalidInput(
                f"{what}: BYTES contents end in element {i} of {count} (no 4-byte length at offset {at})"
            )
        (n,) = _LEN.unpack_from(raw, at)
        at += 4
        if at + n > len(raw):
            raise InvalidInput(
                f"{what}: BYTES element {i} says {n} bytes, {len(raw) - at} are left"
            )
        out.append(bytes(view[at:at + n]))
        at += n
    if at != len(raw):
        raise InvalidInput(
            f"{what}: {len(raw) - at} bytes left over after the {count} BYTES elements of its shape"
        )
    return out


def from_raw(what, datatype, shape, raw):
    """The numpy array of a tensor sent as raw contents."""
    dtype = DTYPES.get(datatype)
    if dtype is None:
        raise InvalidInput(f"{what}: unknown datatype {datatype!r}")
    count = element_count(shape)
    if datatype == "BYTES":
        arr = np.empty(count, dtype=object)
        arr[:] = decode_bytes(what, raw, count)
        return arr.reshape(shape)
    want = count * dtype.itemsize
    if len(raw) != want:
        raise InvalidInput(
            f"{what}: raw contents hold {len(raw)} bytes; shape {shape_text(shape)} of "
            f"{datatype} needs {want}"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def from_contents(what, datatype, shape, contents):
    """The numpy array of a tensor sent in InferTensorContents."""
    dtype = DTYPES.get(datatype)
    if dtype is None:
        raise InvalidInput(f"{what}: unknown datatype {datatype!r}")
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        raise InvalidInput(f"{what}: {datatype} has no typed contents; send it as raw_input_contents")
    values = list(getattr(contents, field))
    count = element_count(shape)
    if len(values) != count:
        raise InvalidInput(
            f"{what}: {field} holds {len(values)} elements; shape {shape_text(shape)} needs {count}"
        )
    if datatype == "BYTES":
        arr = np.empty(count, dtype=object)
        arr[:] = [bytes(v) for v in values]
        return arr.reshape(shape)
    arr = np.array(values, dtype=np.int64 if dtype.kind in "iu" else None)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if count and (arr.min() < info.min or arr.max() > info.max):
            raise InvalidInput(f"{what}: {field} holds a value outside {datatype}")
    return arr.astype(dtype).reshape(shape)


def _as_bytes_array(what, value):
    if isinstance(value, (str, bytes)):
        value = [value]
    arr = np.asarray(value, dtype=object)
    out = np.empty(arr.shape, dtype=object)
    flat_in, flat_out = arr.reshape(-1), out.reshape(-1)
    for i, v in enumerate(flat_in):
        if isinstance(v, str):
            v = v.encode("utf-8")
        elif isinstance(v, (bytes, bytearray, np.bytes_)):
            v = bytes(v)
        else:
            raise TypeError(f"{what}: a BYTES element must be bytes or str, not {type(v).__name__}")
        flat_out[i] = v
    return out


def to_array(what, datatype, value):
    """value as the numpy array of a tensor of datatype: BYTES from bytes,
    str or arrays of them; BF16 from uint16 bits or from floats (rounded);
    integers to an integer type when every value fits, any number to a float
    type, never a float to an integer type."""
    if datatype == "BYTES":
        return _as_bytes_array(what, value)
    dtype = DTYPES.get(datatype)
    if dtype is None:
        raise TypeError(f"{what}: unknown datatype {datatype!r}")
    arr = np.asarray(value)
    if datatype == "BF16" and arr.dtype.kind == "f":
        return float32_to_bf16(arr)
    if arr.dtype == dtype:
        return arr
    src, dst = arr.dtype.kind, dtype.kind
    if dst == "b" and src != "b":
        raise TypeError(f"{what}: a {arr.dtype} array cannot be {datatype}")
    if src in "biu" and dst in "iu":
        info = np.iinfo(dtype)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise ValueError(f"{what}: a value outside {datatype} ({arr.min()}..{arr.max()})")
        return arr.astype(dtype)
    if src in "biuf" and dst == "f":
        return arr.astype(dtype)
    raise TypeError(f"{what}: a {arr.dtype} array cannot be {datatype}")


def to_raw(datatype, arr):
    """The raw contents of a tensor's array."""
    if datatype == "BYTES":
        return b"".join(_LEN.pack(len(v)) + v for v in arr.reshape(-1))
    return np.ascontiguousarray(arr, dtype=DTYPES[datatype]).tobytes()


def param_value(p):
    """The Python value of an InferParameter."""
    kind = p.WhichOneof("parameter_choice")
    if kind is None:
        return None
    return getattr(p, kind)


def set_param(p, key, value):
    """Sets InferParameter p to value: bool, int, float or str."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        if -(1 << 63) <= value < (1 << 63):
            p.int64_param = value
        elif 0 <= value < (1 << 64):
            p.uint64_param = value
        else:
            raise ValueError(f"parameter {key!r}: {value} does not fit 64 bits")
    elif isinstance(value, float):
        p.double_param = value
    elif isinstance(value, str):
        p.string_param = value
    else:
        raise TypeError(f"parameter {key!r}: a {type(value).__name__} is not bool, int, float or str")


def params_dict(params):
    return {k: param_value(v) for k, v in params.items()}
