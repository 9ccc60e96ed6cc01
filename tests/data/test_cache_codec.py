"""Round trips of the sample codec: equal values, same types, dtypes and shapes, results that own their memory."""

from __future__ import annotations

import pickle
from collections import namedtuple
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ignite_ext.data.cache._cow import PAGE
from ignite_ext.data.cache.codec import ALIGN, LENDABLE, decode, encode

Pair = namedtuple("Pair", "image label")


def roundtrip(sample: Any) -> Any:
    enc = encode(sample)
    buf = bytearray(enc.nbytes)
    enc.write_into(memoryview(buf))
    return decode(memoryview(buf))


def assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad
        assert torch.equal(a.detach(), b.detach())
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


@pytest.mark.parametrize(
    "sample",
    [
        torch.randn(3, 4),
        torch.randn(4, 6)[:, ::2],  # not contiguous
        torch.tensor(3.5),  # 0-d
        torch.zeros(0, 5),
        torch.ones(3, dtype=torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.arange(6, dtype=torch.uint8).reshape(2, 3),
        torch.randn(3, dtype=torch.complex64).conj(),
        torch.randn(2, requires_grad=True),
        np.arange(12, dtype=np.int16).reshape(3, 4).T,  # Fortran order
        np.array(7.0),
        np.zeros((2, 0)),
        np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")]),
        np.array(["ab", "c"]),
        np.array([1, "x"], dtype=object),  # object arrays go through pickle
        np.float32(1.5),
        1,
        2.5,
        True,
        None,
        "text",
        b"\x00raw",
        Fraction(1, 3),  # any other object: pickled
        (torch.ones(2), 1, "a"),
        [np.ones(2), [torch.zeros(1), {"k": b"v"}]],
        {"image": torch.rand(3, 8, 8), "label": 4, "meta": {"path": "a.png", "shape": (8, 8)}},
        Pair(torch.ones(2, 2), 3),
    ],
    ids=lambda s: type(s).__name__,
)
def test_roundtrip_keeps_values_types_dtypes_shapes(sample: Any) -> None:
    assert_same(sample, roundtrip(sample))


def test_tensors_and_arrays_are_raw_bytes_not_pickles() -> None:
    x = torch.randn(128, 256)
    enc = encode(x)
    assert enc.nbytes - x.numel() * 4 <= 2 * ALIGN  # a header of at most two cache lines
    assert len(enc.head) < len(pickle.dumps(torch.zeros(1)))


def test_decoded_tensor_owns_its_memory() -> None:
    enc = encode({"x": torch.zeros(4), "a": np.zeros(4)})
    buf = bytearray(enc.nbytes)
    enc.write_into(memoryview(buf))
    out = decode(memoryview(buf))
    out["x"] += 1
    out["a"] += 1
    again = decode(memoryview(buf))
    assert again["x"].sum() == 0 and again["a"].sum() == 0


def test_raw_buffers_are_aligned() -> None:
    enc = encode([torch.ones(3), np.ones(5), torch.ones(7)])
    assert all(offset % ALIGN == 0 for offset, _ in enc.raws)


def test_lendable_buffers_start_on_pages_of_their_own_and_the_rest_stays_packed() -> None:
    big = LENDABLE // 4 + 3  # float32 elements: a buffer just over the threshold, not a whole number of pages
    parts = [torch.ones(3), torch.ones(big), np.ones(5), np.ones(big, dtype=np.float32), torch.ones(2)]
    enc = encode(parts)
    (o_small, _), (o_big, r_big), (o_a, _), (o_abig, r_abig), (o_last, _) = enc.raws
    # Written `page_offset` bytes before a page boundary, both lendable buffers start on one ...
    assert enc.page_offset is not None and enc.page_offset % ALIGN == 0
    assert o_big % PAGE == enc.page_offset % PAGE and o_abig % PAGE == enc.page_offset % PAGE
    assert o_abig >= o_big + r_big.nbytes  # ... so the second is past the first's last page
    # Everything else is packed at 64-byte boundaries: less than a page of padding in all.
    packed = (o_big + r_big.nbytes + ALIGN - 1) // ALIGN * ALIGN
    assert o_big == o_small + ALIGN and o_a == packed and o_last >= o_abig + r_abig.nbytes
    payload = len(enc.head) + sum(raw.nbytes for _, raw in enc.raws)
    assert enc.nbytes - payload < PAGE + len(parts) * ALIGN
    assert encode([torch.ones(3), np.ones(5)]).page_offset is None  # no lendable buffer, no constraint


def test_decode_lends_large_buffers_only_and_falls_back_to_copies() -> None:
    big = torch.arange(LENDABLE // 8, dtype=torch.float64)
    sample = {"small": torch.ones(4), "big": big, "arr": big.numpy().reshape(-1, 8) + 1}
    enc = encode(sample)
    buf = bytearray(enc.nbytes)
    enc.write_into(memoryview(buf))
    private = bytearray(buf)  # stands for the private mapping a borrow callback lends from
    asked: list[tuple[int, int]] = []

    def borrow(offset: int, nbytes: int) -> memoryview:
        asked.append((offset, nbytes))
        return memoryview(private)[offset : offset + nbytes]

    out = decode(memoryview(buf), borrow)
    assert asked == [(o, r.nbytes) for o, r in enc.raws if r.nbytes >= LENDABLE]
    assert_same(sample, out)
    out["big"][0] = -1.0
    out["arr"][0, 0] = -1.0
    assert private != buf and decode(memoryview(buf))["big"][0] == 0.0  # writes went to the lent memory
    again = decode(memoryview(buf), lambda offset, nbytes: None)  # nothing lent: copies
    assert_same(sample, again)
    assert again["arr"].flags.writeable and again["arr"].flags.c_contiguous


def test_rejects_a_range_that_was_never_written() -> None:
    with pytest.raises(ValueError, match="not an encoded sample"):
        decode(memoryview(bytearray(64)))


_DTYPES = [torch.float32, torch.float64, torch.int64, torch.int8, torch.bool, torch.float16]

tensors = st.builds(
    lambda shape, dtype, seed: (torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 10).to(dtype),
    st.lists(st.integers(0, 4), max_size=3).map(tuple),
    st.sampled_from(_DTYPES),
    st.integers(0, 2**16),
)
arrays = tensors.map(lambda t: t.numpy())
leaves = st.one_of(
    tensors, arrays, st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(), st.binary(), st.none()
)
samples = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=4), inner, max_size=3),
    ),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None)
@given(samples)
def test_any_nested_sample_roundtrips(sample: Any) -> None:
    assert_same(sample, roundtrip(sample))
