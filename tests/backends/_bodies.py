"""Test bodies shared by the backend matrix (``tests/backends``) and the scheduler tests.

Each body runs on every rank of a world (``world(_bodies.master_first, ...)``), under whatever backend idist
has. A body asserts what it can see from its own rank (a failed assertion fails that rank, and so the test) and
returns a small, picklable summary for the checks that need every rank's view. Bodies only use what every
backend offers (``idist`` collectives of small tensors and strings, files in a shared directory), so the
same body runs in serial mode, over gloo (store or collective scheduler channel), NCCL, Horovod and XLA.

Cross-rank order is read from an event log: every rank appends ``"<rank> <node> <event>"`` lines to one file
in a directory all ranks share, with one ``O_APPEND`` write per line, so lines never interleave.
"""

from __future__ import annotations

import hashlib
import math
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import ignite_ext.distributed as idist
from ignite_ext.data import CachedDataset, ShardedDistributedSampler, download_url


def _barrier() -> None:
    # ignite's barrier does not name a device on NCCL, which then guesses one per rank (and can hang when the
    # guess is wrong); name the current device as ignite itself does for its initial barrier.
    if idist.backend() == "nccl":
        torch.distributed.barrier(device_ids=[torch.cuda.current_device()])
    else:
        idist.barrier()


def _log(workdir: str, name: str, event: str) -> None:
    line = f"{idist.get_rank()} {idist.get_node_rank()} {event}\n".encode()
    fd = os.open(os.path.join(workdir, f"{name}.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _events(workdir: str, name: str) -> list[tuple[int, int, str]]:
    lines = Path(workdir, f"{name}.log").read_text().splitlines()
    return [(int(r), int(n), e) for r, n, e in (line.split() for line in lines)]


def _world_sum(value: int) -> int:
    # Small integers only: XLA reduces in float32.
    return int(idist.all_reduce(torch.tensor([value], device=idist.device())).item())


def identity() -> dict[str, Any]:
    """What idist reports on this rank: the tests check that each world really runs on its backend."""
    return {
        "backend": idist.backend(),
        "rank": idist.get_rank(),
        "world_size": idist.get_world_size(),
        "local_rank": idist.get_local_rank(),
        "node_rank": idist.get_node_rank(),
        "nnodes": idist.get_nnodes(),
    }


# ----------------------------------------------------------------------------------------------- scheduling


def observe(
    block: Callable[[Any], Any],
    make_cm: Callable[[], Any],
    catch: tuple[type[BaseException], ...] = (Exception,),
) -> dict[str, Any]:
    """Enter the scheduler, run ``block(turn)`` inside; report what happened on this rank.

    An exception of ``catch`` (from the scheduler or the block) becomes the reported ``outcome``; any other one
    fails the rank. Times are ``time.monotonic()``, comparable across the ranks of one machine.
    """
    seen: dict[str, Any] = {"rank": idist.get_rank(), "node": idist.get_node_rank(), "ran": False}
    seen["entered"] = time.monotonic()
    try:
        with make_cm() as turn:
            seen["first"] = bool(turn)
            seen["leader"] = turn.leader
            seen["ran"] = True
            seen["start"] = time.monotonic()
            try:
                block(turn)
            finally:
                seen["end"] = time.monotonic()
        seen["outcome"] = "ok"
    except catch as exc:
        if isinstance(exc, idist.RankFailedError):
            seen.update(outcome="RankFailedError", ranks=list(exc.ranks), message=str(exc))
            seen["failures"] = [(f.rank, f.exc_type, f.message) for f in exc.failures]
            seen["where"] = [f.where for f in exc.failures]
        else:
            seen.update(outcome=type(exc).__name__, message=str(exc))
    seen["left"] = time.monotonic()
    return seen


def _logged_turn(workdir: str, name: str, chosen: int, local: bool) -> dict[str, Any]:
    def block(turn: Any) -> None:
        _log(workdir, name, "start")
        if turn:
            time.sleep(0.3)  # long enough that a rank not waiting would start meanwhile
        _log(workdir, name, "end")

    return observe(block, lambda: idist.one_rank_first(chosen, local))


def master_first(workdir: str, turns: list[tuple[int, bool]]) -> list[dict[str, Any]]:
    """``one_rank_first(rank, local)`` once per turn: only the chosen rank of each group (the world, or each node
    with ``local=True``) has a truthy turn, and it finishes before any other rank of its group starts.

    Checked on every rank from the event log in ``workdir`` (created if missing; one directory per call);
    returns this rank's :func:`observe` report of every turn.
    """
    Path(workdir).mkdir(parents=True, exist_ok=True)
    rank, ws = idist.get_rank(), idist.get_world_size()
    npn, node = idist.get_nproc_per_node(), idist.get_node_rank()
    seen = []
    for i, (chosen, local) in enumerate(turns):
        turn = _logged_turn(workdir, f"turn{i}", chosen, local)
        leader = node * npn + chosen if local else chosen
        assert turn["outcome"] == "ok", turn
        assert turn["first"] == (rank == leader), (i, rank, turn["first"])
        assert turn["leader"] == leader, (i, rank, turn["leader"])
        seen.append(turn)
    _barrier()  # every rank has logged before any reads
    for i, (chosen, local) in enumerate(turns):
        events = _events(workdir, f"turn{i}")
        assert len(events) == 2 * ws, events
        groups = [range(n * npn, (n + 1) * npn) for n in range(idist.get_nnodes())] if local else [range(ws)]
        for group in groups:
            leader = group[0] + chosen if local else chosen
            mine = [(k, r, e) for k, (r, _, e) in enumerate(events) if r in group]
            leader_end = next(k for k, r, e in mine if r == leader and e == "end")
            for k, r, e in mine:
                if r != leader and e == "start":
                    assert k > leader_end, f"turn {i}: rank {r} started before rank {leader} finished: {events}"
    _barrier()
    return seen


def ordered(workdir: str, local: bool = False) -> dict[str, Any]:
    """``Ordered(local=local)``: ranks run the block one at a time, in rank order (within each node when local).

    Checked on every rank from the event log in ``workdir`` (created if missing); returns this rank's
    :func:`observe` report with the number of logged events.
    """
    Path(workdir).mkdir(parents=True, exist_ok=True)
    ws, npn = idist.get_world_size(), idist.get_nproc_per_node()

    def block(turn: Any) -> None:
        _log(workdir, "ordered", "start")
        time.sleep(0.1)
        _log(workdir, "ordered", "end")

    seen = observe(block, lambda: idist.rank_scheduler(order=idist.Ordered(local=local)))
    assert seen["outcome"] == "ok", seen
    _barrier()
    events = _events(workdir, "ordered")
    groups = [range(n * npn, (n + 1) * npn) for n in range(idist.get_nnodes())] if local else [range(ws)]
    for group in groups:
        mine = [(r, e) for r, _, e in events if r in group]
        assert mine == [(r, e) for r in group for e in ("start", "end")], events
    _barrier()
    seen["events"] = len(events)
    return seen


def _raise_on(rank: int) -> Callable[[Any], None]:
    def block(turn: Any) -> None:
        time.sleep(0.1)
        if idist.get_rank() == rank:
            raise OSError(f"disk full on rank {rank}")

    return block


def fail(policy: str, failing: int) -> dict[str, Any]:
    """Rank ``failing`` raises ``OSError`` in its block (``policy``: ``"master"`` or ``"ordered"``).

    Returns this rank's :func:`observe` report, and the sum of a collective afterwards: the world is still usable,
    nothing was left half-way through a collective.
    """
    order = idist.MasterFirst() if policy == "master" else idist.Ordered()
    seen = observe(_raise_on(failing), lambda: idist.rank_scheduler(order=order))
    seen["sum"] = _world_sum(1)
    return seen


# ----------------------------------------------------------------------------------------------- data


def download_in_one_rank_first(workdir: str, url: str, sha256: str) -> dict[str, Any]:
    """download_url inside one_rank_first: the first rank fetches, the others find the published file."""
    root = Path(workdir, "data")
    dest = root / url.rsplit("/", 1)[-1]
    with idist.one_rank_first() as turn:
        existed = dest.exists()
        path = download_url(url, root, sha256=sha256, progress=False)
    assert path == dest
    assert existed != bool(turn), "only the first rank may find the file missing"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == sha256
    st = path.stat()
    # The same inode everywhere: published by one atomic rename, never replaced by a later rank.
    ident = f"{st.st_ino}:{st.st_mtime_ns}"
    gathered = idist.all_gather(ident)
    idents = gathered if isinstance(gathered, list) else [gathered]
    assert set(idents) == {ident}, idents
    return {"first": bool(turn), "existed": existed, "ident": ident, "files": sorted(os.listdir(root))}


def sampler_defaults(n: int) -> dict[str, Any]:
    """ShardedDistributedSampler(ds) takes the world size and rank (and node layout) from idist."""
    ws, rank = idist.get_world_size(), idist.get_rank()
    ds = list(range(n))
    sampler = ShardedDistributedSampler(ds)
    assert (sampler.num_replicas, sampler.rank) == (ws, rank)
    indices = list(sampler)
    assert len(indices) == len(sampler) == math.ceil(n / ws)
    gathered = idist.all_gather(torch.tensor(indices, device=idist.device()))
    assert isinstance(gathered, torch.Tensor)
    assert {int(v) for v in gathered.cpu().tolist()} == set(range(n)), "the shards do not cover the dataset"
    by_node = ShardedDistributedSampler(ds, shard_by="node")
    assert (by_node.nnodes, by_node.node_rank) == (idist.get_nnodes(), idist.get_node_rank())
    assert (by_node.nproc_per_node, by_node.local_rank) == (idist.get_nproc_per_node(), idist.get_local_rank())
    return {"num_replicas": sampler.num_replicas, "rank": sampler.rank, "node_rank": by_node.node_rank}


def cache_stats_reduction() -> dict[str, Any]:
    """CachedDataset.stats(reduce=...) sums every rank's counters (world) or its node's (node)."""
    ws, rank = idist.get_world_size(), idist.get_rank()
    npn, node = idist.get_nproc_per_node(), idist.get_node_rank()
    ds = CachedDataset([torch.full((4,), float(i)) for i in range(16)], capacity_bytes=1 << 20)
    try:
        for i in range(rank + 1):  # rank r: r + 1 misses, then r + 1 hits
            assert torch.equal(ds[i], torch.full((4,), float(i)))
            assert torch.equal(ds[i], torch.full((4,), float(i)))
        own = ds.stats()
        assert (own.hits, own.misses, own.entries) == (rank + 1, rank + 1, rank + 1), own
        world = ds.stats(reduce="world")
        total = ws * (ws + 1) // 2
        assert (world.hits, world.misses, world.entries) == (total, total, total), world
        assert world.bytes == total * (own.bytes // own.entries), world
        node_stats = ds.stats(reduce="node")
        on_node = sum(r + 1 for r in range(node * npn, (node + 1) * npn))
        assert (node_stats.hits, node_stats.misses) == (on_node, on_node), node_stats
    finally:
        ds.close()
    return {"world_hits": world.hits, "node_hits": node_stats.hits}


# ----------------------------------------------------------------------------------------------- waiting


def long_first_rank(seconds: float, timeout: float | None = None) -> dict[str, Any]:
    """The first rank works ``seconds`` inside ``one_rank_first(timeout=timeout)``; report what each rank saw.

    ``waited`` is the time from entering the scheduler to leaving it; ``sum`` (after a clean run only: only then
    is the world known to be in step for one more collective) shows that no collective timed out underneath.
    """

    def block(turn: Any) -> None:
        if turn:
            time.sleep(seconds)

    catch = (TimeoutError, idist.RankFailedError)
    seen = observe(block, lambda: idist.one_rank_first(timeout=timeout), catch=catch)
    seen["waited"] = seen["left"] - seen["entered"]
    seen["sum"] = _world_sum(1) if seen["outcome"] == "ok" else None
    return seen


def killed(victim: int) -> dict[str, Any]:
    """Rank ``victim`` runs first and is SIGKILLed inside the block; report what the ranks waiting for it saw.

    Only a ``RankFailedError`` becomes a reported outcome: any other error (e.g. Horovod's own) fails the rank.
    """

    def block(turn: Any) -> None:
        if idist.get_rank() == victim:
            os.kill(os.getpid(), signal.SIGKILL)

    return observe(block, lambda: idist.one_rank_first(rank=victim), catch=(idist.RankFailedError,))


def stopped(victim: int, seconds: float) -> dict[str, Any]:
    """Like :func:`killed`, but ``victim`` stops (SIGSTOP: hung, alive to any launcher), killed ``seconds`` later."""

    def block(turn: Any) -> None:
        if idist.get_rank() == victim:
            subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -9 {os.getpid()}"], start_new_session=True)
            os.kill(os.getpid(), signal.SIGSTOP)

    return observe(block, lambda: idist.one_rank_first(rank=victim), catch=(idist.RankFailedError,))


def channel_in_use(seconds: float, timeout: float) -> dict[str, Any]:
    """:func:`long_first_rank`, plus the scheduler's log lines of this rank (they say which channel ran)."""
    import logging

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("ignite_ext.distributed")
    handler = Keep()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        seen = long_first_rank(seconds, timeout)
    finally:
        logger.removeHandler(handler)
    seen["log"] = lines
    return seen
