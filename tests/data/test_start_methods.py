"""Every feature with DataLoader workers not started by fork: ``forkserver`` and ``spawn`` (Python 3.14's default).

Such a worker inherits nothing from its rank: it imports the package anew and receives the dataset pickled. The
node cache must still be one per node (its ranks' workers attach to it by name), survive persistent workers, a
warm restart and a SIGTERM as with forked workers, serve what the rank loaded ahead, and a worker's progress reports
must reach its rank's board (the scheduler's waiting ranks read it there).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import pytest
import torch
from torch.utils.data import DataLoader

from ignite_ext.data import CachedDataset, ShardedDistributedSampler
from ignite_ext.data.sampler.mixing import mixed_shards
from tests._world import World
from tests.data.test_cache import ROOT, CountingDataset, fingerprint_loads
from tests.data.test_cache_disk import _arenas
from tests.data.test_cache_follow import node_epochs
from tests.data.test_cache_users import STEP_TIMEOUT_S, _first_line

pytestmark = pytest.mark.distributed

CONTEXTS = ["forkserver", "spawn"]

#: torch's workers check their parent every 5 s (``MP_STATUS_CHECK_INTERVAL``); a worker's start under load (a torch
#: import) has taken over 10 s here: an orphan is one alive after a dozen checks.
ORPHAN_BOUND_S = 12 * 5.0


def _here(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a script outside the repository that imports this checkout's package, however it is installed."""
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)}


# A DataLoader worker reports progress; the process that started it reads its board. "forkserver-preloaded": the
# fork server imported the package before forking the worker (its own board, which the worker inherits).
PROGRESS = """
import multiprocessing, sys
from torch.utils.data import DataLoader, get_worker_info
from ignite_ext import progress

class Reporting:
    def __len__(self):
        return 8
    def __getitem__(self, i):
        assert get_worker_info() is not None
        progress.report(i + 1, total=100, what="decoding in a worker")
        return i

if __name__ == "__main__":
    context = sys.argv[1].split("-")[0]
    if sys.argv[1].endswith("preloaded"):
        multiprocessing.get_context("forkserver").set_forkserver_preload(["ignite_ext.progress"])
    progress.begin()
    loader = DataLoader(Reporting(), batch_size=None, num_workers=1, multiprocessing_context=context)
    assert list(loader) == list(range(8))
    print(progress.current())
"""


@pytest.mark.parametrize("context", ["fork", "forkserver", "forkserver-preloaded", "spawn"])
def test_progress_reported_in_a_worker_reaches_its_rank(tmp_path: Path, context: str) -> None:
    script = tmp_path / "reporting.py"
    script.write_text(textwrap.dedent(PROGRESS))
    done = subprocess.run([sys.executable, str(script), context], cwd=ROOT, env=_here(dict(os.environ)),
                          capture_output=True, text=True, timeout=STEP_TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("decoding in a worker: 8 of 100 (8 %)"), done.stdout + done.stderr


def _node_cache_through(context: str, base: CountingDataset, epochs: int) -> dict[str, Any]:
    """Two ranks of one node, each with two persistent workers started by ``context``, over one node cache."""
    mp.current_process().daemon = False  # DataLoader workers are children of the (daemonic) rank
    ds = CachedDataset(base, scope="node", capacity_bytes=4 << 20)  # type: ignore[arg-type]
    sampler = torch.utils.data.DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, multiprocessing_context=context,
                        persistent_workers=True)  # fmt: skip
    read = node_epochs(ds, sampler, loader, epochs)
    rows, now = [(d.hits, d.misses) for d, _ in read], read[-1][1]
    segment = ds.segment
    del loader  # the workers end; they must not have deleted the node's cache
    idist.barrier()
    kept = os.path.exists(segment)
    idist.barrier()
    ds.close()
    idist.barrier()
    return {"rows": rows, "kept": kept, "gone": not os.path.exists(segment), "entries": now.entries}


@pytest.mark.parametrize("context", CONTEXTS)
def test_the_node_cache_is_one_for_the_workers_of_every_rank(world: World, context: str) -> None:
    n, epochs = 32, 3
    base = CountingDataset(n, context="forkserver")
    out = world(_node_cache_through, context, base, epochs, nprocs=2, nproc_per_node=2, deadline=180)
    # Each sample loaded once for the node (less the fingerprint reads at construction), then only hits.
    assert [a - b for a, b in zip(base.loads(), fingerprint_loads(n, 2), strict=True)] == [1] * n
    for r in out:
        assert r["rows"] == [(0, n)] + [(n, 0)] * (epochs - 1), r
        assert r["kept"] and r["gone"] and r["entries"] == n, r


def _holders(directory: Path) -> list[int]:
    """The pids of the processes that hold a file under ``directory`` open, deleted ones too."""
    held = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            fds = os.listdir(f"/proc/{entry}/fd")
            if any(os.readlink(f"/proc/{entry}/fd/{fd}").startswith(str(directory)) for fd in fds):
                held.append(int(entry))
    return held


def test_a_warm_restart_with_spawned_workers_reads_nothing_from_storage(world: World, tmp_path: Path) -> None:
    from tests.data import test_cache_restart

    try:
        test_cache_restart.test_a_restarted_worker_group_reads_nothing_from_storage_in_its_first_epoch(
            world, tmp_path, context="spawn"
        )
        # The first attempt's workers end with their SIGKILLed ranks (one was once seen alive 15 minutes on, holding
        # the deleted disk tier: a rank killed while its worker started).
        deadline = time.monotonic() + ORPHAN_BOUND_S
        while _holders(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _holders(tmp_path) == []
    finally:
        for pid in _holders(tmp_path):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_loading_ahead_serves_spawned_workers() -> None:
    n, shards, epochs, mix = 400, 4, 3, 0.25
    base = CountingDataset(n, context="spawn")
    ds = CachedDataset(base, capacity_bytes=16 << 20)  # type: ignore[arg-type]
    try:
        sampler = ShardedDistributedSampler(ds, num_replicas=shards, rank=1, seed=4, mix=mix, load_ahead=True)
        loader = DataLoader(ds, batch_size=8, sampler=sampler, num_workers=2, multiprocessing_context="spawn",
                            persistent_workers=True)  # fmt: skip
        pools = [set(mixed_shards(n, shards, 4, e, mix)[1]) for e in range(epochs)]
        for e in range(epochs):
            sampler.set_epoch(e)
            before = ds.stats()
            seen = [i for batch in loader for i in batch["i"].tolist()]
            assert set(seen) == pools[e]
            assert ds._loading is not None and ds._loading.join(60)  # the next epoch's arrivals are in
            now = ds.stats() - before
            if e > 0:  # every arrival was loaded ahead by the rank: the workers only hit
                assert (now.hits, now.misses) == (len(pools[e]), 0), now
        del loader
    finally:
        ds.close()


# A rank whose persistent spawned worker has attached to its cache (RAM and disk tiers) waits for SIGTERM.
RANK = """
import os, sys, time
from torch.utils.data import DataLoader
from ignite_ext.data import CachedDataset

class Source:
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return bytes([65 + i]) * 5000

if __name__ == "__main__":
    ds = CachedDataset(Source(), capacity_bytes=12000, disk_dir=sys.argv[1], disk_bytes=1 << 20)
    loader = DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context=sys.argv[2],
                        persistent_workers=True)
    got = list(loader)  # the worker loads and stores every sample: both tiers
    assert got == [bytes([65 + i]) * 5000 for i in range(8)]
    it = iter(loader)  # the worker lives on
    print("ready", ds.segment, ds.disk_segment, ds.stats(reduce="world").entries, flush=True)
    time.sleep(10 * 60)
"""


@pytest.mark.parametrize("restart_left", [False, True], ids=["last-attempt", "restart-left"])
def test_a_sigtermed_rank_with_spawned_workers_follows_the_cleanup_rule(tmp_path: Path, restart_left: bool) -> None:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK))
    disk_dir = tmp_path / "disk"
    disk_dir.mkdir()
    env = _here({k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")})
    env.update(TORCHELASTIC_RUN_ID=f"term-{uuid.uuid4().hex}", TORCHELASTIC_RESTART_COUNT="0",
               TORCHELASTIC_MAX_RESTARTS="1" if restart_left else "0")  # fmt: skip
    proc = subprocess.Popen([sys.executable, str(script), str(disk_dir), "spawn"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = _first_line(proc, STEP_TIMEOUT_S)
        assert line.startswith("ready "), proc.stderr.read() if proc.poll() is not None and proc.stderr else line
        _, ram, disk, entries = line.split()
        assert entries == "8"  # stored by the spawned worker, counted by the rank
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=STEP_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        out, err = proc.communicate(timeout=STEP_TIMEOUT_S)
    assert proc.returncode == -signal.SIGTERM, out + err
    left = [f for f in (ram, disk) if os.path.exists(f)]
    if restart_left:
        assert left == [ram, disk], out + err  # kept for the restart
        for f in left:
            os.unlink(f)
        for lock in (f[: -len(".arena")] + ".lock" for f in (ram, disk)):
            if os.path.exists(lock):
                os.unlink(lock)
    else:
        assert left == [] and _arenas(disk_dir) == [], (left, out + err)


# A rank SIGKILLed while its worker is still starting (unpickling the dataset: made slow here, as a torch import under
# load is; a spawned worker's loop then begins with init or a subreaper as its parent, which torch's watch takes for
# the rank), or once its worker serves (a forkserver worker's parent is the fork server, which the worker itself
# keeps alive: torch's watch never sees the rank die).
RANK_DIES = """
import os, signal, sys, time
from torch.utils.data import DataLoader
from ignite_ext.data import CachedDataset

class SlowToUnpickle:
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return bytes([65 + i]) * 100
    def __setstate__(self, state):
        time.sleep(2)
        self.__dict__.update(state)

if __name__ == "__main__":
    ds = CachedDataset(SlowToUnpickle(), capacity_bytes=1 << 16)
    ds[0]
    it = iter(DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context=sys.argv[1]))
    if sys.argv[2] == "serving":
        assert next(it) == b"A" * 100
    print(*(w.pid for w in it._workers), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("phase", ["starting", "serving"])
@pytest.mark.parametrize("context", CONTEXTS)
def test_a_worker_whose_rank_was_killed_ends(tmp_path: Path, context: str, phase: str) -> None:
    import psutil

    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK_DIES))
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("w") as stdout, err.open("w") as stderr:  # files: a live worker would hold the rank's pipes open
        proc = subprocess.run([sys.executable, str(script), context, phase], cwd=ROOT, env=_here(dict(os.environ)),
                              stdout=stdout, stderr=stderr, timeout=STEP_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, out.read_text() + err.read_text()
    workers = [psutil.Process(int(pid)) for pid in out.read_text().split()]
    assert len(workers) == 1
    try:
        _, alive = psutil.wait_procs(workers, timeout=ORPHAN_BOUND_S)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], "the worker outlived its rank"
    finally:
        for p in workers:
            with contextlib.suppress(psutil.Error):
                p.kill()
