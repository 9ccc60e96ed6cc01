"""Compact serialisation of dataset samples into a flat byte range, and back.

A sample becomes a *skeleton* (a pickled tree of tagged tuples of builtin types: unpickling it imports no class)
plus the raw bytes of every dense tensor and array in it, never pickled, so encoding is one copy of their bytes::

    u32 magic | u32 skeleton length | u32 start of raw 0 | skeleton (pickle) | padding | raw 0 | padding | raw 1 | ...

Raw buffers start at multiples of 64 bytes; those of :data:`LENDABLE` bytes or more also whole pages apart, and
:attr:`Encoded.page_offset` says where in a page the range must start for them to begin on pages (no two share a
page, across samples too). Decoding copies the buffers into fresh tensors and arrays, or takes the private
copy-on-write view a ``borrow`` callback offers for a lendable one (:mod:`ignite_ext.data.cache._cow`): what a
caller gets never aliases the buffer it was decoded from.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ignite_ext.data.cache._cow import PAGE

__all__ = ["LENDABLE", "Encoded", "decode", "encode"]

_MAGIC = 0x49584332  # "IXC2": catches a range that was never written by this codec
_PREFIX = struct.Struct("<III")
#: Raw buffers start at multiples of this, so decoding copies from aligned addresses.
ALIGN = 64
#: Raw buffers of at least this many bytes start on a page, so they can be lent copy-on-write instead of copied.
#: Smaller ones are copied: padding to a page costs up to 6 % at 64 KiB, and copying 64 KiB in a worker (then
#: collating the copy, still in the CPU's cache) costs less than lending it; at 128 KiB they cost the same.
LENDABLE = 128 << 10

#: Where a decoded buffer may come from instead of a copy: ``(offset, nbytes)`` in the encoded range to a writable
#: view that nobody else sees (or ``None`` to copy).
Borrow = Callable[[int, int], "memoryview | None"]


def _aligned(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


# Skeleton node tags. Every node is a tuple whose first item is one of these, so no user value can pass for a node.
_TENSOR, _ARRAY, _LIST, _TUPLE, _DICT, _NAMED, _VALUE = range(7)
_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


@dataclass(frozen=True)
class Encoded:
    """A sample ready to be written: the skeleton prefix followed by the raw buffers at their offsets.

    ``head``: magic, skeleton length and skeleton; ``raws``: each raw buffer with its offset; ``nbytes``: the
    range's length; ``page_offset``: with :data:`LENDABLE` buffers, write the range at an offset ``o`` of a
    page-aligned mapping such that ``(o + page_offset) % PAGE == 0``; else ``None``.

    Examples:
        >>> import torch
        >>> from ignite_ext.data.cache.codec import decode, encode
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
    page_offset: int | None = None

    def write_into(self, out: memoryview) -> None:
        """Copy the encoded sample into ``out``, which must hold at least :attr:`nbytes` bytes."""
        out[: len(self.head)] = self.head
        for offset, raw in self.raws:
            out[offset : offset + raw.nbytes] = raw


class _Encoder:
    def __init__(self) -> None:
        self.raws: list[tuple[int, memoryview]] = []  # offsets relative to the start of the raw region
        self.size = 0  # bytes of the raw region so far
        self.anchor: int | None = None  # offset of the first lendable buffer: the others are pages away from it

    def _add(self, raw: memoryview) -> int:
        offset = _aligned(self.size)
        if raw.nbytes >= LENDABLE:
            if self.anchor is None:
                self.anchor = offset
            else:
                offset += (self.anchor - offset) % PAGE
        self.raws.append((offset, raw))
        self.size = offset + raw.nbytes
        return offset

    def walk(self, obj: Any) -> tuple[Any, ...]:
        kind = type(obj)
        if kind is torch.Tensor and obj.layout is torch.strided and not obj.is_quantized:
            flat = obj.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
            raw = memoryview(flat.numpy()).cast("B")
            dtype = str(obj.dtype).removeprefix("torch.")
            return (_TENSOR, dtype, tuple(obj.shape), self._add(raw), raw.nbytes, obj.requires_grad)
        if kind is np.ndarray and not obj.dtype.hasobject:
            arr = obj if obj.flags.c_contiguous else obj.copy(order="C")
            raw = memoryview(arr.reshape(-1).view(np.uint8))
            # A builtin dtype by its short name: a pickled dtype object would be most of the skeleton.
            dtype = obj.dtype.str if obj.dtype.isbuiltin == 1 else obj.dtype
            return (_ARRAY, dtype, obj.shape, self._add(raw), raw.nbytes)
        if kind is list:
            return (_LIST, [self.walk(x) for x in obj])
        if kind is tuple:
            return (_TUPLE, [self.walk(x) for x in obj])
        if kind is dict:
            return (_DICT, list(obj), [self.walk(v) for v in obj.values()])
        if isinstance(obj, tuple) and hasattr(kind, "_fields"):
            # A named tuple: rebuilt through its own type, so the caller gets the same type back.
            return (_NAMED, kind, [self.walk(x) for x in obj])
        return (_VALUE, obj)  # numbers, strings, bytes, None and anything else: pickled in the skeleton


def encode(sample: Any) -> Encoded:
    """Split ``sample`` into a pickled skeleton and the raw bytes of its dense tensors and arrays.

    Other objects than tensors, arrays and their containers are pickled. The raw buffers are views of the sample's
    own memory: write the result before the sample is modified.

    Examples:
        >>> import numpy as np
        >>> from ignite_ext.data.cache.codec import encode
        >>> encode(np.zeros(1000, dtype=np.float32)).nbytes  # 4000 bytes of data after a 64-byte header
        4064

    .. versionadded:: 0.1.0
    """
    enc = _Encoder()
    skeleton = pickle.dumps(enc.walk(sample), protocol=pickle.HIGHEST_PROTOCOL)
    end = _PREFIX.size + len(skeleton)
    if not enc.raws:
        return Encoded(_PREFIX.pack(_MAGIC, len(skeleton), end) + skeleton, (), end)
    base = _aligned(end)
    head = _PREFIX.pack(_MAGIC, len(skeleton), base) + skeleton
    page_offset = None if enc.anchor is None else (base + enc.anchor) % PAGE
    return Encoded(head, tuple((base + offset, raw) for offset, raw in enc.raws), base + enc.size, page_offset)


class _Decoder:
    def __init__(self, buf: memoryview, base: int, borrow: Borrow | None) -> None:
        self.buf = buf
        self.base = base
        self.borrow = borrow

    def _bytes(self, offset: int, nbytes: int) -> memoryview:
        start = self.base + offset
        return self.buf[start : start + nbytes]

    def _lent(self, offset: int, nbytes: int) -> memoryview | None:
        if self.borrow is None or nbytes < LENDABLE:
            return None
        return self.borrow(self.base + offset, nbytes)

    def walk(self, node: tuple[Any, ...]) -> Any:
        tag = node[0]
        if tag == _VALUE:
            return node[1]
        if tag == _TENSOR:
            _, name, shape, offset, nbytes, requires_grad = node
            dtype = _TORCH_DTYPES[name]
            if nbytes == 0:
                out = torch.empty(shape, dtype=dtype)
            else:
                lent = self._lent(offset, nbytes) if nbytes >= LENDABLE else None
                if lent is not None:
                    out = torch.frombuffer(lent, dtype=dtype)  # the tensor holds the view: the range stays lent
                else:  # one copy, into memory the tensor owns (a bytearray copies faster than Tensor.clone)
                    out = torch.frombuffer(bytearray(self._bytes(offset, nbytes)), dtype=dtype)
                if len(shape) != 1:
                    out = out.view(shape)
            return out.requires_grad_() if requires_grad else out
        if tag == _ARRAY:
            _, dtype, shape, offset, nbytes = node
            lent = self._lent(offset, nbytes)
            if lent is not None:
                # Through a tensor, which holds the view as long as the array lives (np.frombuffer would not).
                arr = torch.frombuffer(lent, dtype=torch.uint8).numpy().view(dtype)
            else:
                arr = np.frombuffer(self._bytes(offset, nbytes), dtype=dtype).copy()
            return arr if len(shape) == 1 else arr.reshape(shape)
        if tag == _LIST:
            return list(map(self.walk, node[1]))
        if tag == _TUPLE:
            return tuple(map(self.walk, node[1]))
        if tag == _DICT:
            return dict(zip(node[1], map(self.walk, node[2])))  # noqa: B905  (the encoder wrote both)
        return node[1](*(self.walk(x) for x in node[2]))  # _NAMED


def decode(buf: memoryview, borrow: Borrow | None = None) -> Any:
    """Rebuild a sample from a range written by :meth:`Encoded.write_into`; the result never aliases ``buf``.

    Args:
        buf: the encoded range.
        borrow: called with ``(offset, nbytes)`` of each buffer of :data:`LENDABLE` bytes or more; a view it
            returns (private to the caller: a copy-on-write mapping) becomes that buffer. ``None``: copy all.

    Raises:
        ValueError: ``buf`` does not start with an encoded sample.

    Examples:
        >>> from ignite_ext.data.cache.codec import decode, encode
        >>> enc = encode(("label", 3, b"raw"))
        >>> buf = bytearray(enc.nbytes)
        >>> enc.write_into(memoryview(buf))
        >>> decode(memoryview(buf))
        ('label', 3, b'raw')

    .. versionadded:: 0.1.0
    """
    magic, length, base = _PREFIX.unpack_from(buf, 0)
    if magic != _MAGIC:
        raise ValueError("not an encoded sample")
    skeleton = pickle.loads(buf[_PREFIX.size : _PREFIX.size + length])
    return _Decoder(buf, base, borrow).walk(skeleton)
