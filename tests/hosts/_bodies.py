"""Bodies run on every rank of a simulated-host job (through ``tests.hosts._rank``); each returns JSON-able data.

Times are ``time.monotonic()``: the simulated hosts share this machine's clock, so the test compares them with
its own (when it killed a host, say). Paths under ``/tmp`` and ``/dev/shm`` are the rank's host's own; the
shared directory is where the rank's host sees it (the parent of the job's directory).
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

import ignite_ext.distributed as idist
from ignite_ext.data import CachedDataset, ShardedDistributedSampler, download_for_job, download_url
from tests._staggered import join_in_order
from tests.backends._bodies import identity
from tests.distributed.torchrun_body import scenario, scenarios
from tests.hosts._rank import mark, out_dir

__all__ = ["census", "fetch_for_job", "wait_on"]

HOST_LOCAL = Path("/tmp/ignite_ext_bed")  # the same path on every host, a directory of each host's own


def _where() -> dict[str, Any]:
    return {
        **identity(),
        "hostname": socket.gethostname(),
        "tmp_dev": os.stat("/tmp").st_dev,
        "shm_dev": os.stat("/dev/shm").st_dev,
    }


def _download(url: str, root: Path, sha256: str) -> str:
    idist.barrier()  # every rank of every host calls at once
    path = download_url(url, root, sha256=sha256, progress=False)
    return hashlib.sha256(path.read_bytes()).hexdigest()


class _LoggedLoads(Dataset[torch.Tensor]):
    """``n`` small tensors; each load appends its index to ``log`` (a file of the rank's host's own ``/tmp``)."""

    def __init__(self, n: int, log: Path) -> None:
        self.n, self.log = n, log

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)  # one write per line: no interleaving
        try:
            os.write(fd, b"%d\n" % index)
        finally:
            os.close(fd)
        return torch.full((256,), float(index))


def _cache(n: int) -> dict[str, Any]:
    log = HOST_LOCAL / "loads.log"
    ds = CachedDataset(_LoggedLoads(n, log), scope="node")
    # Every rank's fingerprint reads (first, middle, last) are logged once the construction returns on any rank
    # (it agrees after them); the barrier keeps every rank's reads through the cache out of this count.
    constructing = len(log.read_text().split()) if log.exists() else 0
    idist.barrier()
    sampler = ShardedDistributedSampler(ds, shard_by="node")
    read = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        read.append(list(sampler))
        for i in read[-1]:
            ds[i]
        idist.barrier()  # the node's cache holds its whole shard before the next epoch reads it
    stats = ds.stats(reduce="node")
    logged = [int(line) for line in log.read_text().split()]
    seen = {
        "read": read,
        "fingerprint_loads": logged[:constructing],
        "loads": logged[constructing:],
        "segment": ds.segment,
        "arenas": sorted(name for name in os.listdir("/dev/shm") if name.endswith(".arena")),
        "node_stats": [stats.hits, stats.misses, stats.entries],
    }
    idist.barrier()  # the node's creator deletes the arena only once every rank has looked at it
    ds.close()
    return seen


def census(local_url: str, shared_url: str, sha256: str, n: int) -> dict[str, Any]:
    """Every scheduling policy once, the downloads, the node cache; see tests/hosts/test_census.py."""
    HOST_LOCAL.mkdir(exist_ok=True)
    shared = out_dir().parent
    return {
        **_where(),
        **scenarios(HOST_LOCAL, shared),
        "download_local": _download(local_url, HOST_LOCAL / "dl", sha256),
        "download_shared": _download(shared_url, shared / "dl", sha256),
        "cache": _cache(n),
    }


def _attempt(make_cm: Callable[[], Any], block: Callable[[Any], None]) -> dict[str, Any]:
    seen: dict[str, Any] = {"rank": idist.get_rank(), "ran": False, "error": None}
    try:
        with make_cm() as turn:
            seen["ran"] = True
            block(turn)
    except Exception as exc:
        seen.update(error=type(exc).__name__, message=str(exc))
        seen.update(ranks=list(getattr(exc, "ranks", ())), dead=list(getattr(exc, "dead", ())))
    seen["raised"] = time.monotonic()
    return seen


def wait_on(first: int, block_s: float) -> dict[str, Any]:
    """Every rank waits in ``one_rank_first(first)`` while ``first`` works ``block_s``; then a gloo barrier.

    Marks: ``entering`` just before the block, ``inside`` on ``first`` once it runs. The barrier tells how long
    the process group takes to give up on ranks that are gone.
    """
    with idist.one_rank_first():  # from here on every rank beats a heartbeat: a death can be told from a delay
        pass

    def block(turn: Any) -> None:
        if turn:
            mark("inside")
            time.sleep(block_s)

    mark("entering")
    seen = _attempt(lambda: idist.one_rank_first(first), block)
    start = time.monotonic()
    try:
        idist.barrier()
        seen["barrier"] = None
    except Exception as exc:
        seen["barrier"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    seen["barrier_s"] = time.monotonic() - start
    return seen


def over_remote(root: str, url: str, sha256: str) -> dict[str, Any]:
    """SharedPath's census and concurrent downloads in ``root``, a directory every host mounts over the network."""
    path = Path(root)
    return {
        "census": scenario(
            lambda: idist.rank_scheduler(order=idist.SharedPath(path / "data")), path / "data" / "probe"
        ),
        "download": _download(url, path / "dl", sha256),
    }


def fetch_for_job(url: str, sha256: str | None, stagger: float) -> dict[str, Any]:
    """``download_for_job`` into the host's own ``/tmp``; holders join in host order when ``stagger`` is set.

    Marks ``joined`` once this rank is in the chain; returns whether it got a copy, and that copy's SHA-256 (also
    when the job raised because another host was lost).
    """
    if stagger:
        join_in_order(idist.get_node_rank(), stagger, then=lambda: mark("joined"))
    root = HOST_LOCAL / "relayed"
    mark("entering")
    try:
        path = download_for_job(url, root, sha256=sha256, progress=False)
        return {"ok": True, "sha": hashlib.sha256(path.read_bytes()).hexdigest(), "done": time.monotonic()}
    except Exception as exc:
        copy = root / "data.bin"
        sha = hashlib.sha256(copy.read_bytes()).hexdigest() if copy.exists() else None
        return {"ok": False, "type": type(exc).__name__, "message": str(exc), "sha": sha, "done": time.monotonic()}
