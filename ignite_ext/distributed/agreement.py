"""The one way ranks validate together: :func:`agree` runs a step on every rank and raises on every rank if it failed.

In distributed code an error raised on one rank only is a hang on the others (they wait in the next collective).
So every check whose outcome may differ between ranks (arguments, a directory, a dataset's length) runs inside
:func:`agree`: each rank runs its step, the outcomes are exchanged, and then either every rank returns every
rank's value, or every rank raises the same error: a :class:`ValueError` when every failure was a ``ValueError``
or ``OSError`` (bad input), the package's own error when every failing rank raised that one (e.g.
:class:`~ignite_ext.errors.ShmSpaceError`), a :class:`RuntimeError` otherwise. Its message names each failing
rank and its error; on a failing rank it is chained to the original exception. A ``check`` on the gathered values
turns a disagreement between ranks (different arguments, different datasets) into a ``ValueError`` on every rank
the same way.

Cost: one exchange. By default that is :func:`~ignite_ext.distributed._gather.all_gather_bytes` (two
collectives; every rank receives every rank's outcome, so O(N) bytes per rank); the scheduler passes its store
channel's exchange instead, where the last rank to enter judges and every rank reads only the verdict.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar, overload

from ignite_ext.distributed._gather import all_gather_bytes
from ignite_ext.errors import rebuilt_error

__all__ = ["Exchange", "agree", "disagreement"]

T = TypeVar("T")
R = TypeVar("R")

#: ``exchange(mine, judge)``: give every rank's ``mine`` to ``judge`` (in rank order) and return its verdict, the
#: same on every rank. Every rank must call it.
Exchange = Callable[[bytes, Callable[[list[bytes]], bytes]], bytes]

_MAX_MESSAGE = 2000


def _describe(exc: BaseException) -> str:
    """``str(exc)``, shortened; never raises (an exception whose ``__str__`` fails must still reach the others)."""
    try:
        text = str(exc)
    except Exception as inner:  # whatever a user's __str__ raises, the failure itself must still travel
        text = f"<str() of the exception raised {type(inner).__name__}>"
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE] + "..."


def disagreement(keys: Sequence[Hashable]) -> str | None:
    """Describe how ``keys`` (one per rank) differ, or None when they are all equal.

    Args:
        keys: what must be the same on every rank, indexed by rank.

    Returns:
        ``"ranks [0, 2]: a; ranks [1]: b"`` (groups in order of their first rank), or None.

    Examples:
        >>> from ignite_ext.distributed.agreement import disagreement
        >>> disagreement(["a", "b", "a"])
        'ranks [0, 2]: a; ranks [1]: b'
        >>> disagreement(["a", "a"]) is None
        True

    .. versionadded:: 0.2.0
    """
    groups: dict[Hashable, list[int]] = {}
    for rank, key in enumerate(keys):
        groups.setdefault(key, []).append(rank)
    if len(groups) <= 1:
        return None
    return "; ".join(f"ranks {ranks}: {key}" for key, ranks in groups.items())


def _gather_exchange(mine: bytes, judge: Callable[[list[bytes]], bytes]) -> bytes:
    return judge(all_gather_bytes(mine))


def _verdict(
    blobs: list[bytes], what: str, check: Callable[[list[Any]], str | None] | None, combine: Callable[[list[Any]], Any]
) -> bytes:
    outcomes = [pickle.loads(b) for b in blobs]
    failed = [(rank, o) for rank, o in enumerate(outcomes) if not o[0]]
    if failed:
        details = "; ".join(f"rank {rank}: {name.rsplit('.', 1)[-1]}: {text}" for rank, (_, name, text, _) in failed)
        names = {name for _, (_, name, _, _) in failed}
        # An error of the package keeps its type on every rank when every failing rank raised that very type.
        if len(names) == 1 and rebuilt_error(only := names.pop(), "") is not None:
            kind = only
        else:
            kind = "ValueError" if all(user for _, (_, _, _, user) in failed) else "RuntimeError"
        message = f"{what} failed on rank(s) {[rank for rank, _ in failed]}: {details}"
        return pickle.dumps((False, kind, message))
    values = [o[1] for o in outcomes]
    problem = check(values) if check is not None else None
    if problem:
        return pickle.dumps((False, "ValueError", f"{what}: {problem}"))
    return pickle.dumps((True, combine(values)))


@overload
def agree(
    fn: Callable[[], T],
    what: str,
    *,
    check: Callable[[list[T]], str | None] | None = ...,
    exchange: Exchange | None = ...,
) -> list[T]: ...


@overload
def agree(
    fn: Callable[[], T],
    what: str,
    *,
    check: Callable[[list[T]], str | None] | None = ...,
    combine: Callable[[list[T]], R],
    exchange: Exchange | None = ...,
) -> R: ...


def agree(
    fn: Callable[[], Any],
    what: str,
    *,
    check: Callable[[list[Any]], str | None] | None = None,
    combine: Callable[[list[Any]], Any] | None = None,
    exchange: Exchange | None = None,
) -> Any:
    """Run ``fn`` on every rank and return every rank's result; if it failed anywhere, raise on every rank.

    Every rank of the world must call it (it is a collective), with the same ``what``, ``check`` and ``combine``.

    Args:
        fn: this rank's step; its result must be picklable.
        what: a few words for the error message, e.g. ``"creating the census marker"``.
        check: given every rank's result (in rank order), return a description of what is wrong with them
            together (e.g. :func:`disagreement` of the arguments), or None when they are fine.
        combine: given every rank's result, return what every rank gets back instead of the list (computed
            once, where the verdict is made: with a store exchange every rank reads only this).
        exchange: how the outcomes travel (see :data:`Exchange`); by default an ``all_gather`` of the current
            :mod:`ignite.distributed` computation model (NCCL, Gloo, Horovod, XLA).

    Returns:
        Every rank's result of ``fn``, indexed by rank (or what ``combine`` made of them).

    Raises:
        ValueError: on every rank, when ``fn`` raised ``ValueError`` or ``OSError`` on some rank (bad input), or
            ``check`` found a problem.
        ShmSpaceError: on every rank, when that is what ``fn`` raised on every failing rank (likewise
            ``ArchiveError``, ``DownloadError`` and ``ChecksumError``).
        RuntimeError: on every rank, when ``fn`` raised anything else on some rank.

    Examples:
        >>> import os
        >>> from ignite_ext.distributed import agree
        >>> agree(lambda: os.path.isdir("/"), "checking the root directory")
        [True]
        >>> agree(lambda: int("x"), "parsing the setting")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: parsing the setting failed on rank(s) [0]: rank 0: ValueError: invalid literal for int() ...

    .. versionadded:: 0.2.0
    """
    error: BaseException | None = None
    try:
        mine: tuple[Any, ...] = (True, fn())
    except Exception as exc:  # reported to every rank below
        error = exc
        name = f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins.")
        mine = (False, name, _describe(exc), isinstance(exc, ValueError | OSError))
    verdict = pickle.loads(
        (exchange or _gather_exchange)(
            pickle.dumps(mine), lambda blobs: _verdict(blobs, what, check, combine or (lambda values: values))
        )
    )
    if verdict[0]:
        return verdict[1]
    _, kind, message = verdict
    kept = rebuilt_error(kind, message)
    if kept is not None:
        raise kept from error
    raise (ValueError if kind == "ValueError" else RuntimeError)(message) from error
