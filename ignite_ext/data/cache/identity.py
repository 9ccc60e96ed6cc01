"""What a dataset is, for telling caches apart: :func:`default_name`, the name a :class:`CachedDataset` gets by default.

The ranks of a node pair their node caches by this name (see :class:`~ignite_ext.data.CachedDataset`), so it must
be equal for the same dataset on every rank, in every process, and differ for a training and a validation set. It
is made of the dataset's type, its length and a fingerprint of what describes it, and it costs O(1): no sample is
loaded, nothing is hashed in proportion to the dataset's size. What describes an object (:func:`describe`):

* ``None``, booleans, numbers, strings, bytes, ranges, enum members and paths (``os.PathLike``): their ``repr``
  (strings and bytes of more than 256 characters: their length and 64 characters at each end);
* lists and tuples: their length, first and last items;
* tensors and arrays (anything with ``shape`` and ``dtype``): their type, dtype and shape, not their values;
* any other object that has attributes (``vars()``), such as a dataset or a wrapped dataset (``Subset``,
  ``ConcatDataset``): its type and its public attributes (names not starting with ``_``), described in turn;
* anything else (functions, transforms, locks, file handles): its type only.

Three levels deep at most. So ``MNIST(root, train=True)`` and ``MNIST(root, train=False)`` differ by ``train`` (and
length), two ``ImageFolder`` by ``root`` and their first and last samples' paths, two ``Subset`` of one dataset
by their indices' length and ends. The digest is SHA-256 (never the per-process salted ``hash()``).

What it cannot tell apart are datasets that differ only in what it does not look at: private attributes, the
middle of lists, values of tensors, the state of arbitrary objects. Give such datasets a ``name=``. Conversely, a
public attribute that differs between ranks (a rank number, a per-process temporary path) makes the default names
differ, and a node cache then refuses to pair them: pass the same ``name=`` on every rank.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import enum
import hashlib
import os
from typing import Any

__all__ = ["checked_name", "default_name", "describe"]

_DEPTH = 3
_LONG, _ENDS = 256, 64  # strings and bytes longer than _LONG are described by their length and _ENDS at each end


def describe(value: Any, depth: int = _DEPTH) -> str:
    """A text that describes ``value`` cheaply and deterministically (see the module docstring for the rules).

    Args:
        value: what to describe.
        depth: how many levels of containers and attributes to look into.

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

    Args:
        dataset: a map-style dataset.

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

    Args:
        dataset: a map-style dataset.
        name: the ``name=`` a cache was given.

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
