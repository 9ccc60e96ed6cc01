"""The rank scheduler: run a block on some ranks first, the others after, and never deadlock.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from types import TracebackType
from typing import ParamSpec

import ignite.distributed as idist
import torch.utils.data

from ignite_ext import progress
from ignite_ext.distributed import liveness
from ignite_ext.distributed._channel import Channel
from ignite_ext.distributed._channel_choice import make_channel, scheduler_store
from ignite_ext.distributed._collective import IdistComm
from ignite_ext.distributed._progress_watch import watched
from ignite_ext.distributed._state import GroupState, group_state
from ignite_ext.distributed._store_channel import StoreChannel
from ignite_ext.distributed.agreement import agree, disagreement
from ignite_ext.distributed.policies import MasterFirst, Ordered, Plan, Policy, Turn, World
from ignite_ext.distributed.shared_path import SharedPath
from ignite_ext.errors import CollectiveError, RankFailedError, RankFailure, RankStalledError

__all__ = ["at_block_end", "current_block", "one_rank_first", "rank_scheduler"]

_MAX_MESSAGE = 2000
#: The innermost frames of a failing block's traceback that its failure carries to the other ranks.
_WHERE_FRAMES = 3
# The package's own policies plan from the agreed world alone: the same on every rank by construction.
_BUILTIN = (MasterFirst, Ordered, SharedPath)
# Per thread: for each scheduled block it is in (outermost first), what to call once this rank has left it.
_ENDS = threading.local()
_P = ParamSpec("_P")


class _UsersBlock(AbstractContextManager[Turn]):
    """A block as the user's ``with`` sees it: its errors come from the user's ``with`` line.

    What the ranks' protocol raises on entering or leaving (another rank's failure, a wait's time-out) drops the
    protocol's frames: a launcher shows a traceback's innermost line, and the user's code is what to look at.
    """

    def __init__(self, inner: AbstractContextManager[Turn]) -> None:
        self._inner = inner

    def __enter__(self) -> Turn:
        try:
            return self._inner.__enter__()
        except (RankFailedError, TimeoutError) as error:
            error.__traceback__ = None
            raise error  # the block's ranks failed (its message says which, and why): raised on this rank too

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        try:
            return self._inner.__exit__(exc_type, exc, tb)
        except (RankFailedError, TimeoutError) as error:
            if error is not exc:  # the body's own error keeps every frame
                error.__traceback__ = None
            raise error  # the block's ranks failed (its message says which, and why): raised on this rank too


def _users_block(fn: Callable[_P, Iterator[Turn]]) -> Callable[_P, AbstractContextManager[Turn]]:
    """``contextmanager``, whose errors come from the user's ``with`` line (:class:`_UsersBlock`)."""
    managed = contextmanager(fn)

    @functools.wraps(fn)
    def block(*args: _P.args, **kwargs: _P.kwargs) -> AbstractContextManager[Turn]:
        return _UsersBlock(managed(*args, **kwargs))

    return block


def at_block_end(callback: Callable[[], None]) -> bool:
    """Call ``callback`` once this thread has left the scheduled block it runs in; False (no call) outside one.

    Leaving a block that did not fail means every rank has finished it (the exit waits for all), so what the
    block's ranks may still need from this one (a server of this process, say) can stay up until then. Inside
    nested blocks, the outermost one counts. An exception of ``callback`` is logged, not raised.

    Examples:
        >>> import ignite_ext.distributed as idist
        >>> with idist.one_rank_first():
        ...     idist.at_block_end(lambda: print("every rank has left"))
        ...     print("in the block")
        True
        in the block
        every rank has left
        >>> idist.at_block_end(print)
        False

    .. versionadded:: 0.3.0
    """
    stack: list[tuple[int, list[Callable[[], None]]]] = getattr(_ENDS, "stack", [])
    if not stack:
        return False
    stack[0][1].append(callback)
    return True


def current_block() -> int | None:
    """The number of the scheduled block this thread runs in (the outermost one), the same on every rank; or None.

    Blocks are numbered in the order the ranks enter them, which is the same on every rank: what one block's
    ranks coordinate on their own (under store keys of their own, say) can be told from another block's by it.

    Examples:
        >>> import ignite_ext.distributed as idist
        >>> idist.current_block() is None
        True
        >>> with idist.one_rank_first():
        ...     isinstance(idist.current_block(), int)
        True

    .. versionadded:: 0.3.0
    """
    stack: list[tuple[int, list[Callable[[], None]]]] = getattr(_ENDS, "stack", [])
    return stack[0][0] if stack else None


@contextmanager
def _calling_at_end(seq: int) -> Iterator[None]:
    stack: list[tuple[int, list[Callable[[], None]]]] = _ENDS.__dict__.setdefault("stack", [])
    ends: list[Callable[[], None]] = []
    stack.append((seq, ends))
    try:
        yield
    finally:
        stack.pop()
        for callback in ends:
            try:
                callback()
            except Exception:
                logging.getLogger("ignite_ext.distributed").exception("a callback at the end of a block failed")


def _describe(order: object) -> str:
    name = f"{type(order).__module__}.{type(order).__qualname__}"
    return f"{name}:{order.describe()}" if isinstance(order, Policy) else f"{name}:{order!r}"


def _check(order: object, world: World) -> None:
    """Raise ``ValueError`` when this rank's ``order`` is not a policy or does not fit ``world``."""
    if not isinstance(order, Policy):
        raise ValueError(f"order should be a Policy (e.g. MasterFirst(), Ordered()), but given {order!r}")
    order.validate(world)


def _call_site() -> str:
    """``file:line`` of the ``with`` statement that entered the scheduler (outside contextlib and this module)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in (__file__, contextlib.__file__):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "?"
    # The base name: ranks may run the same script from different directories (or hosts' install paths).
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _seconds(name: str, value: object) -> None:
    """``ValueError`` unless ``value`` is None or a positive number of seconds."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise ValueError(f"{name} should be a number of seconds or None, but given {value!r}")
    if value is not None and not value > 0:
        raise ValueError(f"{name} should be positive, but given {value!r}")


def _stall(stall_timeout: float | None) -> tuple[float | None, bool]:
    """The block's stall deadline (None: none) and whether it counts from the body's start (asked explicitly)."""
    deadline = stall_timeout if stall_timeout is not None else liveness.stall_timeout()
    return (None if deadline == float("inf") or deadline <= 0 else float(deadline)), stall_timeout is not None


def _entry(order: object, timeout: float | None, stall_timeout: float | None, site: str) -> tuple[int, int, str]:
    """This rank's entry (its node, local rank, what it passed and where); ``ValueError`` if what it passed is invalid.

    The call site is part of what must agree: a rank that runs one block more than the others, or enters from a
    thread, would otherwise pair its block with another one of theirs. So is the stall deadline as this rank
    resolved it (``IGNITE_EXT_STALL_TIMEOUT`` may differ between ranks' environments).
    """
    n, npn = idist.get_world_size(), idist.get_nproc_per_node()
    _check(order, World(n, tuple(r // npn for r in range(n)), tuple(r % npn for r in range(n))))
    _seconds("timeout", timeout)
    _seconds("stall_timeout", stall_timeout)
    stall = _stall(stall_timeout)
    args = f"{_describe(order)}|timeout={timeout!r}|stall_timeout={stall[0]!r}{'' if stall[1] else ' (default)'}"
    return idist.get_node_rank(), idist.get_local_rank(), f"{args}|at {site}"


def _mismatch(caller: str) -> Callable[[list[tuple[int, int, str]]], str | None]:
    """The check that every rank entered ``caller`` (the function the user called) alike."""

    def check(entries: list[tuple[int, int, str]]) -> str | None:
        differ = disagreement([args for _, _, args in entries])
        if differ is None:
            return None
        return (
            f"ranks passed different {caller} arguments or entered different blocks (every rank must enter the same "
            f"block, from the same line, with the same arguments): {differ}"
        )

    return check


#: The world's shape as the verdict carries it: ``("grid", N, per_node)`` when rank ``r`` is local rank
#: ``r % per_node`` of node ``r // per_node`` (the usual launch: a few bytes whatever N), else every rank's pair.
Layout = tuple[str, int, int] | tuple[str, tuple[int, ...], tuple[int, ...]]


def _layout(entries: list[tuple[int, int, str]]) -> Layout:
    nodes, locals_ = tuple(e[0] for e in entries), tuple(e[1] for e in entries)
    per_node = max(locals_) + 1
    if all(nodes[r] == r // per_node and locals_[r] == r % per_node for r in range(len(entries))):
        return ("grid", len(entries), per_node)
    return ("ranks", nodes, locals_)


def _world(layout: Layout) -> World:
    """The :class:`World` of a verdict's layout (built on every rank, from a few bytes for a regular layout).

    Examples:
        >>> from ignite_ext.distributed.schedule import _layout, _world
        >>> _layout([(0, 0, "x"), (0, 1, "x"), (1, 0, "x"), (1, 1, "x")])
        ('grid', 4, 2)
        >>> _world(("grid", 4, 2)).node_ranks, _world(("ranks", (0, 1), (0, 0))).local_ranks
        ((0, 0, 1, 1), (0, 0))
    """
    _, first, second = layout
    if isinstance(first, int) and isinstance(second, int):  # ("grid", N, per_node)
        return World(first, tuple(r // second for r in range(first)), tuple(r % second for r in range(first)))
    assert isinstance(first, tuple) and isinstance(second, tuple)
    return World(len(first), first, second)


def _agree_on_entry(
    channel: Channel, order: object, timeout: float | None, stall_timeout: float | None, site: str, caller: str
) -> World:
    """Check every rank's entry together; ``ValueError`` on every rank if any is invalid or they differ.

    ``caller`` is the function the user called (``one_rank_first`` or ``rank_scheduler``): the errors name it.
    """
    layout = agree(
        lambda: _entry(order, timeout, stall_timeout, site),
        f"checking the arguments of {caller}",
        check=_mismatch(caller),
        combine=_layout,
        exchange=channel.exchange,
    )
    return _world(layout)


def _digest(plan: Plan) -> str:
    text = repr([(t.rank, bool(t), sorted(t.after), t.group, t.leader) for t in plan.turns])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _plans_differ(digests: list[str]) -> str | None:
    differ = disagreement(digests)
    return None if differ is None else f"the policy planned differently on different ranks (plan digests): {differ}"


def _failure(rank: int, exc: BaseException, last: progress.Progress | None = None) -> RankFailure:
    """``exc`` as the others learn of it; ``last``: the progress the block reported before it (said after)."""
    try:
        message = str(exc)
    except Exception as inner:  # a failure must reach the others even when its __str__ is broken
        message = f"<str() of the exception raised {type(inner).__name__}>"
    if len(message) > _MAX_MESSAGE:
        message = message[:_MAX_MESSAGE] + "..."
    if last is not None:
        message += f" [last progress: {last}]"
    where = "".join(traceback.format_list(traceback.extract_tb(exc.__traceback__)[-_WHERE_FRAMES:]))
    if len(where) > _MAX_MESSAGE:
        where = "..." + where[-_MAX_MESSAGE:]
    return RankFailure(rank, type(exc).__qualname__, message, where=where)


@contextmanager
def _run_nested(order: object, state: GroupState) -> Iterator[Turn]:
    # The ranks inside a scheduled block are a subset of the world, so any collective here would deadlock
    # (as nested one_rank_first does in ignite and Lightning). The outer block already orders the ranks:
    # run at once and yield what the policy says of this rank. Errors here fail the outer block, safely.
    world = state.world
    assert world is not None
    _check(order, world)
    assert isinstance(order, Policy)
    if order.collective:
        raise RuntimeError(f"{order!r} communicates, so it cannot run inside another scheduled block")
    with state.inside(world):
        yield order.plan(world, IdistComm()).turns[idist.get_rank()]


@_users_block
def rank_scheduler(
    order: Policy | None = None, *, timeout: float | None = None, stall_timeout: float | None = None
) -> Iterator[Turn]:
    """Run the ``with`` block on the ranks in the order the policy sets; yield this rank's :class:`Turn`.

    Every rank of the world must enter it (it is collective). The value yielded is truthy on the ranks that
    run first (e.g. those that should download), and tells the rank its group and leader.

    Failure semantics, which peers' versions lack:

    * A rank whose block raises re-raises its own exception. Every rank that waited for it raises
      :class:`~ignite_ext.distributed.RankFailedError` naming it, without running the block; ranks that
      already ran raise it when they leave the block. Nobody hangs, nobody runs after a failure it waited on.
    * Invalid arguments, or arguments that differ between ranks, raise ``ValueError`` on every rank before
      anyone runs the block.
    * On native backends (gloo, nccl) waiting uses the process group's store, not a collective: a first rank
      may run far longer than the process group's timeout. Waiting ranks log (logger
      ``ignite_ext.distributed``, INFO) whom they wait for every 30 s; a rank killed inside the block is
      reported as failed at once by its keeper when its host lives on, else when its heartbeat has stopped for
      ``IGNITE_EXT_HEARTBEAT_TIMEOUT`` (10 s; :doc:`/settings` lists the package's environment variables).
      On Horovod and XLA, waits are collectives: ``timeout`` is not enforced and a killed rank surfaces as the
      backend's own error (see the backends page).
    * Serial runs (world size 1) run the block and yield a truthy turn. A scheduler nested inside a scheduled
      block does not communicate (the outer one already orders the ranks) and yields its policy's turn.
      DataLoader worker processes are not ranks: calling it there raises ``RuntimeError``.

    Args:
        order: the policy, :class:`~ignite_ext.distributed.MasterFirst` (default),
            :class:`~ignite_ext.distributed.Ordered`, :class:`~ignite_ext.distributed.SharedPath` or your own.
        timeout: seconds a rank may wait for others before raising ``TimeoutError``; None waits as long as
            the ranks it waits for are alive.
        stall_timeout: seconds a first rank may go without progress (:mod:`ignite_ext.progress`, which the
            package's downloads report by themselves) before every rank raises
            :class:`~ignite_ext.distributed.RankStalledError`, counted from the body's start and from each
            report. None: the default deadline (``IGNITE_EXT_STALL_TIMEOUT``, 600 s), counted only while a
            reported activity is unfinished, so that work that reports nothing is never taken for a stall;
            ``float("inf")``: none. See the scheduling guide, "Slow, stalled or dead".

    Yields:
        This rank's :class:`~ignite_ext.distributed.Turn` (truthy when it runs first).

    Raises:
        RankFailedError: another rank's block failed (or it died) and this rank waited for it or ran before it.
        RankStalledError: a first rank's progress stopped advancing for ``stall_timeout`` (a
            :class:`~ignite_ext.distributed.RankFailedError`).
        ValueError: invalid or mismatched arguments, on every rank.
        TimeoutError: ``timeout`` passed while waiting.
        RuntimeError: called from a DataLoader worker.

    Examples:
        >>> import ignite_ext.distributed as idist
        >>> with idist.rank_scheduler(order=idist.Ordered()) as turn:
        ...     print(f"rank {idist.get_rank()} first={bool(turn)}")
        rank 0 first=True

    .. versionadded:: 0.1.0
    .. versionchanged:: 0.4.0
       ``stall_timeout``: a first rank whose reported progress stops advancing is reported on every rank.
    """
    yield from _scheduled(MasterFirst() if order is None else order, timeout, stall_timeout, "rank_scheduler")


def _scheduled(order: object, timeout: float | None, stall_timeout: float | None, caller: str) -> Iterator[Turn]:
    """:func:`rank_scheduler`'s work, for ``caller``: the function the user called, which the errors name."""
    if torch.utils.data.get_worker_info() is not None:
        raise RuntimeError(
            f"{caller} cannot run in a DataLoader worker: workers are not ranks and must not take part in "
            "collectives; schedule the work in the main process (e.g. in the dataset's setup)"
        )
    site = _call_site()
    rank, world_size = idist.get_rank(), idist.get_world_size()
    store = scheduler_store() if world_size > 1 else None
    state = group_state(store)
    if state.depth > 0:
        with _run_nested(order, state) as nested_turn:
            yield nested_turn
        return
    label = order.describe() if isinstance(order, Policy) else repr(order)
    # An invalid timeout is reported by the entry exchange, so that exchange must not itself obey it.
    usable = isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout > 0
    if world_size == 1:
        world = _agree_on_entry(
            make_channel(None, state, rank, 1, label, None, -1), order, timeout, stall_timeout, site, caller
        )
        assert isinstance(order, Policy)
        with _calling_at_end(-1), state.inside(world):
            yield order.plan(world, IdistComm()).turns[rank]
        return
    seq = state.take_sequence()
    try:
        channel = make_channel(store, state, rank, world_size, label, timeout if usable else None, seq)
        with _calling_at_end(seq), _block(channel, order, timeout, stall_timeout, state, (site, caller)) as turn:
            yield turn
    finally:
        state.leave(seq)  # whatever happened, this process reads no key of the block any more


def _plan(order: Policy, world: World) -> Plan:
    """The plan of ``order`` for ``world``, the same on every rank (or an error on every rank).

    A gather that fails in the backend raises :class:`~ignite_ext.errors.CollectiveError`.
    """
    comm = IdistComm()
    if isinstance(order, _BUILTIN):
        return order.plan(world, comm)
    # A policy of the user's must plan alike on every rank, or two ranks could both run "first"; and its plan
    # raising on one rank must raise on every rank, not leave the others waiting for that rank's outcome.
    plans: list[Plan] = []

    def planned() -> str:
        plans.append(order.plan(world, comm))
        return _digest(plans[0])

    agree(
        planned,
        f"planning with {order!r}",
        check=_plans_differ,
        exchange=lambda mine, judge: judge(comm.all_gather_object(mine)),
    )
    return plans[0]


@contextmanager
def _block(
    channel: Channel,
    order: object,
    timeout: float | None,
    stall_timeout: float | None,
    state: GroupState,
    entered: tuple[str, str],
) -> Iterator[Turn]:
    """One communicating block on this rank: entry, wait, run, leave; ``entered``: the call site and function."""
    rank = channel.rank
    world = _agree_on_entry(channel, order, timeout, stall_timeout, *entered)
    assert isinstance(order, Policy)
    try:
        plan = _plan(order, world)
    except CollectiveError as exc:
        # A peer died during the plan's gathers (SharedPath's census): the others' gathers fail, each in its own way
        # and moment. The dead ranks' cut explains it, the same for every rank; this rank's outcome says so, so
        # that nobody waits for it.
        explained = channel.explain(exc)
        if explained is None:
            channel.leave([_failure(rank, exc)], [], linger=False)  # its own failure, so nobody waits for it
            raise
        channel.leave([], list(explained.failures))
        raise explained from exc
    turn = plan.turns[rank]
    channel.start(plan)
    try:
        inherited = channel.wait_turn()
    except TimeoutError as exc:
        channel.leave([_failure(rank, exc)], [], linger=False)
        raise
    if inherited:
        channel.leave([], inherited)
        raise RankStalledError.among(inherited, f"rank {rank} did not run the block")
    stall: list[RankFailure] = []  # this rank's own stall, once its heartbeat thread posted it
    try:
        with state.inside(world), _progress_watched(channel, stall_timeout, stall):
            yield turn
    except BaseException as exc:
        if stall:  # its outcome is posted already, and the others may be gone with the store: nothing to send
            raise RankStalledError(stall, f"rank {rank} left the block after its stall") from exc
        channel.leave([_failure(rank, exc, progress.current())], [])
        raise
    if stall:
        raise RankStalledError(stall, f"rank {rank} left the block after its stall")
    failures = channel.leave([], [])
    if failures:
        raise RankStalledError.among(failures, f"rank {rank} ran the block, but other ranks failed")


@contextmanager
def _progress_watched(channel: Channel, stall_timeout: float | None, stall: list[RankFailure]) -> Iterator[None]:
    """Publish this rank's progress and watch for its stall while its body runs (where waits use the store).

    ``stall`` gets this rank's stall failure if its heartbeat thread posted one (read once the body is over).
    """
    progress.begin()  # what the body reports, and only that, is the block's (its failure carries the last of it)
    if not isinstance(channel, StoreChannel):  # collective waits (Horovod, XLA fallback): no store to publish in
        yield
        return
    deadline, from_start = _stall(stall_timeout)
    watch = None
    try:
        with watched(channel, deadline, from_start) as watch:
            yield
    finally:  # the watch ended: no stall is posted after this look
        if watch is not None and watch.stalled is not None:
            stall.append(watch.stalled)


@_users_block
def one_rank_first(
    rank: int = 0, local: bool = False, *, timeout: float | None = None, stall_timeout: float | None = None
) -> Iterator[Turn]:
    """Run the block on ``rank`` first, then on every other rank; yield whether this rank ran first.

    The arguments and the ``ValueError`` for a rank out of range are ignite's; the differences are the
    failure semantics of :func:`rank_scheduler` (an exception on the first rank reaches the others as
    :class:`~ignite_ext.distributed.RankFailedError` instead of a hang) and the yielded flag.

    Args:
        rank: the rank that runs first (a local rank with ``local=True``: then one rank per node runs first).
        local: whether ``rank`` is a local rank.
        timeout: seconds the others may wait before raising ``TimeoutError``; None waits while rank is alive.
        stall_timeout: seconds the first rank may go without progress, as for :func:`rank_scheduler`.

    Yields:
        A :class:`~ignite_ext.distributed.Turn`, truthy on the rank(s) that run first.

    Examples:
        >>> import ignite_ext.distributed as idist
        >>> with idist.one_rank_first() as download:
        ...     print("downloading" if download else "using the downloaded copy")
        downloading

    .. versionadded:: 0.1.0
    """
    yield from _scheduled(MasterFirst(rank, local), timeout, stall_timeout, "one_rank_first")
