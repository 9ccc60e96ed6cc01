"""Test bodies of the backend matrix: each runs on every rank of a world, under whatever backend idist has.

A body asserts what it can see from its own rank (a failed assertion fails that rank, and so the test) and
returns a small, picklable summary for the checks that need every rank's view. Bodies only use what every
backend offers (``idist`` collectives of small tensors and strings, files in a shared directory), so the
same body runs in serial mode, over gloo, NCCL, Horovod and XLA.

Cross-rank order is read from an event log: every rank appends ``"<rank> <node> <event>"`` lines to one file
in a directory all ranks share, with one ``O_APPEND`` write per line, so lines never interleave.
"""

from __future__ import annotations

import hashlib
import math
import os
import signal
import time
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


def _test_identity() -> dict[str, Any]:
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


def _test_master_first(workdir: str) -> dict[str, Any]:
    """MasterFirst: only the chosen rank's turn is truthy, and it finishes before any other rank starts."""
    rank, ws = idist.get_rank(), idist.get_world_size()
    flags = []
    for name, chosen in (("rank0", 0), ("last", ws - 1)):
        with idist.one_rank_first(rank=chosen) as turn:
            _log(workdir, name, "start")
            if turn:
                time.sleep(0.3)  # long enough that a rank not waiting would start meanwhile
            _log(workdir, name, "end")
        assert bool(turn) == (rank == chosen), (name, rank, bool(turn))
        assert turn.leader == chosen
        flags.append(bool(turn))
    _barrier()  # every rank has logged before any reads
    for name, chosen in (("rank0", 0), ("last", ws - 1)):
        events = _events(workdir, name)
        assert len(events) == 2 * ws, events
        first_end = events.index((chosen, chosen // idist.get_nproc_per_node(), "end"))
        for i, (r, _, e) in enumerate(events):
            if r != chosen and e == "start":
                assert i > first_end, f"{name}: rank {r} started before rank {chosen} finished: {events}"
    _barrier()
    return {"flags": flags}


def _test_master_first_local(workdir: str) -> dict[str, Any]:
    """MasterFirst(local=True): local rank 0 of each node goes first on its node; nodes do not wait for each other."""
    local, node = idist.get_local_rank(), idist.get_node_rank()
    with idist.one_rank_first(local=True) as turn:
        _log(workdir, "local", "start")
        if turn:
            time.sleep(0.3)
        _log(workdir, "local", "end")
    assert bool(turn) == (local == 0)
    assert turn.leader == node * idist.get_nproc_per_node()
    _barrier()
    events = _events(workdir, "local")
    for n in range(idist.get_nnodes()):
        leader = n * idist.get_nproc_per_node()
        mine = [(i, r, e) for i, (r, nn, e) in enumerate(events) if nn == n]
        leader_end = next(i for i, r, e in mine if r == leader and e == "end")
        assert all(i > leader_end for i, r, e in mine if r != leader and e == "start"), events
    _barrier()
    return {"first": bool(turn), "node": node}


def _test_ordered(workdir: str) -> dict[str, Any]:
    """Ordered: ranks run the block one at a time, in rank order."""
    ws = idist.get_world_size()
    with idist.rank_scheduler(order=idist.Ordered()):
        _log(workdir, "ordered", "start")
        time.sleep(0.05)
        _log(workdir, "ordered", "end")
    _barrier()
    events = [(r, e) for r, _, e in _events(workdir, "ordered")]
    assert events == [(r, e) for r in range(ws) for e in ("start", "end")], events
    _barrier()
    return {"events": len(events)}


def _test_first_rank_failure() -> dict[str, Any]:
    """The first rank raises in its block: it gets its error back, every other rank a RankFailedError."""
    rank, ws = idist.get_rank(), idist.get_world_size()
    ran = False
    outcome = "ok"
    try:
        with idist.one_rank_first():
            ran = True
            if rank == 0:
                raise OSError("disk full on rank 0")
    except OSError as exc:
        outcome = "OSError"
        assert rank == 0 and "disk full on rank 0" in str(exc)
    except idist.RankFailedError as exc:
        outcome = "RankFailedError"
        assert rank != 0, "the failing rank must get its own error back"
        assert list(exc.ranks) == [0], exc.ranks
        assert [(f.rank, f.exc_type, f.message) for f in exc.failures] == [(0, "OSError", "disk full on rank 0")]
    assert outcome == ("OSError" if rank == 0 else "RankFailedError"), outcome
    assert ran == (rank == 0), "a waiting rank ran the block after the first rank failed"
    # The world is still usable afterwards: nothing was left half-way through a collective.
    assert _world_sum(1) == ws
    return {"outcome": outcome, "ran": ran}


# ----------------------------------------------------------------------------------------------- data


def _test_download_in_one_rank_first(workdir: str, url: str, sha256: str) -> dict[str, Any]:
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


def _test_sampler_defaults(n: int) -> dict[str, Any]:
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


def _test_cache_stats_reduction() -> dict[str, Any]:
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


def _test_long_first_rank(seconds: float, timeout: float | None) -> dict[str, Any]:
    """The first rank works ``seconds`` inside one_rank_first(timeout=timeout); report what each rank saw."""
    outcome, ran = "ok", False
    start = time.monotonic()
    try:
        with idist.one_rank_first(timeout=timeout) as turn:
            ran = True
            if turn:
                time.sleep(seconds)
    except TimeoutError:
        outcome = "TimeoutError"
    except idist.RankFailedError:
        outcome = "RankFailedError"
    waited = time.monotonic() - start
    # Only after a clean run is the world known to be in step for one more collective.
    total = _world_sum(1) if outcome == "ok" else None
    return {"outcome": outcome, "ran": ran, "waited": waited, "sum": total}


def _test_first_rank_killed() -> dict[str, Any]:
    """Rank 1 runs first and is SIGKILLed inside the block; report what the ranks waiting for it saw."""
    outcome, ran, message = "ok", False, ""
    try:
        with idist.one_rank_first(rank=1) as turn:
            ran = True
            if turn:
                os.kill(os.getpid(), signal.SIGKILL)
    except idist.RankFailedError as exc:
        outcome, message = "RankFailedError", str(exc)
    return {"outcome": outcome, "ran": ran, "message": message}
