"""A cache that follows shards that mix (``CachedDataset.follow``, ``ShardedDistributedSampler(mix=f)``).

What left the shard is evicted and what arrived is stored in the space it held: each epoch the hits are exactly the
samples that stayed (``1 - f`` of the shard, ``f`` rounded to whole cohorts) and the space used does not grow
beyond the shard. Readers never see another sample's bytes, also while a process of the node reuses space (real
processes, a real SIGKILL of a writer), and a tensor lent before the cache followed keeps its bytes.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import random
import signal
import time
from typing import Any

import ignite.distributed as idist
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from ignite_ext.data import CachedDataset, ShardedDistributedSampler
from ignite_ext.data.cache import _space
from ignite_ext.data.cache.arena import Arena
from ignite_ext.data.cache.codec import LENDABLE
from ignite_ext.data.sampler.mixing import mixed_shards
from tests._world import World
from tests.data.test_cache import CountingDataset
from tests.data.test_cache_cow import lent

FAST = settings(deadline=None, max_examples=40, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def payload(index: int, nbytes: int) -> bytes:
    """What index ``index`` stores: its own bytes, so a read of anything else is caught."""
    return (index.to_bytes(4, "little") * (nbytes // 4 + 1))[:nbytes]


def store(arena: Arena, index: int, nbytes: int) -> bool:
    offset = arena.reserve(index, nbytes)
    if offset is None:
        return False
    arena.data_view(offset, nbytes)[:] = payload(index, nbytes)
    return arena.publish(index, offset, nbytes)


def live_ranges(arena: Arena, n: int) -> list[tuple[int, int]]:
    table = np.frombuffer(arena._mapped().table, dtype=np.uint64).reshape(n, 3)
    ranges = sorted((int(o), int(o) + int(ln)) for state, o, ln in table if state == 1)
    del table
    return ranges


@FAST
@given(
    sizes=st.lists(st.integers(1, 3000), min_size=4, max_size=60),
    rounds=st.lists(st.lists(st.booleans(), min_size=60, max_size=60), min_size=1, max_size=6),
)
def test_an_arena_that_follows_keeps_the_kept_evicts_the_rest_and_never_mixes_up_bytes(
    sizes: list[int], rounds: list[list[bool]]
) -> None:
    n = len(sizes)
    arena = Arena.create(n=n, capacity=1 << 20)
    try:
        held: set[int] = set()
        for kept_mask in rounds:
            keep = {i for i in range(n) if kept_mask[i]}
            done = arena.follow(sorted(keep))
            assert done.following
            assert done.evicted == len(held - keep)
            assert done.evicted_bytes == sum(sizes[i] for i in held - keep)
            held &= keep
            for i in sorted(keep):
                if i not in held:
                    assert store(arena, i, sizes[i])
                    held.add(i)
            for i in range(n):
                raw = arena.lookup(i)
                assert (raw is not None) == (i in held)
                if raw is not None:
                    assert bytes(raw) == payload(i, sizes[i])
            ranges = live_ranges(arena, n)
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(ranges))  # no two entries overlap
            assert arena.used <= arena.capacity
    finally:
        arena.close()


@FAST
@given(size=st.integers(1, 5000), n=st.integers(4, 80), churn=st.floats(0.05, 0.5), rounds=st.integers(1, 8))
def test_samples_of_one_size_reuse_exactly_the_space_that_left(size: int, n: int, churn: float, rounds: int) -> None:
    arena = Arena.create(n=2 * n, capacity=1 << 22)
    try:
        shard = list(range(n))
        arena.follow(shard)
        for i in shard:
            assert store(arena, i, size)
        used = arena.used
        moved = max(1, int(churn * n))
        for r in range(1, rounds + 1):  # a window sliding over 2n indices: `moved` leave, as many arrive
            shard = [(r * moved + j) % (2 * n) for j in range(n)]
            arena.follow(shard)
            for i in shard:
                if arena.lookup(i) is None:
                    assert store(arena, i, size)
            assert arena.used == used  # every arrival went where a departure was
    finally:
        arena.close()


@pytest.mark.parametrize("mix", [0.05, 0.25])
def test_samples_of_varied_sizes_keep_the_space_used_within_a_quarter_of_the_shard(mix: float) -> None:
    # First fit into the gaps recounted at each eviction: over 300 epochs of this set-up the space used stayed
    # within 1.10x (mix=0.05) and 1.06x (0.25) of the largest shard; 1.25x leaves a margin, and fails if freed
    # space were not reused (the used space would then grow by mix of a shard every epoch: 3x by epoch 40 at 0.05).
    n, shards, epochs = 2000, 4, 60
    rng = random.Random(7)
    sizes = [rng.randint(1000, 64000) for _ in range(n)]
    arena = Arena.create(n=n, capacity=1 << 28)
    try:
        arena.follow([])
        base, largest = arena.used, 0
        for e in range(epochs):
            shard = mixed_shards(n, shards, 0, e, mix)[1]
            arena.follow(shard)
            rng.shuffle(shard)
            for i in shard:
                if arena.lookup(i) is None:
                    assert store(arena, i, sizes[i])
            largest = max(largest, sum((sizes[i] + 63) // 64 * 64 for i in shard))
            assert arena.used - base <= 1.25 * largest
    finally:
        arena.close()


def _writer_killed_holding(path: str, index: int, nbytes: int, ready: Any) -> None:
    arena = Arena.attach(path)
    offset = arena.reserve(index, nbytes)
    arena.data_view(offset, nbytes)[:] = payload(index, nbytes)
    ready.put(offset)
    time.sleep(60)  # SIGKILLed before it publishes


@pytest.mark.distributed
def test_a_range_being_written_is_never_handed_out_and_a_killed_writers_comes_back() -> None:
    arena = Arena.create(n=8, capacity=1 << 20)
    ctx = mp.get_context("fork")
    ready = ctx.Queue()
    try:
        arena.follow(range(8))
        assert store(arena, 0, 1000)
        writer = ctx.Process(target=_writer_killed_holding, args=(arena.path, 1, 1000, ready), daemon=True)
        writer.start()
        held = ready.get(timeout=30)
        arena.follow([1, 2, 3])  # 0 evicted: its range is free, the writer's is not
        got = arena.reserve(2, 1000)
        assert got is not None and got != held
        arena.data_view(got, 1000)[:] = payload(2, 1000)
        assert arena.publish(2, got, 1000)
        writer.kill()
        writer.join(10)
        assert writer.exitcode == -signal.SIGKILL
        assert arena.reserve(3, 1000) not in (None, held)  # not before an eviction recounts the space ...
        arena.follow([2])
        assert arena.reserve(1, 1000) == held  # ... then the dead writer's range is free again
        assert bytes(arena.lookup(2)) == payload(2, 1000)
    finally:
        arena.close()


def _churn(path: str, n: int, size: int, seconds: float) -> int:
    """Follow alternating halves of the indices and store what arrives, for ``seconds``: rewrites the same space."""
    arena = Arena.attach(path)
    halves = [list(range(0, n // 2)), list(range(n // 2, n))]
    rounds, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        keep = halves[rounds % 2]
        arena.follow(keep)
        for i in keep:
            if arena.lookup(i) is None:
                store(arena, i, size)
        rounds += 1
    return rounds


def _read(path: str, n: int, size: int, seconds: float, out: Any) -> None:
    arena = Arena.attach(path)
    reads = wrong = found = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for i in range(n):
            raw = arena.lookup(i)
            reads += 1
            if raw is not None:
                found += 1
                wrong += bytes(raw) != payload(i, size)
    out.put((reads, found, wrong))


@pytest.mark.distributed
def test_readers_never_see_another_samples_bytes_while_the_space_is_reused() -> None:
    n, size, seconds = 64, 16 << 10, 3.0
    arena = Arena.create(n=n, capacity=n // 2 * size + (1 << 20))  # room for one half: space must be reused
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    try:
        arena.follow(range(n))
        readers = [ctx.Process(target=_read, args=(arena.path, n, size, seconds, out), daemon=True) for _ in range(2)]
        for reader in readers:
            reader.start()
        rounds = _churn(arena.path, n, size, seconds)
        results = [out.get(timeout=60) for _ in readers]
        for reader in readers:
            reader.join(10)
        assert rounds > 10
        for reads, found, wrong in results:
            assert wrong == 0
            assert found > 0 and reads > found  # they read across many rewrites of the same space
    finally:
        arena.close()


def _epochs(ds: CachedDataset, sampler: ShardedDistributedSampler, epochs: int, workers: int) -> list[dict[str, Any]]:
    loader = DataLoader(ds, batch_size=8, sampler=sampler, num_workers=workers, multiprocessing_context="fork")
    rows, before = [], ds.stats()
    for e in range(epochs):
        sampler.set_epoch(e)
        for batch in loader:
            assert torch.equal(batch["x"][:, 0], batch["i"].float())  # each sample's own bytes
        now = ds.stats()
        delta = now - before
        before = now
        rows.append(
            {
                "hits": delta.hits,
                "misses": delta.misses,
                "held": now.entries - now.evictions,
                "used": ds._tiers.ram.used,
            }
        )
    return rows


@pytest.mark.distributed
@pytest.mark.parametrize("size", [64, LENDABLE // 4])  # large samples are copied out too (nothing is lent)
@pytest.mark.parametrize("mix", [0.05, 0.25])
def test_each_epoch_hits_exactly_what_stayed_and_the_cache_holds_one_shard(mix: float, size: int) -> None:
    n, shards, epochs = 800, 4, 6
    base = CountingDataset(n, size=size)
    ds = CachedDataset(base, capacity_bytes=64 << 20)  # type: ignore[arg-type]
    try:
        sampler = ShardedDistributedSampler(ds, num_replicas=shards, rank=1, shuffle=True, seed=3, mix=mix)
        rows = _epochs(ds, sampler, epochs, workers=2)
        pools = [set(mixed_shards(n, shards, 3, e, mix)[1]) for e in range(epochs)]
        assert rows[0]["hits"] == 0 and rows[0]["misses"] == len(pools[0])
        for e in range(1, epochs):
            stayed = len(pools[e] & pools[e - 1])
            assert rows[e]["hits"] == stayed and rows[e]["misses"] == len(pools[e]) - stayed
            assert rows[e]["hits"] / len(pools[e]) >= 1 - mix - 1 / len(pools[e])  # f, rounded to whole cohorts
            assert rows[e]["held"] == len(pools[e])  # the shard, not the shard plus what passed through
            assert rows[e]["used"] == rows[0]["used"]  # arrivals took the space of departures
        assert base.loads() == [sum(i in p and (e == 0 or i not in pools[e - 1]) for e, p in enumerate(pools))
                                for i in range(n)]  # fmt: skip
        big = ds[min(pools[-1])]
        assert not lent(big["x"], ds)  # a following cache lends nothing, however large
        big["x"].fill_(-1.0)  # a reader's own copy: the cache is unchanged
        assert ds[min(pools[-1])]["x"][0].item() == float(min(pools[-1]))
    finally:
        ds.close()


def test_a_tensor_lent_before_the_cache_followed_keeps_its_bytes() -> None:
    n = 16
    ds = CachedDataset(CountingDataset(n, size=LENDABLE), capacity_bytes=64 << 20)  # type: ignore[arg-type]
    try:
        ds[0]  # loaded and stored
        first = ds[0]["x"]
        assert lent(first, ds)  # lent copy-on-write from the cache
        sampler = ShardedDistributedSampler(ds, num_replicas=2, rank=0, shuffle=False, mix=1.0)
        for e in range(1, 4):
            sampler.set_epoch(e)  # index 0 leaves the shard: evicted, its space never reused
            for i in sampler:
                ds[i]
        assert ds.stats().evictions > 0
        assert torch.equal(first, torch.zeros(LENDABLE))
    finally:
        ds.close()


def test_a_cache_without_room_for_the_bookkeeping_does_not_follow_and_evicts_nothing() -> None:
    ds = CachedDataset(CountingDataset(1 << 16, size=4), capacity_bytes=1 << 20)  # type: ignore[arg-type]
    try:
        assert ds.follow(range(10)) is False
        assert ds.follow([]) is False and ds.stats().evictions == 0
        with pytest.raises(ValueError, match="range"):
            ds.follow([1 << 16])
    finally:
        ds.close()


def node_epochs(ds: CachedDataset, sampler: Any, loader: DataLoader[Any], epochs: int) -> list[tuple[Any, Any]]:
    """Each epoch read by this rank (every sample checked): the node's stats over that epoch, and after it."""
    rows, before = [], ds.stats(reduce="node")
    for e in range(epochs):
        sampler.set_epoch(e)
        for batch in loader:
            assert torch.equal(batch["x"][:, 0], batch["i"].float())
        idist.barrier()  # the node's loads are published before its ranks count
        now = ds.stats(reduce="node")
        rows.append((now - before, now))
        before = now
        idist.barrier()  # every rank counted before any starts the next epoch (and follows its shard)
    return rows


def _train_mixing(base: CountingDataset, shard_by: str, mix: float, epochs: int) -> list[tuple[int, int, int]]:
    mp.current_process().daemon = False
    ds = CachedDataset(base, scope="node", capacity_bytes=8 << 20)  # type: ignore[arg-type]
    sampler = ShardedDistributedSampler(ds, shard_by=shard_by, seed=5, mix=mix)  # type: ignore[arg-type]
    loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=1, multiprocessing_context="fork")
    rows = [(d.hits, d.misses, n.entries - n.evictions) for d, n in node_epochs(ds, sampler, loader, epochs)]
    ds.close()
    return rows


@pytest.mark.distributed
@pytest.mark.parametrize("shard_by", ["node", "rank"])
def test_node_caches_follow_the_nodes_shards_on_two_nodes(world: World, shard_by: str) -> None:
    n, epochs, mix = 400, 4, 0.25
    base = CountingDataset(n, context="forkserver")
    out = world(_train_mixing, base, shard_by, mix, epochs, nproc_per_node=2, deadline=120)
    shards = 2 if shard_by == "node" else 4
    for node in range(2):
        mine = [node] if shard_by == "node" else [2 * node, 2 * node + 1]
        pools = [{i for s in mine for i in mixed_shards(n, shards, 5, e, mix)[s]} for e in range(epochs)]
        rows = out[2 * node]
        assert out[2 * node + 1] == rows  # the node's stats, the same on both of its ranks
        for e in range(1, epochs):
            stayed = len(pools[e] & pools[e - 1])
            assert rows[e][:2] == (stayed, len(pools[e]) - stayed)  # hits: what stayed on the node
            assert rows[e][2] == len(pools[e])  # the node's cache holds the node's shard
            assert stayed < len(pools[e])  # something did move between the nodes


def test_an_epoch_resumed_on_another_world_keeps_the_cache_and_the_next_epoch_follows_the_new_world() -> None:
    n, mix = 480, 0.25
    base = CountingDataset(n)
    ds = CachedDataset(base, capacity_bytes=16 << 20)  # type: ignore[arg-type]
    try:
        old = ShardedDistributedSampler(ds, num_replicas=4, rank=0, shuffle=True, seed=2, mix=mix)
        for e in range(2):
            old.set_epoch(e)
            for i in old:
                ds[i]
        old.set_epoch(2)
        it = iter(old)
        head = [next(it) for _ in range(30)]
        for i in head:
            ds[i]
        state = old.state_dict(consumed=30)
        evictions, held = ds.stats().evictions, ds.stats().entries - ds.stats().evictions
        new = ShardedDistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=2, mix=mix)
        new.load_state_dict(state)  # restriped: the rest of epoch 2 reads outside the new world's shards
        assert ds.stats().evictions == evictions  # so the cache evicts nothing during it
        rest = list(new)
        for i in rest:
            ds[i]
        assert ds.stats().evictions == evictions  # the whole restriped pass evicted nothing
        assert ds.stats().entries - ds.stats().evictions >= held
        new.set_epoch(3)  # the next epoch follows the new world's shard
        shard = set(mixed_shards(n, 2, 2, 3, mix)[0])
        before = ds.stats()
        for i in new:
            ds[i]
        after = ds.stats()
        assert after.entries - after.evictions == len(shard)
        assert (after - before).hits + (after - before).misses == len(shard)
        assert set(new.indices(3)) == shard
    finally:
        ds.close()


@pytest.mark.distributed
def test_loading_ahead_makes_the_arrivals_hits_and_holds_the_shard_plus_what_arrives() -> None:
    n, shards, epochs, mix = 800, 4, 4, 0.25
    base = CountingDataset(n)
    ds = CachedDataset(base, capacity_bytes=16 << 20)  # type: ignore[arg-type]
    try:
        sampler = ShardedDistributedSampler(ds, num_replicas=shards, rank=2, seed=4, mix=mix, load_ahead=True)
        pools = [set(mixed_shards(n, shards, 4, e, mix)[2]) for e in range(epochs + 1)]
        for e in range(epochs):
            sampler.set_epoch(e)
            before = ds.stats()
            order = list(sampler)  # the epoch's iteration starts: its arrivals of the next epoch load meanwhile
            for i in order:
                assert ds[i]["x"][0].item() == float(i)
            assert ds._loading is not None and ds._loading.join(60)  # done before the next epoch starts
            now = ds.stats() - before
            if e > 0:
                assert (now.hits, now.misses) == (len(pools[e]), 0)  # every arrival was loaded ahead
            # what arrives next, less what the cache still holds: a sample that left last epoch and comes back next
            # was kept (it was to arrive), so it is neither loaded ahead nor a miss
            assert now.loaded_ahead == len(pools[e + 1] - pools[e] - (pools[e - 1] if e else set()))
            held = ds.stats().entries - ds.stats().evictions
            assert held == len(pools[e] | pools[e + 1])  # the shard, plus what arrives next
        total = ds.stats()
        assert sum(base.loads()) == total.misses + total.loaded_ahead  # each load is a miss or ahead, never both
        assert ShardedDistributedSampler(range(8), num_replicas=2, rank=0).load_ahead is False
        with pytest.raises(TypeError, match="load_ahead"):
            ShardedDistributedSampler(range(8), num_replicas=2, rank=0, load_ahead=1)  # type: ignore[arg-type]
    finally:
        ds.close()
    assert ds._loading is None


@pytest.mark.distributed
def test_the_loading_ahead_process_is_killed_at_the_next_epoch_and_dies_with_its_parent() -> None:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    parent = ctx.Process(target=_start_slow_loading, args=(out,), daemon=True)  # a daemonic rank may load ahead
    parent.start()
    first, second = out.get(timeout=60)
    assert not _alive(first)  # killed when the next epoch followed
    os.kill(parent.pid, signal.SIGKILL)  # type: ignore[arg-type]
    parent.join(30)
    deadline = time.monotonic() + 30
    while _alive(second) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(second)  # died with its parent


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _start_slow_loading(out: Any) -> None:
    ds = CachedDataset(CountingDataset(64, delay=5.0), capacity_bytes=4 << 20)  # type: ignore[arg-type]
    ds.follow(range(32), ahead=range(32, 64))
    first = ds._loading.pid  # type: ignore[union-attr]
    ds.follow(range(16, 48), ahead=range(48, 64))
    out.put((first, ds._loading.pid))  # type: ignore[union-attr]
    time.sleep(120)


def test_both_tiers_follow_the_shard(tmp_path: Any) -> None:
    n, shards, epochs, mix = 600, 3, 5, 0.25
    ds = CachedDataset(  # type: ignore[arg-type]
        CountingDataset(n), capacity_bytes=128 << 10, disk_dir=tmp_path, disk_bytes=16 << 20
    )
    try:
        sampler = ShardedDistributedSampler(ds, num_replicas=shards, rank=0, seed=1, mix=mix)
        pools = [set(mixed_shards(n, shards, 1, e, mix)[0]) for e in range(epochs)]
        used: list[tuple[int, int]] = []
        before = ds.stats()
        for e in range(epochs):
            sampler.set_epoch(e)
            for i in sampler:
                assert ds[i]["x"][0].item() == float(i)
            now = ds.stats()
            if e:
                stayed = len(pools[e] & pools[e - 1])
                assert ((now - before).hits, (now - before).misses) == (stayed, len(pools[e]) - stayed)
            assert now.disk_hits > 0 or e == 0  # the shard does not fit the RAM tier: both serve it
            assert now.entries - now.evictions == len(pools[e])
            used.append((ds._tiers.ram.used, ds._tiers.disk.used))  # type: ignore[union-attr]
            before = now
        assert all(u == used[0] for u in used)  # neither tier grows: arrivals took departures' space
    finally:
        ds.close()


class _Header:
    """An arena's header words, with a hook called after each write of one word (for interleavings in one process)."""

    def __init__(self, words: Any, word: int, hook: Any) -> None:
        self.words, self.word, self.hook = words, word, hook

    def __getitem__(self, i: int) -> int:
        return int(self.words[i])

    def __setitem__(self, i: int, value: int) -> None:
        self.words[i] = value
        if i == self.word:
            self.hook()


def test_a_reader_that_sees_the_new_era_sees_the_evicted_entries_gone() -> None:
    from ignite_ext.data.cache._mapping import H_ERA

    arena = Arena.create(n=4, capacity=1 << 20)
    try:
        arena.follow(range(4))
        for i in range(4):
            assert store(arena, i, 500)
        local = arena._mapped()
        seen: list[tuple[bool, bool]] = []
        # The moment the era changes, a reader starts: it must find the evicted entries gone (else it would copy
        # bytes that the next writer may rewrite, under an era that does not change any more).
        words = local.header
        local.header = _Header(words, H_ERA, lambda: seen.append((arena.holds(0), arena.holds(1))))
        try:
            arena.follow([2, 3])
        finally:
            local.header = words
        assert seen == [(False, False)]
    finally:
        arena.close()


def test_a_reservation_that_meets_the_first_follow_is_recorded_as_being_written() -> None:
    arena = Arena.create(n=4, capacity=1 << 20)
    other = Arena.attach(arena.path)  # another process's handle: its own lock descriptor
    try:
        original, mine = _space.locked, arena._mapped()
        calls = []

        def meet(local: Any) -> Any:
            if local is mine and not calls:
                calls.append(other.follow(range(4)).following)  # between reserve's check and its lock
            return original(local)

        _space.locked = meet
        try:
            held = arena.reserve(0, 1000)  # checked before the arena followed, taken after
        finally:
            _space.locked = original
        assert calls == [True] and held is not None
        other.follow([1])  # recounts the space: the range being written must not be handed out
        assert other.reserve(1, 1000) != held
        arena.data_view(held, 1000)[:] = payload(0, 1000)
        assert arena.publish(0, held, 1000) is True
        assert bytes(arena.lookup(0)) == payload(0, 1000)
    finally:
        other.close()
        arena.close()


def test_loading_ahead_stops_at_the_first_sample_the_cache_has_no_room_for() -> None:
    ds = CachedDataset(CountingDataset(200, size=1024), capacity_bytes=256 << 10)  # type: ignore[arg-type]
    try:
        assert ds.follow([], ahead=[])
        for i in range(20):
            ds[i]
        stored = ds.stats().entries
        # No room for all of them: it loads until the first one that does not fit, then stops, counting each load.
        assert ds._load_ahead(0) is True  # held already: nothing loaded
        loaded = 0
        for i in range(20, 200):
            loaded += 1
            if not ds._load_ahead(i):
                break
        assert 20 < loaded < 180  # some fitted, then one did not: it stopped there
        assert ds.stats().loaded_ahead == loaded and ds.stats().entries == stored + loaded - 1
    finally:
        ds.close()


def test_a_persisted_cache_does_not_follow(tmp_path: Any) -> None:
    ds = CachedDataset(CountingDataset(40), disk_dir=tmp_path, persist=True)  # type: ignore[arg-type]
    try:
        for i in range(40):
            ds[i]
        assert ds.follow(range(10)) is False  # what it holds is for the next jobs too
        assert ds.stats().evictions == 0 and ds.stats().entries == 40
        assert all(ds._tiers.holds(i) for i in range(40))
    finally:
        ds.close()
