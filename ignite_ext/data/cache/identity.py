"""What a dataset is, for telling caches apart: the default ``name=`` of a cache, and what pairs node caches.

The ranks of a node pair their node caches by the order of construction, and check in the construction's one
agreement that each pair is one thing: the same *name* (:func:`checked_name`: the ``name=`` given, or
:func:`default_name`, O(1): no sample loaded), with the default name the same *construction site*
(:func:`construction_site`), and the same *sampled content* (:func:`sample_fingerprint`). The cache guide's
*Node scope* says what each tells apart, and what none does.

.. versionadded:: 0.2.0
.. versionchanged:: 0.3.0
   :func:`construction_site`, :func:`fingerprint_indices` and :func:`sample_fingerprint`: what pairs node caches
   besides the name.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import hashlib
import os
import pickle
import random
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from _hashlib import HASH

__all__ = ["checked_name", "construction_site", "default_name", "describe", "fingerprint_indices", "sample_fingerprint"]

_DEPTH = 3
_LONG, _ENDS = 256, 64  # strings and bytes longer than _LONG are described by their length and _ENDS at each end


def describe(value: Any, depth: int = _DEPTH) -> str:
    """A text that describes ``value`` cheaply and deterministically, looking ``depth`` levels deep.

    ``None``, booleans, numbers, strings, bytes, ranges, enum members and paths: their ``repr`` (strings and bytes
    of more than 256 characters: their length and 64 characters at each end); lists and tuples: their length, first
    and last items; tensors and arrays (``shape`` and ``dtype``): type, dtype and shape, not values; any other
    object with attributes (``vars()``), such as a wrapped dataset: its type and public attributes, described in
    turn; anything else (functions, locks, file handles): its type only.

    Examples:
        >>> from pathlib import PurePosixPath
        >>> from ignite_ext.data.cache.identity import describe
        >>> describe([PurePosixPath("/data/train/0.png"), 7, 9])
        "list[3](PurePosixPath('/data/train/0.png'), 9)"
        >>> class Folder:
        ...     def __init__(self, root):
        ...         self.root, self._handle = root, object()
        >>> describe(Folder("/data/val"))
        "Folder{root='/data/val'}"

    .. versionadded:: 0.2.0
    """
    kind = type(value).__qualname__
    if isinstance(value, str | bytes) and len(value) > _LONG:  # O(1) still: its length and ends
        return f"{kind}[{len(value)}]({value[:_ENDS]!r}...{value[-_ENDS:]!r})"
    if value is None or isinstance(value, bool | int | float | complex | str | bytes | range | enum.Enum):
        return repr(value)
    if isinstance(value, os.PathLike):
        return f"{kind}({os.fspath(value)!r})"
    if depth <= 0:
        return kind
    if isinstance(value, list | tuple):
        ends = [describe(item, depth - 1) for item in ((value[0], value[-1]) if len(value) > 1 else value)]
        return f"{kind}[{len(value)}]({', '.join(ends)})"
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{kind}({value.dtype}, {tuple(value.shape)})"
    try:
        attributes = vars(value)
    except TypeError:
        return kind
    if not isinstance(attributes, dict):  # a mappingproxy of a class, or something odd
        return kind
    public = sorted(
        ((k, v) for k, v in attributes.items() if isinstance(k, str) and not k.startswith("_")), key=lambda kv: kv[0]
    )
    return f"{kind}{{{', '.join(f'{k}={describe(v, depth - 1)}' for k, v in public)}}}"


def default_name(dataset: Any) -> str:
    """``<module>.<type>[<length>]#<12 hex digits of SHA-256 of describe(dataset)>``.

    Examples:
        >>> from ignite_ext.data.cache.identity import default_name
        >>> class Digits:
        ...     def __init__(self, train):
        ...         self.train = train
        ...     def __len__(self):
        ...         return 10
        >>> train, val = default_name(Digits(train=True)), default_name(Digits(train=False))
        >>> train.split("#")[0], train == default_name(Digits(train=True)), train == val
        ('ignite_ext.data.cache.identity.Digits[10]', True, False)

    .. versionadded:: 0.2.0
    """
    kind = type(dataset)
    digest = hashlib.sha256(describe(dataset).encode("utf-8", "backslashreplace")).hexdigest()[:12]
    return f"{kind.__module__}.{kind.__qualname__}[{len(dataset)}]#{digest}"


def checked_name(dataset: Any, name: str | None) -> str:
    """``name``, once it is known to be a non-empty string; :func:`default_name` of ``dataset`` when it is None.

    Raises:
        ValueError: ``name`` is neither None nor a non-empty string.

    Examples:
        >>> from ignite_ext.data.cache.identity import checked_name
        >>> checked_name([1, 2], "digits/train"), checked_name([1, 2], None)
        ('digits/train', 'builtins.list[2]#...')

    .. versionadded:: 0.2.0
    """
    if name is None:
        return default_name(dataset)
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    return name


# This package's directory: frames in it are the cache's own, not where the user constructed it.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
_constructions: dict[str, int] = {}


def construction_site() -> str:
    """``<file>:<line>#<k>``: where the caller was called from outside this package, and the how-manieth time.

    The frame is the first one, from the caller outward, whose file is not in ``ignite_ext`` (the user's
    ``CachedDataset(...)``, a subclass's ``super().__init__``, a helper of the user's); the file by its base name
    (ranks may run one script from different directories). ``k`` counts the calls from that line in this process,
    from 1, so caches constructed in a loop pair by their order: call it once per construction, on every rank.

    Examples:
        >>> from ignite_ext.data.cache.identity import construction_site
        >>> [construction_site() for _ in range(2)]  # one line, called twice
        ['<doctest ...>:1#1', '<doctest ...>:1#2']

    .. versionadded:: 0.3.0
    """
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    line = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
    k = _constructions[line] = _constructions.get(line, 0) + 1
    return f"{line}#{k}"


def fingerprint_indices(n: int) -> tuple[int, ...]:
    """The indices :func:`sample_fingerprint` reads in a dataset of ``n`` samples: ``0``, ``n // 2`` and ``n - 1``.

    Without repeats, in increasing order (fewer below three samples). The first and last sample tell apart most
    splits and shards; the middle one, datasets that share their ends.

    Examples:
        >>> from ignite_ext.data.cache.identity import fingerprint_indices
        >>> fingerprint_indices(1000), fingerprint_indices(2), fingerprint_indices(0)
        ((0, 500, 999), (0, 1), ())

    .. versionadded:: 0.3.0
    """
    return tuple(sorted({0, n // 2, n - 1})) if n > 0 else ()


def sample_fingerprint(dataset: Any) -> str:
    """12 hex digits of a SHA-256 of ``len(dataset)`` and the samples at :func:`fingerprint_indices`.

    Loads at most three samples, in this process, and hashes all of their contents: tensors and arrays by dtype,
    shape and every byte; strings, bytes and numbers by value; containers by their items (sets in any order);
    anything else by its pickle, or its type. Sparse and quantized tensors count by dtype, shape and layout only.
    The reads are seeded (torch's CPU generator, :mod:`random` and NumPy, restored afterwards), so a random
    augmentation drawn from them inside ``__getitem__`` fingerprints alike on every rank. A dataset object is read
    through a shallow copy, so a handle it opens on its first read (HDF5, LMDB) is not left open for the workers.

    Raises:
        Exception: whatever ``dataset[i]`` raises.

    Examples:
        >>> import torch
        >>> from ignite_ext.data.cache.identity import default_name, sample_fingerprint
        >>> train, val = [torch.ones(3)] * 4, [-torch.ones(3)] * 4
        >>> default_name(train) == default_name(val), sample_fingerprint(train) == sample_fingerprint(val)
        (True, False)
        >>> sample_fingerprint(train) == sample_fingerprint([torch.ones(3) for _ in range(4)])
        True

    .. versionadded:: 0.3.0
    """
    n = len(dataset)
    reader = dataset
    if hasattr(dataset, "__dict__"):  # builtins (lists, tuples) have no state to open; copying them costs O(n)
        try:
            reader = copy.copy(dataset)
        except Exception:  # an object that refuses to be copied is read as it is
            reader = dataset
    digest = hashlib.sha256(b"%d|" % n)
    with _seeded() as seed:
        for i in fingerprint_indices(n):
            seed(i)
            try:
                sample = reader[i]
            except Exception:
                if reader is dataset:
                    raise
                # A copy can be broken where the dataset is not (a __getstate__ that leaves out what reads need):
                # the copy is only a precaution, so read the dataset itself, and let its own error stand.
                reader = dataset
                seed(i)
                sample = reader[i]
            digest.update(b"#%d|" % i)
            _feed(digest, sample)
    return digest.hexdigest()[:12]


@contextlib.contextmanager
def _seeded() -> Iterator[Any]:
    """Yield ``seed(i)``, which seeds the global generators; restore their states on the way out."""
    # Only torch's CPU generator: torch.manual_seed would also reseed CUDA's, which this does not restore.
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state())

    def seed(i: int) -> None:
        torch.default_generator.manual_seed(i)
        random.seed(i)
        np.random.seed(i)

    try:
        yield seed
    finally:
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])


_NESTING = 32  # deeper than any sample; a container that contains itself stops here


def _feed(digest: HASH, value: Any, depth: int = _NESTING) -> None:
    """Add ``value``'s type and content to ``digest`` (see :func:`sample_fingerprint`), unambiguously."""
    kind = type(value)
    digest.update(f"{kind.__module__}.{kind.__qualname__}|".encode())
    if depth <= 0:
        return
    if isinstance(value, torch.Tensor):
        digest.update(f"{value.dtype}{tuple(value.shape)}{value.layout}|".encode())
        if value.layout is torch.strided and not value.is_quantized:
            flat = value.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
            digest.update(flat.numpy().data)
        return
    if isinstance(value, np.ndarray) and not value.dtype.hasobject:
        digest.update(f"{value.dtype.str}{value.shape}|".encode())
        digest.update(np.ascontiguousarray(value).reshape(-1).view(np.uint8).data)
        return
    if isinstance(value, str):
        value = value.encode("utf-8", "surrogatepass")
    if isinstance(value, bytes | bytearray | memoryview):
        raw = value if isinstance(value, bytes) else bytes(value)  # a memoryview's len() counts items, not bytes
        digest.update(b"%d|" % len(raw))
        digest.update(raw)
        return
    if value is None or isinstance(value, bool | int | float | complex):
        digest.update(repr(value).encode() + b"|")
        return
    if isinstance(value, list | tuple):
        digest.update(b"%d|" % len(value))
        for item in value:
            _feed(digest, item, depth - 1)
        return
    if isinstance(value, dict):
        digest.update(b"%d|" % len(value))
        for key, item in value.items():
            _feed(digest, key, depth - 1)
            _feed(digest, item, depth - 1)
        return
    if isinstance(value, set | frozenset):  # their order varies with the per-process salted hash()
        items = []
        for item in value:
            one = hashlib.sha256()
            _feed(one, item, depth - 1)
            items.append(one.digest())
        digest.update(b"%d|" % len(items) + b"".join(sorted(items)))
        return
    try:
        raw = pickle.dumps(value, protocol=4)  # one protocol on every rank, whatever pickle's default becomes
    except Exception:  # an object that does not pickle counts by its type only
        return
    digest.update(b"%d|" % len(raw))
    digest.update(raw)
