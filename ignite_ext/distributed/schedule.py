"""The rank scheduler: run a block on some ranks first, the others after, and never deadlock.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from contextlib import contextmanager

import ignite.distributed as idist
import torch.utils.data

from ignite_ext.distributed._collective import IdistComm
from ignite_ext.distributed._status import Channel, make_channel
from ignite_ext.distributed.errors import RankFailedError, RankFailure
from ignite_ext.distributed.policies import MasterFirst, Policy, Turn, World

__all__ = ["one_rank_first", "rank_scheduler"]

_MAX_MESSAGE = 2000
# Counts the communicating schedulers this process entered; every rank enters them in the same order, so the
# count names the same block on every rank (the store keys of one block never meet another's).
_SEQUENCE = itertools.count()
# Depth of scheduled blocks this process is inside, and the world the outermost one agreed on.
_state: dict[str, object] = {"depth": 0, "world": None}


def _describe(order: object) -> str:
    name = f"{type(order).__module__}.{type(order).__qualname__}"
    return f"{name}:{order.describe()}" if isinstance(order, Policy) else f"{name}:{order!r}"


def _local_check(order: object, world: World) -> str:
    """Return an error message for this rank's arguments, or "" when they are fine."""
    if not isinstance(order, Policy):
        return f"order should be a Policy (e.g. MasterFirst(), Ordered()), but given {order!r}"
    try:
        order.validate(world)
    except ValueError as exc:
        return str(exc)
    return ""


def _entry(order: object, timeout: float | None) -> bytes:
    """This rank's entry: its place in the world, what it passed, and what is wrong with that."""
    n, npn = idist.get_world_size(), idist.get_nproc_per_node()
    rough = World(n, tuple(r // npn for r in range(n)), tuple(r % npn for r in range(n)))
    error = _local_check(order, rough)
    if not error and timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)):
        error = f"timeout should be a number of seconds or None, but given {timeout!r}"
    elif not error and timeout is not None and timeout <= 0:
        error = f"timeout should be positive, but given {timeout!r}"
    mine = {
        "node": idist.get_node_rank(),
        "local": idist.get_local_rank(),
        "args": f"{_describe(order)}|timeout={timeout!r}",
        "error": error,
    }
    return json.dumps(mine).encode()


def _judge(entries: list[bytes]) -> bytes:
    """Check every rank's entry; the verdict is the world's shape, or the error every rank will raise."""
    seen = [json.loads(e) for e in entries]
    verdict: dict[str, object] = {"nodes": [e["node"] for e in seen], "locals": [e["local"] for e in seen]}
    errors = [f"rank {r}: {e['error']}" for r, e in enumerate(seen) if e["error"]]
    groups: dict[str, list[int]] = {}
    for r, e in enumerate(seen):
        groups.setdefault(e["args"], []).append(r)
    if errors:
        verdict["error"] = "invalid rank_scheduler arguments: " + "; ".join(errors)
    elif len(groups) > 1:
        listing = "; ".join(f"ranks {ranks}: {args}" for args, ranks in groups.items())
        verdict["error"] = f"ranks passed different rank_scheduler arguments, every rank must pass the same: {listing}"
    return json.dumps(verdict).encode()


def _agree_on_entry(channel: Channel, order: object, timeout: float | None) -> World:
    """Exchange every rank's entry; raise ``ValueError`` on every rank if any is invalid or they differ."""
    verdict = json.loads(channel.exchange(_entry(order, timeout), _judge))
    if verdict.get("error"):
        raise ValueError(verdict["error"])
    return World(len(verdict["nodes"]), tuple(verdict["nodes"]), tuple(verdict["locals"]))


def _failure(rank: int, exc: BaseException) -> RankFailure:
    message = str(exc)
    if len(message) > _MAX_MESSAGE:
        message = message[:_MAX_MESSAGE] + "..."
    return RankFailure(rank, type(exc).__qualname__, message)


@contextmanager
def _run_nested(order: object) -> Iterator[Turn]:
    # The ranks inside a scheduled block are a subset of the world, so any collective here would deadlock
    # (as nested one_rank_first does in ignite and Lightning). The outer block already orders the ranks:
    # run at once and yield what the policy says of this rank. Errors here fail the outer block, safely.
    world = _state["world"]
    assert isinstance(world, World)
    error = _local_check(order, world)
    if error:
        raise ValueError(error)
    assert isinstance(order, Policy)
    if order.collective:
        raise RuntimeError(f"{order!r} communicates, so it cannot run inside another scheduled block")
    yield order.plan(world, IdistComm()).turns[idist.get_rank()]


@contextmanager
def _inside() -> Iterator[None]:
    _state["depth"] = int(str(_state["depth"])) + 1
    try:
        yield
    finally:
        _state["depth"] = int(str(_state["depth"])) - 1


@contextmanager
def rank_scheduler(order: Policy | None = None, *, timeout: float | None = None) -> Iterator[Turn]:
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
      noticed by its heartbeat stopping (``IGNITE_EXT_HEARTBEAT_TIMEOUT``, 30 s) and reported as failed.
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

    Yields:
        This rank's :class:`~ignite_ext.distributed.Turn` (truthy when it runs first).

    Raises:
        RankFailedError: another rank's block failed (or it died) and this rank waited for it or ran before it.
        ValueError: invalid or mismatched arguments, on every rank.
        TimeoutError: ``timeout`` passed while waiting.
        RuntimeError: called from a DataLoader worker.

    Examples:
        >>> import ignite_ext.distributed as idist
        >>> with idist.rank_scheduler(order=idist.Ordered()) as turn:
        ...     print(f"rank {idist.get_rank()} first={bool(turn)}")
        rank 0 first=True

    .. versionadded:: 0.1.0
    """
    if torch.utils.data.get_worker_info() is not None:
        raise RuntimeError(
            "rank_scheduler/one_rank_first cannot run in a DataLoader worker: workers are not ranks and must "
            "not take part in collectives; schedule the work in the main process (e.g. in the dataset's setup)"
        )
    order = MasterFirst() if order is None else order
    if int(str(_state["depth"])) > 0:
        with _run_nested(order) as nested_turn, _inside():
            yield nested_turn
        return
    rank, world_size = idist.get_rank(), idist.get_world_size()
    label = order.describe() if isinstance(order, Policy) else repr(order)
    # An invalid timeout is reported by the entry exchange, so that exchange must not itself obey it.
    usable = isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout > 0
    channel = make_channel(
        rank, world_size, label, timeout if usable else None, next(_SEQUENCE) if world_size > 1 else -1
    )
    world = _agree_on_entry(channel, order, timeout)
    assert isinstance(order, Policy)
    plan = order.plan(world, IdistComm())
    turn = plan.turns[rank]
    if world_size == 1:
        _state["world"] = world
        with _inside():
            yield turn
        return
    channel.start(plan)
    try:
        inherited = channel.wait_turn()
    except TimeoutError as exc:
        channel.leave([_failure(rank, exc)], [], linger=False)
        raise
    if inherited:
        channel.leave([], inherited)
        raise RankFailedError(inherited, f"rank {rank} did not run the block")
    _state["world"] = world
    try:
        with _inside():
            yield turn
    except BaseException as exc:
        channel.leave([_failure(rank, exc)], [])
        raise
    failures = channel.leave([], [])
    if failures:
        raise RankFailedError(failures, f"rank {rank} ran the block, but other ranks failed")


@contextmanager
def one_rank_first(rank: int = 0, local: bool = False, *, timeout: float | None = None) -> Iterator[Turn]:
    """Run the block on ``rank`` first, then on every other rank; yield whether this rank ran first.

    The arguments and the ``ValueError`` for a rank out of range are ignite's; the differences are the
    failure semantics of :func:`rank_scheduler` (an exception on the first rank reaches the others as
    :class:`~ignite_ext.distributed.RankFailedError` instead of a hang) and the yielded flag.

    Args:
        rank: the rank that runs first (a local rank with ``local=True``: then one rank per node runs first).
        local: whether ``rank`` is a local rank.
        timeout: seconds the others may wait before raising ``TimeoutError``; None waits while rank is alive.

    Yields:
        A :class:`~ignite_ext.distributed.Turn`, truthy on the rank(s) that run first.

    Examples:
        >>> import ignite_ext.distributed as idist
        >>> with idist.one_rank_first() as download:
        ...     print("downloading" if download else "using the downloaded copy")
        downloading

    .. versionadded:: 0.1.0
    """
    with rank_scheduler(MasterFirst(rank, local), timeout=timeout) as turn:
        yield turn
