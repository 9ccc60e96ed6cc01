"""The disk tier of CachedDataset: what RAM cannot hold goes to one node-local file, shared, crash-safe and swept.

Small caps make the tiers overflow on purpose: 64 KiB of RAM holds 15 of the samples used here, 1 MiB of disk the
rest. The disk directories are pytest's temporary directories, on this machine's own disk.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils import signal_handling

from ignite_ext._fs import pid_alive
from ignite_ext.data import CachedDataset, CacheStats, ShardedDistributedSampler
from ignite_ext.data.cache import NetworkFilesystemWarning, ShmSpaceError, disk, shm
from ignite_ext.data.cache._mapping import aligned
from ignite_ext.data.cache.arena import Arena
from ignite_ext.data.cache.codec import LENDABLE, decode, encode
from ignite_ext.data.cache.tiers import DiskOption, create_tiers
from tests._world import World
from tests.data.test_cache import (
    ROOT,
    CountingDataset,
    KillBeforePublish,
    epoch,
    fingerprint_loads,
    loader,
    run_with_handler,
)
from tests.data.test_cache_cow import lent
from tests.data.test_cache_users import STEP_TIMEOUT_S, PrivateShm, User, _first_line
from tests.data.test_cache_users import other_user as other_user  # fixtures of the second-user tests, used here too
from tests.data.test_cache_users import private_shm as private_shm

RAM_CAP, DISK_CAP = 64 << 10, 1 << 20
N = 64
SLOT = aligned(encode(CountingDataset(1, size=1024, context="fork")[0]).nbytes)  # one sample's room in an arena
IN_RAM = RAM_CAP // SLOT  # 15


def _arenas(directory: str | Path, pid: int | None = None) -> list[str]:
    """This user's arena and lock files in ``directory`` (of creator ``pid`` if given)."""
    prefix = f"ignite_ext_{os.geteuid()}_{'' if pid is None else f'{pid}_'}"
    return sorted(n for n in os.listdir(directory) if n.startswith(prefix) and shm.NAME_RE.match(n))


def test_samples_fill_ram_then_disk_then_pass_through_uncached(tmp_path: Path) -> None:
    base = CountingDataset(8, size=1024)
    ds = CachedDataset(base, capacity_bytes=2 * SLOT, disk_dir=tmp_path, disk_bytes=3 * SLOT)
    for _ in range(3):
        assert [ds[i]["x"][0].item() for i in range(8)] == [float(i) for i in range(8)]
    ram, on_disk = ds._tiers.ram, ds._tiers.disk
    assert on_disk is not None
    assert [i for i in range(8) if ram.lookup(i) is not None] == [0, 1]
    assert [i for i in range(8) if on_disk.lookup(i) is not None] == [2, 3, 4]
    assert base.loads() == [1] * 5 + [3] * 3  # no eviction, no churn: the rest is loaded on every read
    st = ds.stats()
    assert (st.ram_entries, st.disk_entries, st.misses) == (2, 3, 5 + 3 * 3)
    assert (st.ram_hits, st.disk_hits, st.hits) == (2 * 2, 2 * 3, 2 * 5)
    assert st.ram_hit_rate + st.disk_hit_rate + st.miss_rate == pytest.approx(1.0)
    assert ds.disk_dir == str(tmp_path.resolve()) and os.path.dirname(ds.disk_segment or "") == ds.disk_dir
    assert ds.disk_capacity_bytes == 3 * SLOT
    ds.close()
    assert _arenas(tmp_path) == []  # the creator deletes both tiers' files


def test_the_disk_file_looks_as_large_as_disk_bytes_and_uses_what_it_holds(tmp_path: Path) -> None:
    # What the guide says of `ls -l` and `du`: the apparent size is the address space every process maps (disk_bytes
    # plus the index), the blocks used are the samples held (plus the index's pages).
    ds = CachedDataset(CountingDataset(8, size=1024), capacity_bytes=SLOT, disk_dir=tmp_path, disk_bytes=256 << 20)
    for i in range(8):
        ds[i]
    assert ds.disk_segment is not None
    st = os.stat(ds.disk_segment)
    assert st.st_size >= 256 << 20  # `ls -l`
    held = ds.stats().disk_entries * SLOT
    assert ds.stats().disk_entries == 7 and st.st_blocks * 512 <= held + (1 << 20), (st.st_blocks * 512, held)  # `du`
    ds.close()


def test_each_sample_goes_to_the_first_tier_with_room_for_it(tmp_path: Path) -> None:
    big, small = torch.zeros(4096), torch.zeros(16)  # 16 KiB does not fit 1 KiB of RAM; 64 bytes do
    ds = CachedDataset([big, small], capacity_bytes=1024, disk_dir=tmp_path, disk_bytes=1 << 20)
    ds[0], ds[1]
    st = ds.stats()
    assert ds._tiers.disk is not None and ds._tiers.disk.lookup(0) is not None and ds._tiers.ram.lookup(1) is not None
    assert (st.ram_entries, st.disk_entries) == (1, 1)
    ds.close()


def test_a_sample_another_process_stored_first_is_not_stored_again_in_the_next_tier(tmp_path: Path) -> None:
    tiers = create_tiers(1, 1 << 20, DiskOption(str(tmp_path), 1 << 20))
    enc = encode(torch.zeros(16))
    assert tiers.store(0, enc, lambda index: None) is tiers.ram
    # A second process that loaded index 0 at the same time comes to store it now: RAM holds it, so not the disk.
    assert tiers.store(0, enc, lambda index: None) is None
    assert tiers.disk is not None and tiers.disk.used == 0
    tiers.close()


def test_large_samples_on_disk_are_lent_copy_on_write_and_safe_to_modify(tmp_path: Path) -> None:
    items = [torch.full((LENDABLE,), float(i)) for i in range(2)]  # 4 LENDABLE bytes each: lent, not copied
    ds = CachedDataset(items, capacity_bytes=64, disk_dir=tmp_path, disk_bytes=4 << 20)
    ds[0]
    hit = ds[0]
    assert lent(hit, ds, "disk") and not lent(hit, ds)
    hit += 1  # copies the pages written, for this process only
    second = ds[0]  # while the first is alive: a copy
    assert not lent(second, ds, "disk") and second[0] == 0.0
    del hit, second
    again = ds[0]  # lent again, with the written pages dropped
    assert lent(again, ds, "disk") and torch.equal(again, items[0])
    assert ds.stats().disk_hits == 3
    del again
    ds.close()


def _two_epochs(base: CountingDataset, disk_dir: str) -> dict[str, Any]:
    mp.current_process().daemon = False  # DataLoader workers are children of the (daemonic) rank
    ds = CachedDataset(base, scope="node", capacity_bytes=RAM_CAP, disk_dir=disk_dir, disk_bytes=DISK_CAP)
    sampler = ShardedDistributedSampler(ds, shard_by="node")  # one node: the node's ranks share the dataset
    dl = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, multiprocessing_context="fork")
    epochs, seen, prev = [], [], ds.stats(reduce="node")
    for e in range(2):
        sampler.set_epoch(e)
        seen.append(sorted(epoch(dl)))
        idist.barrier()  # every load of the node is published before the next epoch
        now = ds.stats(reduce="node")
        epochs.append(now - prev)
        prev = now
    ram, on_disk = ds._tiers.ram, ds._tiers.disk
    assert on_disk is not None
    out = {
        "segments": (ds.segment, ds.disk_segment),
        "epochs": epochs,
        "seen": seen,
        "in_ram": [i for i in range(len(ds)) if ram.lookup(i) is not None],
        "on_disk": [i for i in range(len(ds)) if on_disk.lookup(i) is not None],
        "allocated": os.stat(on_disk.path).st_blocks * 512,
        "creator": os.getpid() if idist.get_local_rank() == 0 else None,
    }
    idist.barrier()
    ds.close()
    idist.barrier()
    out["gone"] = not any(os.path.exists(p) for p in out["segments"])
    return out


@pytest.mark.distributed
def test_a_node_loads_a_dataset_larger_than_its_ram_once_over_two_ranks_and_epochs(
    world: World, tmp_path: Path
) -> None:
    base = CountingDataset(N, size=1024, context="forkserver")
    out = world(_two_epochs, base, str(tmp_path), nprocs=2, nproc_per_node=2, deadline=120)
    # From the wrapped dataset once per node, over both epochs (besides each rank's fingerprint reads).
    assert base.loads() == [1 + extra for extra in fingerprint_loads(N, 2)]
    first, second = out[0]["epochs"]
    assert all(r["epochs"] == [first, second] for r in out)  # node sums: the same on both ranks
    assert (first.misses, first.hits, first.entries) == (N, 0, N)
    assert (first.ram_entries, first.disk_entries) == (IN_RAM, N - IN_RAM)
    assert first.disk_bytes <= DISK_CAP and first.ram_bytes <= RAM_CAP
    assert (second.misses, second.ram_hits, second.disk_hits) == (0, IN_RAM, N - IN_RAM)
    assert (second.ram_hit_rate, second.disk_hit_rate) == (IN_RAM / N, (N - IN_RAM) / N)
    assert sum(len(s) for r in out for s in r["seen"]) == 2 * N
    ram_path, disk_path = out[0]["segments"]
    assert out[1]["segments"] == (ram_path, disk_path)  # one file per tier for the node
    creator = out[0]["creator"]
    assert os.path.dirname(disk_path) == str(tmp_path.resolve())
    assert os.path.basename(disk_path).startswith(f"ignite_ext_{os.geteuid()}_{creator}_cache_")
    for r in out:
        assert len(r["in_ram"]) == IN_RAM and sorted(r["in_ram"] + r["on_disk"]) == list(range(N))
        assert r["allocated"] >= first.disk_bytes  # on the disk: blocks allocated for what it holds
        assert r["gone"]
    assert _arenas(tmp_path) == []


@pytest.mark.distributed
def test_handler_reports_each_tiers_hits(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ds = CachedDataset(CountingDataset(N, size=1024), capacity_bytes=RAM_CAP, disk_dir=tmp_path, disk_bytes=DISK_CAP)
    with caplog.at_level(logging.INFO):
        engine, rows = run_with_handler(ds, ("ram_hits", "disk_hits", "misses", "disk_entries", "miss_rate"), 2)
    assert rows == [(0, 0, N, N - IN_RAM, 1.0), (IN_RAM, N - IN_RAM, 0, N - IN_RAM, 0.0)]
    assert engine.state.metrics["cache/disk_hit_rate"] == (N - IN_RAM) / N
    assert f"hit rate 100.0% ({N} hits: {IN_RAM} from RAM, {N - IN_RAM} from disk; 0 misses)" in caplog.text
    assert f"{N} entries ({N - IN_RAM} on disk)" in caplog.text
    ds.close()


@pytest.mark.distributed
def test_a_worker_killed_before_publishing_to_disk_leaves_its_bytes_unseen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As in test_cache.py: the loader notices the death at its status check, not from SIGCHLD at a random point.
    monkeypatch.setattr(signal_handling, "_SIGCHLD_handler_set", True)
    previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    base = CountingDataset(12, size=1024)
    ds = KillBeforePublish(base, capacity_bytes=64, disk_dir=tmp_path, disk_bytes=DISK_CAP)  # RAM holds nothing
    try:
        with pytest.raises(RuntimeError, match="DataLoader worker"):
            epoch(loader(ds, shuffle=False, batch_size=1, persistent_workers=False))
    finally:
        signal.signal(signal.SIGCHLD, previous)
    k, on_disk = KillBeforePublish.kill_index, ds._tiers.disk
    assert on_disk is not None and base.loads()[k] == 1
    written = bytes(on_disk.data_view(0, on_disk.used))
    assert torch.full((1024,), float(k)).numpy().tobytes() in written  # the sample's bytes are in the file ...
    assert on_disk.lookup(k) is None and ds._tiers.ram.used == 0  # ... but were never published
    assert ds[k]["x"][0] == float(k) and base.loads()[k] == 2  # loaded again, and stored now
    assert on_disk.lookup(k) is not None and ds[k]["x"][0] == float(k) and base.loads()[k] == 2
    ds.close()


# A job whose only process stores samples 0-2 on disk, waits for a line, and is SIGKILLed by itself while storing
# sample 3: after writing its bytes, before publishing them.
DYING_JOB = """
import os, signal, sys
from ignite_ext.data import CachedDataset

class Dies(CachedDataset):
    def _before_publish(self, index):
        if index == 3:
            os.kill(os.getpid(), signal.SIGKILL)

samples = [bytes([65 + i]) * 5000 for i in range(8)]
ds = Dies(samples, capacity_bytes=64, disk_dir=sys.argv[1], disk_bytes=1 << 20)
for i in range(3):
    ds[i]
print(ds.segment, ds.disk_segment, flush=True)
sys.stdin.readline()
ds[3]
"""


@pytest.mark.distributed  # the job is a process of its own
def test_a_job_killed_while_writing_to_disk_publishes_nothing_and_the_next_job_sweeps_it(tmp_path: Path) -> None:
    job = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(DYING_JOB), str(tmp_path)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert job.stdout is not None and job.stdin is not None
        ram_path, disk_path = _first_line(job, STEP_TIMEOUT_S).split()  # never blocks past the deadline
        beside = CachedDataset([0], capacity_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 20)
        assert os.path.exists(disk_path)  # a live job's file is never swept
        beside.close()
        job.stdin.write("go\n")
        job.stdin.flush()
        job.wait(timeout=STEP_TIMEOUT_S)
    finally:
        if job.poll() is None:
            job.kill()
        job.communicate(timeout=30)
    assert job.returncode == -signal.SIGKILL
    assert os.path.exists(disk_path) and os.path.exists(ram_path)  # SIGKILL ran no cleanup
    left = Arena.attach(disk_path)  # what the dead job left, as a reader would see it
    assert [decode(left.lookup(i), lambda s, n: None) for i in range(3)] == [bytes([65 + i]) * 5000 for i in range(3)]
    assert b"D" * 5000 in bytes(left.data_view(0, left.used))  # sample 3 was written ...
    assert left.lookup(3) is None  # ... and is not published
    left.close()

    nxt = CachedDataset([bytes([97 + i]) * 5000 for i in range(4)], capacity_bytes=64, disk_dir=tmp_path)
    assert not os.path.exists(disk_path) and not os.path.exists(ram_path)  # both tiers of the dead job swept
    assert not os.path.exists(disk_path.replace(".arena", ".lock"))
    assert [nxt[i] for i in (3, 3)] == [b"d" * 5000] * 2
    st = nxt.stats()
    assert (st.hits, st.misses, st.disk_hits, st.disk_entries, st.ram_entries) == (1, 1, 1, 1, 0)
    nxt.close()


def test_disk_bytes_beyond_the_free_space_is_an_error_and_the_default_is_half_of_it(tmp_path: Path) -> None:
    free = shm.available_bytes(str(tmp_path))
    before = _arenas(shm.SHM_DIR, os.getpid())
    with pytest.raises(
        ShmSpaceError, match=rf"disk_bytes={2 * free} plus \d+ bytes of index exceed the \d+ bytes"
    ) as e:
        CachedDataset([1], capacity_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=2 * free)
    # The RAM tier made first is gone too, at once: not only once the traceback (held here) lets it be collected.
    assert _arenas(shm.SHM_DIR, os.getpid()) == before and _arenas(tmp_path) == [] and e.traceback
    # Half of what was free when it was made: measured just before and after, since other processes of the machine
    # (another test, a build) fill and free the same disk meanwhile.
    low = shm.available_bytes(str(tmp_path))
    ds = CachedDataset([1], capacity_bytes=1 << 20, disk_dir=tmp_path)
    high = shm.available_bytes(str(tmp_path))
    assert 0.49 * min(low, high) <= ds.disk_capacity_bytes <= 0.5 * max(low, high)
    assert os.stat(ds.disk_segment or "").st_blocks * 512 < 1 << 20  # sparse: blocks come as samples arrive
    ds.close()
    for bad, message in [
        ({"disk_bytes": 1 << 20}, "needs a disk_dir"),
        ({"disk_dir": tmp_path, "disk_bytes": 0}, "positive"),
        ({"disk_dir": tmp_path / "missing"}, "does not exist"),
        ({"disk_dir": ""}, "path of a directory"),
    ]:
        with pytest.raises(ValueError, match=message):
            CachedDataset([1], capacity_bytes=1 << 20, **bad)  # type: ignore[arg-type]


def _bad_disk_dirs(good: str, other: str, free: int) -> tuple[list[str], list[str]]:
    rank = idist.get_rank()
    cases: list[dict[str, Any]] = [
        {"disk_dir": os.path.join(good, "missing") if rank == 1 else good},
        {"disk_dir": os.path.join(good, "a-file") if rank == 1 else good},
        {"disk_dir": other if rank == 1 else good},  # each one fine, but not the same
        {"disk_dir": good if rank == 1 else None},
        {"disk_dir": good, "disk_bytes": 0 if rank == 1 else 1 << 20},
        {"disk_dir": good, "disk_bytes": 2 * free if rank == 0 else 1 << 20},  # the creating rank's does not fit
    ]
    messages, held = [], []
    for case in cases:
        try:
            CachedDataset([1, 2], scope="node", capacity_bytes=1 << 20, **case).close()
            messages.append("created")
        except (ValueError, ShmSpaceError) as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
            held.append(exc)  # with their tracebacks: what the failed calls made cannot be collected yet
    left = _arenas(good) + _arenas(other) + _arenas(shm.SHM_DIR, os.getpid())
    return messages, left


@pytest.mark.distributed
def test_a_bad_disk_dir_on_one_rank_is_the_same_error_on_every_rank(world: World, tmp_path: Path) -> None:
    good, other = tmp_path / "good", tmp_path / "other"
    good.mkdir()
    other.mkdir()
    (good / "a-file").touch()
    free = shm.available_bytes(str(good))
    out = world(_bad_disk_dirs, str(good), str(other), free, nprocs=2, nproc_per_node=2, deadline=90)
    ranks = [messages for messages, _ in out]
    assert ranks[0] == ranks[1], ranks
    missing, not_dir, differ, one_without, zero, too_large = ranks[0]
    assert (
        missing.startswith("ValueError: creating the node cache failed on rank(s) [1]") and "does not exist" in missing
    )
    assert "not a directory" in not_dir and "failed on rank(s) [1]" in not_dir
    assert differ.startswith("ValueError: creating the node cache: ranks of one node pass different disk_dir")
    assert "pass different disk_dir" in one_without and "None" in one_without
    assert "failed on rank(s) [1]" in zero and "disk_bytes must be a positive" in zero
    assert too_large.startswith("ShmSpaceError: creating the node cache failed on rank(s) [0]")
    assert f"disk_bytes={2 * free}" in too_large
    assert [left for _, left in out] == [[], []]  # what the creating rank had made went with each failure


def test_a_directory_on_a_network_filesystem_is_warned_about_and_not_swept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No NFS server runs here: a copy of this process's mount table that calls tmp_path's filesystem nfs4 stands in.
    assert disk.network_filesystem(str(tmp_path)) is None  # the local disk, as the kernel lists it
    dev = os.stat(tmp_path).st_dev
    fake = tmp_path / "mountinfo"
    fake.write_text(
        Path(disk.MOUNTINFO).read_text()
        + f"900 1 {os.major(dev)}:{os.minor(dev)} / /mnt/shared rw,relatime shared:9 - nfs4 fileserver:/export rw\n"
    )
    monkeypatch.setattr(disk, "MOUNTINFO", str(fake))
    assert disk.network_filesystem(str(tmp_path)) == "nfs4"
    dead = 2**22 + 1  # above the largest pid_max: no process has it
    assert not pid_alive(dead)
    stale = [tmp_path / f"ignite_ext_{os.geteuid()}_{dead}_cache_{'a' * 16}.{kind}" for kind in ("arena", "lock")]
    for path in stale:
        path.touch()
    with pytest.warns(NetworkFilesystemWarning, match="nfs4 filesystem"):
        ds = CachedDataset([1], capacity_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 20)
    assert all(p.exists() for p in stale)  # another host's live job could own such a name there
    ds.close()
    monkeypatch.setattr(disk, "MOUNTINFO", "/proc/self/mountinfo")
    CachedDataset([1], capacity_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 20).close()
    assert not any(p.exists() for p in stale)  # on a local disk they are swept


# A job of either user that stores a sample on disk and is then SIGKILLed with its files in place.
KILLED_DISK_JOB = """
import sys, time
from ignite_ext.data import CachedDataset
ds = CachedDataset([bytes([i]) * 1000 for i in range(10)], capacity_bytes=64, disk_dir=sys.argv[1], disk_bytes=1 << 20)
ds[0], ds[1]
print(ds.disk_segment, flush=True)
time.sleep(300)
"""

NEW_DISK_CACHE = """
import sys
from ignite_ext.data import CachedDataset
ds = CachedDataset([bytes([i]) * 1000 for i in range(10)], capacity_bytes=64, disk_dir=sys.argv[1], disk_bytes=1 << 20)
assert [ds[i][0] for i in (3, 3, 4)] == [3, 3, 4] and ds.stats().disk_hits == 1
print(ds.disk_segment, flush=True)
"""


@pytest.mark.slow  # three processes that each import torch
def test_a_dead_jobs_disk_file_is_swept_and_another_users_is_not(other_user: User, private_shm: PrivateShm) -> None:
    shared = tempfile.mkdtemp(prefix="ignite_ext_disk_test_", dir="/tmp")  # a local directory both users may use
    try:
        os.chmod(shared, 0o1777)
        mine = Path(private_shm.killed(KILLED_DISK_JOB, shared))
        theirs = Path(private_shm.killed(KILLED_DISK_JOB, shared, user=other_user))
        assert os.lstat(mine).st_uid == 0 and os.lstat(theirs).st_uid == other_user.uid
        assert oct(os.lstat(theirs).st_mode & 0o777) == "0o600"

        # The other user's next cache sweeps its own stale file and skips root's, which it cannot even open.
        fresh = Path(private_shm.run(NEW_DISK_CACHE, shared, user=other_user)[0])
        assert not fresh.exists() and not theirs.exists() and not theirs.with_suffix(".lock").exists()
        assert mine.exists() and mine.with_suffix(".lock").exists()

        # Root's next cache, in this process, sweeps root's stale file only.
        theirs = Path(private_shm.killed(KILLED_DISK_JOB, shared, user=other_user))
        CachedDataset([1], capacity_bytes=64, disk_dir=shared, disk_bytes=1 << 20).close()
        assert not mine.exists() and not mine.with_suffix(".lock").exists()
        assert theirs.exists() and theirs.with_suffix(".lock").exists()
        assert os.lstat(theirs).st_uid == other_user.uid
    finally:
        shutil.rmtree(shared)


def test_stats_keep_their_former_fields_and_add_the_tiers() -> None:
    old = CacheStats(3, 1, 2, 256)  # positional, as before the disk tier
    assert (old.hits, old.ram_hits, old.disk_hits, old.hit_rate) == (3, 3, 0, 0.75)
    tiered = CacheStats(hits=5, misses=5, entries=4, bytes=400, disk_hits=2, disk_entries=1, disk_bytes=100)
    assert dataclasses.astuple(tiered - old) == (2, 4, 2, 144, 2, 1, 100, 0, 0, 0)
    assert (tiered.ram_entries, tiered.ram_bytes) == (3, 300)
    assert (tiered.ram_hit_rate, tiered.disk_hit_rate, tiered.miss_rate) == (0.3, 0.2, 0.5)
    assert CacheStats().miss_rate == CacheStats().hit_rate == 0.0
