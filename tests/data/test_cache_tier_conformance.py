"""One conformance suite for every kind of tier: the same tests, parametrised by tier (RAM, disk, a second disk).

Each kind opens an arena through :class:`~ignite_ext.data.cache.tiers.Tier`'s one method; the suite holds it to
what :class:`~ignite_ext.data.cache.tiers.Tiers` relies on: publish and lookup, a SIGKILLed writer (nothing half
published, its space back at the next eviction), eviction when following, adoption after a restart (the creator
SIGKILLed), persistence where the kind has it. A third tier composes with the others without a change to them.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ignite_ext.data.cache._follow import space_bytes
from ignite_ext.data.cache._mapping import aligned
from ignite_ext.data.cache.arena import Arena
from ignite_ext.data.cache.codec import encode
from ignite_ext.data.cache.tiers import DiskOption, DiskTier, RamTier, Tier, open_tiers

N = 8
SIZE = 1000  # bytes per sample here: 1024 with alignment
JOB = 0x5EED  # a job stamp of these tests' own (a restarted worker group's tiers are adopted by job and cache)


def _sample(index: int) -> bytes:
    return bytes([0x30 + index]) * SIZE


def _store(arena: Arena, index: int) -> int | None:
    """Reserve, write and publish ``index``; its offset, or None if there was no room."""
    offset = arena.reserve(index, SIZE)
    if offset is None:
        return None
    arena.data_view(offset, SIZE)[:] = _sample(index)
    assert arena.publish(index, offset, SIZE)
    return offset


def _in_child(body: Callable[[], object], die: bool) -> None:
    """Run ``body`` in a forked child that then SIGKILLs itself (``die``) or exits normally; wait for it.

    What ``body`` returns stays referenced until then (an arena dropped earlier would be closed, and deleted).
    """
    pid = os.fork()
    if pid == 0:
        try:
            held = body()  # noqa: F841 - alive until the process dies
            if die:
                os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) if die else os.WEXITSTATUS(status) == 0


@pytest.fixture(params=["ram", "disk", "second-disk"])
def kind(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    if request.param == "ram":
        yield RamTier(64 * SIZE)
    else:
        directory = tmp_path / request.param
        directory.mkdir()
        yield DiskTier(DiskOption(str(directory), 64 * SIZE))


def test_what_is_published_is_found_and_nothing_else(kind: Tier) -> None:
    arena = kind.open(N, 1, 1, 0, ())
    try:
        assert _store(arena, 3) is not None
        assert bytes(arena.lookup(3) or b"") == _sample(3) and arena.holds(3)
        assert arena.lookup(4) is None and not arena.holds(4)
        assert _store(arena, 3) is None  # published already: never a second entry
    finally:
        arena.close()


def test_a_sigkilled_writer_publishes_nothing_and_its_space_comes_back_at_the_next_eviction(kind: Tier) -> None:
    arena = kind.open(N, 1, 1, 0, ())
    try:
        arena.follow(range(N))

        def write_half() -> None:
            offset = arena.reserve(5, SIZE)
            assert offset is not None
            arena.data_view(offset, SIZE // 2)[:] = _sample(5)[: SIZE // 2]

        _in_child(write_half, die=True)
        assert arena.lookup(5) is None and not arena.holds(5)
        lost = arena.used
        assert lost > 0  # the killed writer's range, in use by nobody
        arena.follow(range(N - 1))  # an eviction: the range is recounted free
        assert _store(arena, 5) is not None and arena.used == lost  # the same space, not more
        assert bytes(arena.lookup(5) or b"") == _sample(5)
    finally:
        arena.close()


def test_a_following_tier_evicts_what_left_and_reuses_its_space(kind: Tier) -> None:
    arena = kind.open(N, 1, 1, 0, ())
    try:
        arena.follow([0, 1])
        first = _store(arena, 0)
        assert _store(arena, 1) is not None
        used = arena.used
        followed = arena.follow([1, 2])
        assert (followed.evicted, followed.evicted_bytes, followed.following) == (1, SIZE, True)
        assert arena.lookup(0) is None and bytes(arena.lookup(1) or b"") == _sample(1)
        assert _store(arena, 2) == first and arena.used == used  # index 0's range, reused
        assert bytes(arena.lookup(2) or b"") == _sample(2)
    finally:
        arena.close()


def test_a_restarted_group_adopts_the_tier_its_sigkilled_creator_left(kind: Tier) -> None:
    identity = ("conformance", os.getpid())

    def first_attempt() -> Arena:
        arena = kind.open(N, 1, 1, JOB, identity)
        for index in (0, 6):
            _store(arena, index)
        return arena

    _in_child(first_attempt, die=True)
    adopted = kind.open(N, 1, 1, JOB, identity)
    try:
        assert [bytes(adopted.lookup(i) or b"") for i in (0, 6)] == [_sample(0), _sample(6)]
        assert adopted.lookup(1) is None
    finally:
        adopted.close()
    assert not os.path.exists(adopted.path)  # adopted means owned: deleted at its close like any other


def test_a_persistent_tier_serves_the_next_job_and_others_do_not_persist(kind: Tier, tmp_path: Path) -> None:
    if not isinstance(kind, DiskTier):
        assert not kind.persistent  # RAM dies with the job: nothing to carry
        return
    kept = DiskTier(DiskOption(kind.option.directory, 64 * SIZE, persist=True), persisted=("conformance", N))
    assert kept.persistent

    def first_job() -> Arena:
        arena = kept.open(N, 1, 1, 0, ())
        _store(arena, 2)
        return arena

    _in_child(first_job, die=False)  # a job that ended normally
    later = kept.open(N, 1, 1, 0, ())
    try:
        assert bytes(later.lookup(2) or b"") == _sample(2)
    finally:
        later.discard()


def test_a_third_tier_composes_with_the_others(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    # RAM too small for a sample, a first disk for two, a second disk for the rest: placed in that order.
    two = aligned(space_bytes(N)) + 2 * aligned(encode(_sample(0)).nbytes)  # a following tier's bookkeeping too
    tiers = open_tiers(N, [RamTier(64), DiskTier(DiskOption(str(first), two)), DiskTier(DiskOption(str(second), None))])
    try:
        assert tiers.follow(range(N)) == (0, 0, False)  # RAM has no room to follow; the disks do
        stored = [tiers.store(i, encode(_sample(i)), lambda index: None) for i in range(4)]
        assert stored == [tiers.arenas[1], tiers.arenas[1], tiers.arenas[2], tiers.arenas[2]]
        for i in range(4):
            found = tiers.find(i)
            assert found is not None and found[0] is stored[i]
        for arena in stored:
            tiers.count_miss(0, 0, arena, SIZE)
        hits, misses, entries, _, disk_hits, disk_entries, *_ = tiers.totals(0)
        assert (hits, misses, entries, disk_hits, disk_entries) == (0, 4, 4, 0, 4)  # the disk fields add up both
        assert tiers.follow([0, 2])[0] == 2  # every tier follows: 1 and 3 evicted, one from each disk
        assert [tiers.find(i) is not None for i in range(4)] == [True, False, True, False]
    finally:
        paths = [arena.path for arena in tiers.arenas]
        tiers.close()
    assert not any(os.path.exists(path) for path in paths)
