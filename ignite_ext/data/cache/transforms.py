"""Transforms and the cache: augment after it, and a warning when the wrapped dataset transforms inside it.

A cache stores what ``dataset[index]`` returns, where torchvision's datasets apply their ``transform``: a random
augmentation would be drawn once and served forever. :func:`warn_if_frozen` points to the remedy,
:class:`CachedDataset(dataset, transform=...) <ignite_ext.data.CachedDataset>`, which runs it on every read.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import warnings
from typing import Any

from ignite_ext.errors import IgniteExtError

__all__ = ["FrozenTransformWarning", "warn_if_frozen"]


class FrozenTransformWarning(IgniteExtError, UserWarning):
    """A wrapped dataset applies a transform inside ``__getitem__``: the cache would serve its first output forever.

    Pass the augmentation to :class:`CachedDataset(dataset, transform=...) <ignite_ext.data.CachedDataset>`
    instead. A deterministic transform (decoding, ``ToTensor``, ``Normalize``) is worth caching: silence the
    warning with ``warnings.filterwarnings("ignore", category=FrozenTransformWarning)``.

    .. versionadded:: 0.2.0
    """


_DATASET_TRANSFORMS = ("transform", "target_transform", "transforms")


def _short_repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # whatever a user's __repr__ raises, the warning must still be given
        return f"<{type(value).__qualname__}>"
    return text if len(text) <= 200 else text[:200] + "..."


def warn_if_frozen(dataset: Any, depth: int = 3, stacklevel: int = 1) -> None:
    """Warn about the first transform that ``dataset[index]`` applies (looking into wrapped datasets too).

    ``depth``: the levels of wrapping (``.dataset``, ``.datasets``) to look into; ``stacklevel``: as for
    :func:`warnings.warn`, from the caller of this function.

    Examples:
        >>> import warnings
        >>> from ignite_ext.data.cache.transforms import FrozenTransformWarning, warn_if_frozen
        >>> class Folder:
        ...     def __init__(self, transform=None):
        ...         self.transform = transform
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_if_frozen(Folder(transform=None))
        ...     warn_if_frozen(Folder(transform=abs))
        >>> [w.category is FrozenTransformWarning for w in caught]
        [True]

    .. versionadded:: 0.2.0
    """
    for attribute in _DATASET_TRANSFORMS:
        try:
            value = getattr(dataset, attribute, None)
        except Exception:  # a property that fails: nothing to tell
            value = None
        if value is not None:
            warnings.warn(
                f"{type(dataset).__qualname__} applies its {attribute}={_short_repr(value)} inside __getitem__, so "
                "the cache stores that output of the first read and serves it on every later read: a random "
                "augmentation is frozen at its first draw. Build the dataset without it and pass it to "
                "CachedDataset(dataset, transform=...), which applies it after the cache on every read. If it is "
                "deterministic (decoding, ToTensor, Normalize), caching its output is what you want: silence this "
                "with warnings.filterwarnings('ignore', category=FrozenTransformWarning).",
                FrozenTransformWarning,
                stacklevel=stacklevel + 1,
            )
            return
    if depth > 1:  # Subset, ConcatDataset and the like hold the datasets that transform
        inner = getattr(dataset, "dataset", None)
        several = getattr(dataset, "datasets", None)
        for wrapped in [inner] if inner is not None else several if isinstance(several, list | tuple) else []:
            warn_if_frozen(wrapped, depth - 1, stacklevel + 1)
