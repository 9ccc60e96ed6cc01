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

from ignite_ext.distributed._collective import IdistComm, all_gather_bytes, all_gather_rows, fingerprint
from ignite_ext.distributed._status import make_channel
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


def _agree_on_entry(order: object, timeout: float | None) -> World:
    """One collective: every rank's node and local rank, argument checks and policy fingerprint.

    Raises ``ValueError`` on every rank when any rank's arguments are invalid or differ from the others'.
    """
    rough = World(
        idist.get_world_size(),
        tuple(r // idist.get_nproc_per_node() for r in range(idist.get_world_size())),
        tuple(r % idist.get_nproc_per_node() for r in range(idist.get_world_size())),
    )
    error = _local_check(order, rough)
    if not error and timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)):
        error = f"timeout should be a number of seconds or None, but given {timeout!r}"
    elif not error and timeout is not None and timeout <= 0:
        error = f"timeout should be positive, but given {timeout!r}"
    description = f"{_describe(order)}|timeout={timeout!r}"
    row = [int(not error), *fingerprint(description), idist.get_node_rank(), idist.get_local_rank()]
    rows = all_gather_rows(row)
    world = World(len(rows), tuple(r[5] for r in rows), tuple(r[6] for r in rows))
    if all(r[0] for r in rows) and all(r[1:5] == rows[0][1:5] for r in rows):
        return world
    # Rare path, so it may cost a second collective: tell every rank what every rank passed.
    blobs = all_gather_bytes(json.dumps([description, error]).encode())
    seen = [json.loads(b) for b in blobs]
    errors = [f"rank {r}: {err}" for r, (_, err) in enumerate(seen) if err]
    if errors:
        raise ValueError("invalid rank_scheduler arguments: " + "; ".join(errors))
    groups: dict[str, list[int]] = {}
    for r, (desc, _) in enumerate(seen):
        groups.setdefault(desc, []).append(r)
    listing = "; ".join(f"ranks {ranks}: {desc}" for desc, ranks in groups.items())
    raise ValueError(f"ranks passed different rank_scheduler arguments, every rank must pass the same: {listing}")


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
      On Horovod and XLA, waits are collectives: bounded by the backend's timeout, ``timeout`` is not enforced.
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
    rank = idist.get_rank()
    world = _agree_on_entry(order, timeout)
    assert isinstance(order, Policy)
    plan = order.plan(world, IdistComm())
    turn = plan.turns[rank]
    if world.world_size == 1:
        _state["world"] = world
        with _inside():
            yield turn
        return
    channel = make_channel(plan, rank, order.describe(), timeout, next(_SEQUENCE))
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
