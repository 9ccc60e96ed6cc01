"""Compact serialisation of dataset samples into a flat byte range, and back.

A sample becomes a *skeleton* (its containers, numbers, strings and any other small objects, pickled) plus the raw
bytes of every dense tensor and array in it, laid out after the skeleton at 64-byte aligned offsets. Tensors and
arrays are never pickled, so encoding is a single memory copy of their bytes and decoding is one copy back into a
fresh tensor or array: what a caller gets never aliases the buffer it was decoded from.

Layout of one encoded sample::

    u32 magic | u32 skeleton length | skeleton (pickle) | padding to 64 | raw 0 | padding | raw 1 | ...

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = ["Encoded", "decode", "encode"]

_MAGIC = 0x49584331  # "IXC1": catches a range that was never written by this codec
_PREFIX = struct.Struct("<II")
#: Raw buffers start at multiples of this, so decoding copies from aligned addresses.
ALIGN = 64


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class _TensorRef(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    requires_grad: bool


class _ArrayRef(NamedTuple):
    dtype: str | np.dtype[Any]  # a builtin dtype by its short name: half the skeleton of a pickled dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class _Tuple(NamedTuple):
    # A tuple subclass (a named tuple): rebuilt through its own type, so the caller gets the same type back.
    cls: type
    items: list[Any]


@dataclass(frozen=True)
class Encoded:
    """A sample ready to be written: the skeleton prefix followed by the raw buffers at their offsets.

    Examples:
        >>> import torch
        >>> from ignite_ext.data._codec import decode, encode
        >>> enc = encode({"x": torch.arange(4), "y": 1})
        >>> buf = bytearray(enc.nbytes)
        >>> enc.write_into(memoryview(buf))
        >>> decode(memoryview(buf))["x"].tolist()
        [0, 1, 2, 3]

    .. versionadded:: 0.1.0
    """

    head: bytes
    raws: tuple[tuple[int, memoryview], ...]
    nbytes: int

    def write_into(self, out: memoryview) -> None:
        """Copy the encoded sample into ``out``, which must hold at least :attr:`nbytes` bytes."""
        out[: len(self.head)] = self.head
        for offset, raw in self.raws:
            out[offset : offset + raw.nbytes] = raw


class _Encoder:
    def __init__(self) -> None:
        self.raws: list[memoryview] = []
        self.size = 0  # bytes of the raw region so far, relative to its start

    def _add(self, raw: memoryview) -> int:
        offset = _aligned(self.size)
        self.raws.append(raw)
        self.size = offset + raw.nbytes
        return offset

    def walk(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is torch.Tensor and obj.layout is torch.strided and not obj.is_quantized:
            flat = obj.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
            raw = memoryview(flat.numpy()).cast("B")
            return _TensorRef(obj.dtype, tuple(obj.shape), self._add(raw), raw.nbytes, obj.requires_grad)
        if kind is np.ndarray and not obj.dtype.hasobject:
            arr = obj if obj.flags.c_contiguous else obj.copy(order="C")
            raw = memoryview(arr.reshape(-1).view(np.uint8))
            dtype = obj.dtype.str if obj.dtype.isbuiltin == 1 else obj.dtype
            return _ArrayRef(dtype, obj.shape, self._add(raw), raw.nbytes)
        if kind is list:
            return [self.walk(x) for x in obj]
        if kind is tuple:
            return tuple(self.walk(x) for x in obj)
        if kind is dict:
            return {k: self.walk(v) for k, v in obj.items()}
        if isinstance(obj, tuple) and hasattr(kind, "_fields"):
            return _Tuple(kind, [self.walk(x) for x in obj])
        return obj  # numbers, strings, bytes, None and anything else: pickled as part of the skeleton


def encode(sample: Any) -> Encoded:
    """Split ``sample`` into a pickled skeleton and the raw bytes of its dense tensors and arrays.

    The raw buffers are views of the sample's own memory (no copy yet): write the result before the sample
    is modified.

    Args:
        sample: a tensor, array, number, string, bytes, or a list/tuple/dict/named tuple of these; other
            objects are pickled.

    Returns:
        The encoded sample; :attr:`Encoded.nbytes` is the size of the range it needs.

    Examples:
        >>> import numpy as np
        >>> from ignite_ext.data._codec import encode
        >>> encode(np.zeros(1000, dtype=np.float32)).nbytes  # 4000 bytes of data after a 128-byte header
        4128

    .. versionadded:: 0.1.0
    """
    enc = _Encoder()
    skeleton = pickle.dumps(enc.walk(sample), protocol=pickle.HIGHEST_PROTOCOL)
    head = _PREFIX.pack(_MAGIC, len(skeleton)) + skeleton
    base = _aligned(len(head))
    raws: list[tuple[int, memoryview]] = []
    offset = 0
    for raw in enc.raws:
        offset = _aligned(offset)
        raws.append((base + offset, raw))
        offset += raw.nbytes
    return Encoded(head, tuple(raws), base + enc.size if enc.raws else len(head))


class _Decoder:
    def __init__(self, buf: memoryview, base: int) -> None:
        self.buf = buf
        self.base = base

    def _bytes(self, offset: int, nbytes: int) -> memoryview:
        start = self.base + offset
        return self.buf[start : start + nbytes]

    def walk(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is _TensorRef:
            if obj.nbytes == 0:
                out = torch.empty(obj.shape, dtype=obj.dtype)
            else:
                # frombuffer aliases the buffer; clone() is the one copy that detaches the result from it.
                raw = torch.frombuffer(self._bytes(obj.offset, obj.nbytes), dtype=torch.uint8).clone()
                out = raw.view(obj.dtype).reshape(obj.shape)
            return out.requires_grad_() if obj.requires_grad else out
        if kind is _ArrayRef:
            flat = np.frombuffer(self._bytes(obj.offset, obj.nbytes), dtype=np.uint8).copy()
            return flat.view(obj.dtype).reshape(obj.shape)
        if kind is list:
            return [self.walk(x) for x in obj]
        if kind is tuple:
            return tuple(self.walk(x) for x in obj)
        if kind is dict:
            return {k: self.walk(v) for k, v in obj.items()}
        if kind is _Tuple:
            return obj.cls(*(self.walk(x) for x in obj.items))
        return obj


def decode(buf: memoryview) -> Any:
    """Rebuild a sample from a range written by :meth:`Encoded.write_into`; the result owns its memory.

    Args:
        buf: the encoded range (at least as long as the sample's ``nbytes``).

    Returns:
        A sample equal to the encoded one, with the same container types, dtypes and shapes.

    Raises:
        ValueError: ``buf`` does not start with an encoded sample.

    Examples:
        >>> from ignite_ext.data._codec import decode, encode
        >>> enc = encode(("label", 3, b"raw"))
        >>> buf = bytearray(enc.nbytes)
        >>> enc.write_into(memoryview(buf))
        >>> decode(memoryview(buf))
        ('label', 3, b'raw')

    .. versionadded:: 0.1.0
    """
    magic, length = _PREFIX.unpack_from(buf, 0)
    if magic != _MAGIC:
        raise ValueError("not an encoded sample")
    head_end = _PREFIX.size + length
    skeleton = pickle.loads(buf[_PREFIX.size : head_end])
    return _Decoder(buf, _aligned(head_end)).walk(skeleton)
