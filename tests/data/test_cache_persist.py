"""Caches that outlive their job (``persist=True``): the next job serves its first epoch from the disk tier.

A "job" here is a ``CachedDataset`` constructed and closed; the next one constructed after it is the next job (a
process of its own in the distributed test). The disk directories are pytest's temporary directories, on this
machine's own disk.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import warnings
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import pytest
from torch.utils.data import DataLoader

from ignite_ext.data import CachedDataset, ShardedDistributedSampler
from ignite_ext.data.cache.codec import encode
from ignite_ext.data.cache.persist import PERSIST_RE, checked_indices, stale_sample
from tests._world import World
from tests.data.test_cache import CountingDataset, epoch, fingerprint_loads
from tests.data.test_cache_users import User
from tests.data.test_cache_users import other_user as other_user  # the second-user fixture, used here too


class Source:
    """``n`` byte strings of 3000 bytes; counts its loads per index."""

    def __init__(self, n: int, changed: dict[int, bytes] | None = None) -> None:
        self.values = [bytes([65 + i % 26]) * 3000 for i in range(n)]
        for i, value in (changed or {}).items():
            self.values[i] = value
        self.loads = [0] * n

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i: int) -> bytes:
        self.loads[i] += 1
        return self.values[i]


def _job(source: Source, directory: Path, **kwargs: Any) -> tuple[list[int], Any, list[str]]:
    """One job: construct, read every sample once, close; what the epoch loaded, its stats and the warnings."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ds = CachedDataset(source, disk_dir=directory, persist=True, **kwargs)
        before = list(source.loads)
        assert [ds[i] for i in range(len(source))] == source.values
        loaded = [i for i, (a, b) in enumerate(zip(before, source.loads, strict=True)) if b > a]
        stats = ds.stats()
        ds.close()
    return loaded, stats, [str(w.message) for w in seen]


def _persisted(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if PERSIST_RE.match(n) and n.endswith(".arena"))


def test_the_next_job_reads_nothing_from_storage_in_its_first_epoch(tmp_path: Path) -> None:
    loaded, stats, _ = _job(Source(32), tmp_path)
    assert loaded == list(range(32)) and (stats.misses, stats.disk_entries, stats.ram_entries) == (32, 32, 0)
    (kept,) = _persisted(tmp_path)  # outlives the job
    loaded, stats, seen = _job(Source(32), tmp_path)
    assert loaded == [] and (stats.hits, stats.disk_hits, stats.misses) == (32, 32, 0), stats
    assert stats.entries == 32 and seen == []
    assert _persisted(tmp_path) == [kept]
    assert os.stat(tmp_path / kept).st_mode & 0o777 == 0o600


def test_another_version_or_other_data_is_another_cache(tmp_path: Path) -> None:
    _job(Source(16), tmp_path)
    loaded, _, _ = _job(Source(16), tmp_path, version="v2")  # a new version of the data: a cache of its own
    assert loaded == list(range(16))
    loaded, _, _ = _job(Source(16, {0: b"new first sample"}), tmp_path, version="v2")  # the fingerprint differs
    assert loaded == list(range(16))
    assert len(_persisted(tmp_path)) == 3
    loaded, _, _ = _job(Source(16), tmp_path, version="v2")
    assert loaded == []


def test_a_sample_changed_in_place_is_found_and_the_cache_rebuilt(tmp_path: Path) -> None:
    _job(Source(4), tmp_path)
    # Sample 1 changed, the first, middle and last did not (nor the version): the identity is the same. On opening,
    # the job checks published ones drawn at random besides those (here surely 1, the only other one).
    changed = Source(4, {1: b"changed in place"})
    loaded, stats, seen = _job(changed, tmp_path)
    assert any("holds a sample 1 that differs from the dataset's now: it is rebuilt" in s for s in seen), seen
    assert loaded == [0, 1, 2, 3] and stats.misses == 4  # rebuilt from nothing
    loaded, _, seen = _job(Source(4, {1: b"changed in place"}), tmp_path)
    assert loaded == [] and seen == []


def test_least_recently_used_caches_are_evicted_whole_under_the_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = Source(8)
    _job(first, tmp_path, version="a")
    (a,) = _persisted(tmp_path)
    size = os.stat(tmp_path / a).st_blocks * 512
    monkeypatch.setenv("IGNITE_EXT_PERSIST_BYTES", str(int(3.5 * size)))  # room for three caches
    _job(Source(8), tmp_path, version="b")
    held = CachedDataset(Source(8), disk_dir=tmp_path, persist=True, version="c")  # in use while "d" is opened
    [held[i] for i in range(8)]
    b = next(n for n in _persisted(tmp_path) if n != a and n != os.path.basename(held.disk_segment or ""))
    os.utime(tmp_path / a.replace(".arena", ".lock"), (1, 1))  # "a" used longest ago, then "b"
    os.utime(tmp_path / b.replace(".arena", ".lock"), (2, 2))
    monkeypatch.setenv("IGNITE_EXT_PERSIST_BYTES", str(int(2.5 * size)))  # room for two: "d" evicts two
    _job(Source(8), tmp_path, version="d")
    left = _persisted(tmp_path)
    assert a not in left and b not in left and len(left) == 2  # the two least recent, whole; "c" is held
    assert os.path.basename(held.disk_segment or "") in left
    assert not any(n.startswith(a[: -len(".arena")]) for n in os.listdir(tmp_path))  # with its lock file
    held.close()
    loaded, _, _ = _job(Source(8), tmp_path, version="c")
    assert loaded == []  # kept: it was in use


def test_another_users_file_under_the_name_is_neither_read_nor_deleted(other_user: User, tmp_path: Path) -> None:
    _job(Source(8), tmp_path)
    (name,) = _persisted(tmp_path)
    # Another user's file takes the name: as if they had planted it there first (in a shared directory).
    planted = tmp_path / name
    planted.unlink()
    planted.write_bytes(b"\0" * 8192)
    os.chown(planted, other_user.uid, other_user.gid)
    loaded, stats, seen = _job(Source(8), tmp_path)
    assert loaded == list(range(8)) and stats.disk_entries == 8  # served, from a disk tier of the job's own
    assert any("is taken by a file that is not yours" in s for s in seen), seen
    assert planted.exists() and os.stat(planted).st_uid == other_user.uid
    assert planted.read_bytes() == b"\0" * 8192


def test_bad_persist_arguments_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="persist=True keeps the disk tier after the job: it needs a disk_dir"):
        CachedDataset([1], persist=True)
    with pytest.raises(ValueError, match="capacity_bytes=4096 does not apply"):
        CachedDataset([1], disk_dir=tmp_path, persist=True, capacity_bytes=4096)
    with pytest.raises(ValueError, match="version= names the data of a persisted cache"):
        CachedDataset([1], disk_dir=tmp_path, version="v1")


def _node_job(base: CountingDataset, disk_dir: str) -> dict[str, Any]:
    mp.current_process().daemon = False  # DataLoader workers are children of the (daemonic) rank
    ds = CachedDataset(base, scope="node", disk_dir=disk_dir, persist=True)
    sampler = ShardedDistributedSampler(ds, shard_by="node")
    dl = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, multiprocessing_context="fork")
    idist.barrier()
    loads, start = sum(base.loads()), ds.stats(reduce="node")
    seen = sorted(epoch(dl))
    idist.barrier()
    out = {"loads": sum(base.loads()) - loads, "first": ds.stats(reduce="node") - start, "seen": seen}
    idist.barrier()
    ds.close()
    return out


@pytest.mark.distributed
def test_a_node_cache_persists_for_the_next_job_of_the_node(world: World, tmp_path: Path) -> None:
    base = CountingDataset(32, size=1024, context="forkserver")
    first = world(_node_job, base, str(tmp_path), nprocs=2, nproc_per_node=2, deadline=120)
    assert [r["loads"] for r in first] == [32, 32]  # the node's loads in its first epoch, seen by each rank
    second = world(_node_job, base, str(tmp_path), nprocs=2, nproc_per_node=2, deadline=120)
    for r in second:
        assert r["loads"] == 0 and (r["first"].misses, r["first"].disk_hits) == (0, 32), r
    assert sorted(second[0]["seen"] + second[1]["seen"]) == list(range(32))
    # Construction reads the fingerprint's three samples on each rank, and checks a few samples on opening.
    assert all(c >= 1 for c in base.loads()) and sum(base.loads()) <= 32 + 2 * sum(fingerprint_loads(32, 2)) + 5
    assert len(_persisted(tmp_path)) == 1


@pytest.mark.distributed  # DataLoader workers
# About 2 minutes alone on two cores (new DataLoader workers for every epoch of every variant, and the peers' jobs):
# the default 180 s bound leaves no room for a loaded machine.
@pytest.mark.timeout(600)
def test_the_warm_restart_benchmark_runs_and_the_next_job_reads_only_its_checks() -> None:
    from benchmarks import bench_warm

    result = bench_warm.run(quick=True)
    rows = {r["label"]: r for r in result["rows"]}
    for size, n in (("64 KiB", 256), ("1 MiB", 16)):
        # The fingerprint's three samples and at most three checked ones; a cold start reads every sample.
        assert rows[f"{size} next job, persisted"]["storage_reads"] <= 6
        assert rows[f"{size} next job, not persisted"]["storage_reads"] == n
        assert rows[f"{size} cached epoch"]["storage_reads"] == 0
    assert sum(r["variant"] == "adoption" for r in result["rows"]) == 2


def test_spot_check_draws_its_indices_at_random_per_opening() -> None:
    """A sample changed at high indices (33-62 of 64) is found by some of 20 openings, each drawing its own."""
    n = 64
    published = [bytes([i]) * 8 for i in range(n)]
    now = [b"changed!" if 33 <= i <= 62 else published[i] for i in range(n)]

    def lookup(i: int) -> memoryview:
        enc = encode(published[i])
        buf = bytearray(enc.nbytes)
        enc.write_into(memoryview(buf))
        return memoryview(buf)

    # Seeds as distinct openings draw them (tiers draws one per opening); fixed here so the test is deterministic.
    drawn = [tuple(checked_indices(n, lambda i: True, seed)) for seed in range(20)]
    assert len(set(drawn)) > 1  # not the same indices at every opening
    assert max(max(d) for d in drawn) > n // 2  # the upper half is checked too
    found = [stale_sample(lookup, now, n, seed) for seed in range(20)]
    assert any(i is not None and 33 <= i <= 62 for i in found)
