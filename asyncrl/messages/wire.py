"""How messages travel: msgpack, with numpy arrays as extension values holding raw little-endian
bytes (never Python lists of numbers), and a reusable codec per message type. The messages
themselves: `asyncrl.messages.structs`."""

from __future__ import annotations

import math
import struct
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np

# --- numpy arrays as msgpack extension values -------------------------------------------------

# One extension code per dtype; the payload is `ndim:uint8, shape:uint32*ndim, raw bytes`.
_EXT_CODE_BY_DTYPE = {
    np.dtype("<i4"): 1,
    np.dtype("<f4"): 2,
    np.dtype("<i8"): 3,
    np.dtype("<f8"): 4,
    np.dtype("u1"): 5,
    np.dtype("<i2"): 6,  # expert ids of models with more than 254 experts (`asyncrl.messages.routes`)
}
_DTYPE_BY_EXT_CODE = {code: dtype for dtype, code in _EXT_CODE_BY_DTYPE.items()}


def _encode_array(array: np.ndarray) -> msgspec.msgpack.Ext:
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    code = _EXT_CODE_BY_DTYPE.get(np.dtype(dtype))
    if code is None:
        raise TypeError(f"arrays of dtype {array.dtype} are not supported on the wire")
    header = struct.pack(f"<B{array.ndim}I", array.ndim, *array.shape)
    return msgspec.msgpack.Ext(code, header + np.ascontiguousarray(array, dtype=dtype).tobytes())


def _decode_array(code: int, data: memoryview) -> np.ndarray:
    dtype = _DTYPE_BY_EXT_CODE.get(code)
    if dtype is None:
        raise ValueError(f"unknown msgpack extension code {code}")
    if len(data) < 1:
        raise ValueError("empty array payload")
    ndim = data[0]
    header_len = 1 + 4 * ndim
    if len(data) < header_len:
        raise ValueError("truncated array header")
    shape = _SHAPE_STRUCTS[ndim].unpack_from(data, 1) if ndim < len(_SHAPE_STRUCTS) else struct.unpack_from(f"<{ndim}I", data, 1)
    expected = math.prod(shape) * dtype.itemsize
    if len(data) - header_len != expected:
        raise ValueError(f"array payload has {len(data) - header_len} bytes, shape {shape} needs {expected}")
    # Copy: the decoded message must not alias (and keep alive) the whole input buffer.
    array = np.frombuffer(data[header_len:], dtype=dtype).copy()
    return array if ndim == 1 else array.reshape(shape)


_SHAPE_STRUCTS = [struct.Struct(f"<{n}I") for n in range(5)]


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return _encode_array(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(expected_type: type, obj: Any) -> Any:
    if expected_type is np.ndarray:
        if isinstance(obj, np.ndarray):
            return obj
        raise TypeError(f"expected a numeric array, got {type(obj).__name__}")
    raise NotImplementedError(f"cannot decode {expected_type}")


def check_array(name: str, value: Any, dtype: str, length: int | None = None) -> None:
    if not isinstance(value, np.ndarray):
        raise TypeError(f"field `{name}`: expected a numpy array, got {type(value).__name__}")
    if value.dtype != np.dtype(dtype):
        raise TypeError(f"field `{name}`: expected dtype {np.dtype(dtype)}, got {value.dtype}")
    if value.ndim != 1:
        raise ValueError(f"field `{name}`: expected a 1-D array, got shape {value.shape}")
    if length is not None and value.shape[0] != length:
        raise ValueError(f"field `{name}`: expected {length} elements, got {value.shape[0]}")


def int32_array(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.int32).reshape(-1)


def float32_array(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).reshape(-1)


# --- codecs -----------------------------------------------------------------------------------

M = TypeVar("M")


class Codec(Generic[M]):
    """Reusable msgpack encoder/decoder for one message type."""

    def __init__(self, message_type: type[M]):
        self.message_type = message_type
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._decoder = msgspec.msgpack.Decoder(message_type, dec_hook=_dec_hook, ext_hook=_decode_array)

    def encode(self, message: M) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes | memoryview) -> M:
        """Decode; raises `msgspec.ValidationError` or `msgspec.DecodeError` naming what is wrong."""
        try:
            return self._decoder.decode(data)
        except msgspec.ValidationError:
            raise
        except (ValueError, TypeError) as exc:  # raised by the array ext hook
            raise msgspec.DecodeError(f"malformed {self.message_type.__name__}: {exc}") from exc


def encode(message: Any) -> bytes:
    return _GENERIC_ENCODER.encode(message)


_GENERIC_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
