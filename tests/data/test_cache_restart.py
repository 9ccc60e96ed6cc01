"""Warm restarts within a job: a restarted worker group adopts the caches its attempt before left on the node.

The tests play torchrun's agent (torchrun's own restart of a gloo group does not re-form on this machine with torch
2.13, CPU: the restarted ranks hang or fail in gloo's ``connectFullMesh``). Like the agent, each attempt starts new
processes with the job's ``TORCHELASTIC_RUN_ID`` and the next ``TORCHELASTIC_RESTART_COUNT``, all children of the
same process (here the test's forkserver, or the test itself), and when a rank dies the agent SIGKILLs the rest of
the group before it restarts it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import pytest
from torch.utils.data import DataLoader

from ignite_ext.data import CachedDataset, ShardedDistributedSampler
from ignite_ext.data.cache import shm
from ignite_ext.data.cache._life import _stamps
from ignite_ext.data.cache._mapping import ENTRY_WORDS, HEADER_BYTES
from ignite_ext.data.cache.arena import Arena
from ignite_ext.data.cache.restart import NO_JOB, job_key
from tests._world import World
from tests.data.test_cache import ROOT, CountingDataset, epoch, fingerprint_loads
from tests.data.test_cache_disk import DISK_CAP, IN_RAM, RAM_CAP, N, _arenas
from tests.data.test_cache_users import STEP_TIMEOUT_S, _first_line

pytestmark = pytest.mark.distributed


def _agent(procs: list[Any]) -> None:
    """As torchrun's agent: once a rank has died, SIGKILL the others (a thread of the test, until all have ended)."""

    def watch() -> None:
        while any(p.exitcode is None for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    if p.exitcode is None:
                        os.kill(p.pid, signal.SIGKILL)
                return
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()


def _attempt(base: CountingDataset, disk_dir: str, die_after: int | None, context: str = "fork") -> dict[str, Any]:
    """One attempt of the job: a node cache, one epoch read by both ranks; with ``die_after``, rank 1 is SIGKILLed
    after that many batches of a second epoch (its node's cache full from the first one). The DataLoader's workers
    are started by ``context``."""
    mp.current_process().daemon = False  # DataLoader workers are children of the (daemonic) rank
    ds = CachedDataset(base, scope="node", capacity_bytes=RAM_CAP, disk_dir=disk_dir, disk_bytes=DISK_CAP)
    sampler = ShardedDistributedSampler(ds, shard_by="node")
    workers = 2 if context == "fork" else 1  # a spawned worker imports torch anew: seconds apiece here
    dl = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=workers, multiprocessing_context=context)
    idist.barrier()
    loads, start = sum(base.loads()), ds.stats(reduce="node")
    sampler.set_epoch(0)
    seen = sorted(epoch(dl))
    idist.barrier()  # every load of the node is published
    out = {
        "first": ds.stats(reduce="node") - start,
        "loads": sum(base.loads()) - loads,  # by both ranks and their workers in the first epoch
        "seen": seen,
        "segments": (ds.segment, ds.disk_segment),
        "entries": ds.stats(reduce="node").entries,
    }
    if die_after is not None:
        sampler.set_epoch(1)
        for i, _ in enumerate(dl):
            if idist.get_rank() == 1 and i == die_after:
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # rank 0: the agent ends it once rank 1 is dead
    idist.barrier()
    ds.close()
    return out


def test_a_restarted_worker_group_reads_nothing_from_storage_in_its_first_epoch(
    world: World, tmp_path: Path, context: str = "fork"
) -> None:
    base = CountingDataset(N, size=1024, context="forkserver")
    job = {"TORCHELASTIC_RUN_ID": f"restart-{uuid.uuid4().hex}"}
    first = world.results(
        _attempt,
        base,
        str(tmp_path),
        2,
        context,
        nprocs=2,
        nproc_per_node=2,
        env={**job, "TORCHELASTIC_RESTART_COUNT": "0"},
        on_start=_agent,
        deadline=120,
    )
    assert first[1].killed and not first[0].ok, [str(r) for r in first]
    left = _arenas(tmp_path)
    assert len(left) == 2  # the disk tier and its lock file: SIGKILL ran no cleanup
    loads_before = base.loads()
    assert loads_before == [1 + extra for extra in fingerprint_loads(N, 2)]  # once per node, and the fingerprints

    second = world(
        _attempt,
        base,
        str(tmp_path),
        None,
        context,
        nprocs=2,
        nproc_per_node=2,
        env={**job, "TORCHELASTIC_RESTART_COUNT": "1"},
        deadline=120,
    )
    for r in second:
        assert r["loads"] == 0, r  # the first epoch after the restart: nothing from storage, on either rank
        assert (r["first"].misses, r["first"].hits) == (0, N), r["first"]
        assert (r["first"].ram_hits, r["first"].disk_hits) == (IN_RAM, N - IN_RAM)
        assert r["entries"] == N  # what the attempt before stored is counted as held
        assert sorted(r["seen"]) == r["seen"]
    assert sorted(second[0]["seen"] + second[1]["seen"]) == list(range(N))
    ram_path, disk_path = second[0]["segments"]
    assert os.path.dirname(disk_path) == str(tmp_path.resolve())
    assert all(left_name not in disk_path for left_name in left)  # adopted: renamed for its new creator
    # Construction reads the fingerprint samples again (outside the cache), nothing else.
    assert base.loads() == [a + b for a, b in zip(loads_before, fingerprint_loads(N, 2), strict=True)]
    assert _arenas(tmp_path) == [] and not os.path.exists(ram_path)  # the restarted job ended normally: gone


# The dataset of a one-rank job's script: 8 samples of 5000 bytes; ``loaded`` lists what it read.
SOURCE = """
loaded = []

class Source:
    def __len__(self):
        return 8
    def __getitem__(self, i):
        loaded.append(i)
        return bytes([65 + i]) * 5000
"""
# One attempt of a one-rank job (rank scope): samples 0-2 stored (0 and 1 in RAM, 2 on disk), then, with "die",
# SIGKILLed by itself while storing sample 3 on disk: after writing its bytes, before publishing them. Prints what
# it loaded (and, dying, its RAM tier's file; living, its stats: hits, misses, entries, disk entries).
ATTEMPT = (
    """
import os, signal, sys
from ignite_ext.data import CachedDataset
"""
    + SOURCE
    + """
class Dies(CachedDataset):
    def _before_publish(self, index):
        if index == 3 and sys.argv[2] == "die":
            print("loaded", loaded, self.segment, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

ds = Dies(Source(), capacity_bytes=12000, disk_dir=sys.argv[1], disk_bytes=1 << 20)
got = [ds[i] for i in range(4)]
assert got == [bytes([65 + i]) * 5000 for i in range(4)]
st = ds.stats()
print("loaded", loaded, st.hits, st.misses, st.entries, st.disk_entries, flush=True)
"""
)


# An agent of its own between the test and a job (which is the agent otherwise): it ends when its worker has.
AGENT = [sys.executable, "-c", "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"]


def _run_attempt(disk_dir: Path, env: dict[str, str], die: bool, agent: list[str] | None = None) -> tuple[int, str]:
    proc = subprocess.Popen(
        [*(agent or []), sys.executable, "-c", textwrap.dedent(ATTEMPT), str(disk_dir), "die" if die else "live"],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = _first_line(proc, STEP_TIMEOUT_S)
        proc.wait(timeout=STEP_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate(timeout=30)
    assert line.startswith("loaded"), err
    return proc.returncode, line


def test_an_entry_written_at_the_crash_is_never_served_after_the_restart(tmp_path: Path) -> None:
    job = {"TORCHELASTIC_RUN_ID": f"restart-{uuid.uuid4().hex}", "TORCHELASTIC_RESTART_COUNT": "0"}
    code, line = _run_attempt(tmp_path, job, die=True)
    assert code == -signal.SIGKILL and line.startswith("loaded [0, 1, 2, 3] "), line
    ram = line.split()[-1]
    assert ram in shm.orphaned_arenas()  # left by the SIGKILL
    code, line = _run_attempt(tmp_path, {**job, "TORCHELASTIC_RESTART_COUNT": "1"}, die=False)
    # Samples 0-2 from the attempt before (both tiers), sample 3 (written, not published) loaded again.
    assert code == 0 and line == "loaded [3] 3 1 4 2", line
    assert not os.path.exists(ram)  # adopted (renamed), then deleted at the normal end
    assert _arenas(tmp_path) == []


def test_another_job_adopts_nothing_and_sweeps_what_a_dead_job_left(tmp_path: Path) -> None:
    job = {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0"}  # torchrun's default run id
    code, _ = _run_attempt(tmp_path, job, die=True, agent=AGENT)  # its agent ends with it: the job is over
    assert code != 0
    left = _arenas(tmp_path)
    assert len(left) == 2
    # The same run id from another agent: another job.
    proc = subprocess.run(
        [*AGENT, sys.executable, "-c", textwrap.dedent(ATTEMPT), str(tmp_path), "live"],
        cwd=ROOT,
        env={**os.environ, **job},
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "loaded [0, 1, 2, 3] 0 4 4 2", proc.stderr
    assert _arenas(tmp_path) == []  # the dead job's files swept, the new job's deleted at its end


def test_another_jobs_cache_spares_the_files_of_a_job_whose_agent_lives(tmp_path: Path) -> None:
    job = {"TORCHELASTIC_RUN_ID": f"restart-{uuid.uuid4().hex}", "TORCHELASTIC_RESTART_COUNT": "0"}
    code, line = _run_attempt(tmp_path, job, die=True)  # its agent (the test) lives on, as before a restart
    assert code == -signal.SIGKILL
    ram, left = line.split()[-1], _arenas(tmp_path)
    assert len(left) == 2 and os.path.exists(ram)
    # Before the agent restarts the group, other jobs of the user create caches in the same directories: one
    # outside any elastic group, one under an agent of its own (torchrun's default run id).
    plain = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    elastic = {**os.environ, "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0"}
    for agent, env in (([], plain), (AGENT, elastic)):
        proc = subprocess.run(
            [*agent, sys.executable, "-c", textwrap.dedent(ATTEMPT), str(tmp_path), "live"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=STEP_TIMEOUT_S,
        )
        assert proc.returncode == 0 and proc.stdout.strip() == "loaded [0, 1, 2, 3] 0 4 4 2", proc.stderr
        assert _arenas(tmp_path) == left and os.path.exists(ram)  # their sweeps spared the live agent's job
    assert shm.sweep_stale(str(tmp_path)) == []  # so does a sweep on demand
    code, line = _run_attempt(tmp_path, {**job, "TORCHELASTIC_RESTART_COUNT": "1"}, die=False)
    assert code == 0 and line == "loaded [3] 3 1 4 2", line  # adopted: only the unpublished sample 3 is loaded
    assert _arenas(tmp_path) == [] and not os.path.exists(ram)


def test_no_job_outside_an_elastic_worker_and_arenas_are_stamped_with_theirs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert job_key() == NO_JOB
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r1")
    mine = job_key()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r2")
    assert mine != NO_JOB and job_key() not in (mine, NO_JOB)
    arena = Arena.create(4, 1 << 20, directory=str(tmp_path), job=mine, key=7)
    assert _stamps(arena.path) == (mine, 7, 4, 1)
    assert arena.consistent() is None
    arena.close()


def test_an_arena_that_fails_its_check_is_not_adopted(tmp_path: Path) -> None:
    job = {"TORCHELASTIC_RUN_ID": f"restart-{uuid.uuid4().hex}", "TORCHELASTIC_RESTART_COUNT": "0"}
    code, _ = _run_attempt(tmp_path, job, die=True)
    assert code == -signal.SIGKILL
    (disk_arena,) = [tmp_path / name for name in _arenas(tmp_path) if name.endswith(".arena")]
    # Entry 2 (on disk) now claims bytes past what was ever used: a stray write, a bug, a forger of this user.
    raw = bytearray(disk_arena.read_bytes())
    length = HEADER_BYTES + 2 * ENTRY_WORDS * 8 + 16  # the third word of entry 2
    raw[length : length + 8] = (1 << 40).to_bytes(8, "little")
    disk_arena.write_bytes(raw)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(ATTEMPT), str(tmp_path), "live"],
        cwd=ROOT,
        env={**os.environ, **job, "TORCHELASTIC_RESTART_COUNT": "1"},
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S,
    )
    # The RAM tier (samples 0 and 1) is adopted; the disk tier is rebuilt: samples 2 and 3 are loaded again.
    assert proc.returncode == 0 and proc.stdout.strip() == "loaded [2, 3] 2 2 4 2", (proc.stdout, proc.stderr)
    assert "was not reused: a published entry lies outside the used part of the data area" in proc.stderr
    assert _arenas(tmp_path) == []


def _elastic_attempt(base: CountingDataset, dirs: list[str], record: str, die: bool) -> dict[str, Any]:
    """One attempt on any world: a node cache on the node's own disk directory (its RAM tier holds nothing), one
    epoch, what the rank read written to ``record``; with ``die``, the last node's ranks are then SIGKILLed (a
    lost host) and the agent ends the others."""
    mp.current_process().daemon = False  # DataLoader workers are children of the (daemonic) rank
    node = idist.get_node_rank()
    ds = CachedDataset(base, scope="node", capacity_bytes=64, disk_dir=dirs[node], disk_bytes=DISK_CAP)
    sampler = ShardedDistributedSampler(ds, shard_by="node")
    dl = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, multiprocessing_context="fork")
    idist.barrier()
    start = ds.stats(reduce="node")
    seen = sorted(epoch(dl))
    idist.barrier()
    files = [ds.segment, ds.disk_segment]
    Path(record, f"rank{idist.get_rank()}.json").write_text(json.dumps({"node": node, "seen": seen, "files": files}))
    out = {"node": node, "seen": seen, "first": ds.stats(reduce="node") - start}
    if die:
        if node == idist.get_world_size() // idist.get_nproc_per_node() - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    idist.barrier()
    ds.close()
    return out


def test_a_group_restarted_on_fewer_nodes_keeps_what_stayed_and_loads_what_moved(world: World, tmp_path: Path) -> None:
    base = CountingDataset(N, size=1024, context="forkserver")
    dirs = [str(tmp_path / "node0"), str(tmp_path / "node1")]  # each node's own disk
    record = tmp_path / "record"
    for d in [*dirs, str(record)]:
        os.mkdir(d)
    job = {"TORCHELASTIC_RUN_ID": f"elastic-{uuid.uuid4().hex}"}
    first = world.results(  # two nodes of two ranks; after the epoch, node 1 is lost
        _elastic_attempt,
        base,
        dirs,
        str(record),
        True,
        nprocs=4,
        nproc_per_node=2,
        env={**job, "TORCHELASTIC_RESTART_COUNT": "0"},
        on_start=_agent,
        deadline=120,
    )
    assert first[2].killed or first[3].killed, [str(r) for r in first]
    seen = [json.loads((record / f"rank{r}.json").read_text()) for r in range(4)]
    held = {i for s in seen if s["node"] == 0 for i in s["seen"]}  # node 0's shard, on node 0's disk
    assert len(held) == N // 2  # of 64 samples over two nodes
    second = world(  # the job goes on with node 0 alone
        _elastic_attempt,
        base,
        dirs,
        str(record),
        False,
        nprocs=2,
        nproc_per_node=2,
        env={**job, "TORCHELASTIC_RESTART_COUNT": "1"},
        deadline=120,
    )
    for r in second:
        # Node 0 now reads every sample: what it held is served, only what moved from node 1 is loaded.
        assert (r["first"].hits, r["first"].misses) == (len(held), N - len(held)), r["first"]
    assert sorted(second[0]["seen"] + second[1]["seen"]) == list(range(N))
    # The lost node's files, left to a successor that never came: deleted once its workers have ended (in a real
    # job, by the user's first cache on that host after the job). The simulated nodes share this host's /dev/shm,
    # and their RAM tiers are stamped alike: the one the second attempt did not adopt is taken with them.
    lost = {f for s in seen if s["node"] == 1 for f in s["files"]} | {s["files"][0] for s in seen}
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while any(os.path.exists(f) and not shm.unused(f) for f in lost) and time.monotonic() < deadline:
        time.sleep(0.1)
    shm.remove_files([g for f in lost for g in (f, f.replace(".arena", ".lock"))])
    assert not any(os.path.exists(f) for f in lost)
