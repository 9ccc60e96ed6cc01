"""Resuming an epoch on another world size: the restripe maths, the sampler's state, and the Engine handler.

Everything here runs in one process: a world of R ranks is R sampler objects (and R engines), which is exact
because the sampler's outputs depend only on its arguments and state. The real gloo worlds, killed and resumed,
are in test_sampler_resume_distributed.py.
"""

from __future__ import annotations

import pickle
from collections import Counter
from collections.abc import Iterator
from itertools import pairwise
from typing import Any, NamedTuple

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from ignite.engine import Engine, Events
from torch.utils.data import DataLoader

from ignite_ext.data import ShardedDistributedSampler
from ignite_ext.data.sampler import (
    Layout,
    SamplerHandler,
    Segment,
    node_shard_indices,
    restripe,
    shard_bounds,
    shard_indices,
    unconsumed_indices,
)
from ignite_ext.data.sampler.mixing import mixed_shards

FAST = settings(deadline=None, max_examples=80, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def layouts(draw: st.DrawFn, max_ranks: int = 9) -> Layout:
    ranks = draw(st.integers(1, max_ranks))
    divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
    if draw(st.booleans()):
        return Layout(ranks, "node", draw(st.sampled_from(divisors)))
    return Layout(ranks)


def ranks_of(layout: Layout) -> list[tuple[int, int]]:
    return [(shard, local) for shard in range(layout.shards) for local in range(layout.nproc_per_node)]


class World(NamedTuple):
    layout: Layout
    pool: int  # how many indices it had to deal
    length: int  # how many each of its ranks yields
    consumed: int  # how many each of its ranks consumed


def epoch_over(n: int, worlds: list[Layout], cuts: list[float], **kw: Any) -> tuple[list[int], list[World]]:
    """Run one epoch over ``worlds``: every rank of world i consumes ``cuts[i]`` of its order, the last world runs
    to its end. A world that consumed nothing leaves no segment (the rule of the saved state)."""
    yielded: list[int] = []
    segments: list[Segment] = []
    ran: list[World] = []
    for number, layout in enumerate(worlds):
        pool = len(unconsumed_indices(n, segments, **kw))
        orders = [restripe(n, segments, layout, shard, local, **kw) for shard, local in ranks_of(layout)]
        assert len({len(o) for o in orders}) == 1  # the lockstep: every rank of a world yields as many
        length = len(orders[0])
        assert length == layout.length(pool, kw["drop_last"])
        consumed = length if number == len(worlds) - 1 else int(cuts[number] * length)
        yielded += [i for o in orders for i in o[:consumed]]
        ran.append(World(layout, pool, length, consumed))
        if consumed:
            segments.append(Segment(layout, consumed))
    return yielded, ran


# --- the restripe maths ---------------------------------------------------------------------------------------------


@FAST
@given(
    n=st.integers(0, 400),
    worlds=st.lists(layouts(), min_size=2, max_size=4),
    cuts=st.lists(st.floats(0, 1), min_size=3, max_size=3),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 1000),
    mix=st.sampled_from([0.0, 0.05, 0.25, 1.0]),
)
def test_an_epoch_over_several_worlds_yields_every_sample_once_up_to_padding(
    n: int, worlds: list[Layout], cuts: list[float], drop_last: bool, shuffle: bool, seed: int, epoch: int, mix: float
) -> None:
    kw = {"seed": seed, "epoch": epoch, "drop_last": drop_last, "shuffle": shuffle, "mix": mix}
    yielded, ran = epoch_over(n, worlds, cuts, **kw)
    assert_once_up_to_padding(n, yielded, ran, drop_last)


def assert_once_up_to_padding(n: int, yielded: list[int], ran: list[World], drop_last: bool) -> None:
    """What an epoch over the worlds ``ran`` yielded is every sample once, but for each world's padding (or, with
    ``drop_last``, the trim of the world that finished the epoch)."""
    counts = Counter(yielded)
    if not drop_last:
        assert set(counts) == set(range(n))  # every sample, in every case
        # repeats are padding only: at most R * L - M of each world, which is at most R - 1
        assert len(yielded) - n <= sum(w.layout.num_replicas * w.length - w.pool for w in ran)
        assert all(w.layout.num_replicas * w.length - w.pool <= w.layout.num_replicas - 1 for w in ran)
    else:
        assert max(counts.values(), default=1) == 1  # never a sample twice
        # What a world left out goes back into the pool of the next, so only the trim of the world that
        # finished the epoch is missing: at most R - 1 samples.
        last = next(w for w in ran if w.consumed == w.length and (w.consumed or w is ran[-1]))
        assert n - len(yielded) == last.pool - last.layout.num_replicas * last.length
        assert n - len(yielded) <= last.layout.num_replicas - 1


@FAST
@given(n=st.integers(0, 300), layout=layouts(), drop_last=st.booleans(), shuffle=st.booleans(),
       seed=st.integers(0, 99), epoch=st.integers(0, 99))  # fmt: skip
def test_no_segments_is_the_fresh_epoch(
    n: int, layout: Layout, drop_last: bool, shuffle: bool, seed: int, epoch: int
) -> None:
    kw = {"seed": seed, "epoch": epoch, "drop_last": drop_last, "shuffle": shuffle}
    for shard, local in ranks_of(layout):
        if layout.shard_by == "rank":
            fresh = shard_indices(n, layout.num_replicas, shard, **kw)
        else:
            fresh = node_shard_indices(n, layout.shards, shard, layout.nproc_per_node, local, **kw)
        assert restripe(n, [], layout, shard, local, **kw) == fresh


@FAST
@given(n=st.integers(1, 300), old=layouts(), new=layouts(), cut=st.floats(0, 0.99), seed=st.integers(0, 99))
def test_restripe_is_deterministic_and_independent_of_the_old_rank_numbering(
    n: int, old: Layout, new: Layout, cut: float, seed: int
) -> None:
    kw = {"seed": seed, "epoch": 3, "drop_last": False, "shuffle": True}
    segments = [Segment(old, int(cut * old.length(n, False)))]
    first = [restripe(n, segments, new, s, local, **kw) for s, local in ranks_of(new)]
    again = [restripe(n, list(segments), new, s, local, **kw) for s, local in ranks_of(new)]
    assert first == again
    pool = unconsumed_indices(n, segments, **kw)
    assert pool == sorted(pool) and len(set(pool)) == len(pool)
    if pool:
        assert set().union(*map(set, first)) == set(pool)


@FAST
@given(
    new_ranks=st.integers(1, 6),
    factor=st.integers(2, 4),
    n=st.integers(24, 3000),
    cut=st.floats(0, 0.95),
    drop_last=st.booleans(),
    seed=st.integers(0, 99),
)
def test_a_share_lies_within_the_new_shard_when_the_old_world_is_a_multiple(
    new_ranks: int, factor: int, n: int, cut: float, drop_last: bool, seed: int
) -> None:
    old, new = Layout(new_ranks * factor), Layout(new_ranks)
    kw = {"seed": seed, "epoch": 1, "drop_last": drop_last, "shuffle": True}
    segments = [Segment(old, int(cut * old.length(n, drop_last)))]
    for rank in range(new_ranks):
        start, stop = shard_bounds(n, new_ranks, rank)
        outside = [i for i in restripe(n, segments, new, rank, **kw) if not start <= i < stop]
        assert len(outside) <= 2 * factor  # the guide's bound: block rounding, a few samples at each end


def test_a_segment_consumed_to_its_end_finishes_the_epoch() -> None:
    kw: dict[str, Any] = {"seed": 0, "epoch": 2, "drop_last": True, "shuffle": True}
    assert unconsumed_indices(10, [Segment(Layout(3), 3)], **kw) == []  # sample left out by the trim stays out
    assert len(unconsumed_indices(10, [Segment(Layout(3), 2)], **kw)) == 4  # ...unless the epoch goes on
    with pytest.raises(ValueError, match=r"consumed=4, but its ranks yield only 3"):
        unconsumed_indices(10, [Segment(Layout(3), 4)], **kw)


def test_a_worked_example() -> None:
    before = [Segment(Layout(4), 2)]
    kw: dict[str, Any] = {"seed": 0, "epoch": 0, "drop_last": False, "shuffle": False}
    assert unconsumed_indices(12, before, **kw) == [2, 5, 8, 11]
    assert [restripe(12, before, Layout(2), r, **kw) for r in range(2)] == [[2, 5], [8, 11]]
    assert [restripe(12, before, Layout(3), r, **kw) for r in range(3)] == [
        [2, 5],
        [8, 8],
        [11, 11],
    ]  # short blocks pad with their own


# --- the sampler's state --------------------------------------------------------------------------------------------


def world_of(n: int, layout: Layout, **kw: Any) -> list[ShardedDistributedSampler]:
    node = {"shard_by": "node", "nnodes": layout.shards} if layout.shard_by == "node" else {}
    return [ShardedDistributedSampler(range(n), num_replicas=layout.num_replicas, rank=r, **node, **kw)
            for r in range(layout.num_replicas)]  # fmt: skip


@FAST
@given(
    n=st.integers(0, 250),
    worlds=st.lists(layouts(8), min_size=2, max_size=3),
    cuts=st.lists(st.floats(0, 1), min_size=2, max_size=2),
    drop_last=st.booleans(),
    epoch=st.integers(0, 50),
    seed=st.integers(0, 2**20),
)
def test_samplers_resumed_on_other_worlds_realise_the_maths_and_then_keep_the_new_shards(
    n: int, worlds: list[Layout], cuts: list[float], drop_last: bool, epoch: int, seed: int
) -> None:
    resume_across_worlds(n, worlds, cuts, drop_last, epoch, seed, mix=0.0)


@FAST
@given(
    n=st.integers(0, 250),
    worlds=st.lists(layouts(8), min_size=2, max_size=3),
    cuts=st.lists(st.floats(0, 1), min_size=2, max_size=2),
    drop_last=st.booleans(),
    epoch=st.integers(0, 50),
    seed=st.integers(0, 2**20),
    mix=st.sampled_from([0.05, 0.25, 1.0]),
)
def test_mixing_samplers_resumed_on_other_worlds_see_the_epoch_once_and_mix_on_from_there(
    n: int, worlds: list[Layout], cuts: list[float], drop_last: bool, epoch: int, seed: int, mix: float
) -> None:
    resume_across_worlds(n, worlds, cuts, drop_last, epoch, seed, mix=mix)


def resume_across_worlds(
    n: int, worlds: list[Layout], cuts: list[float], drop_last: bool, epoch: int, seed: int, mix: float
) -> None:
    """An epoch run over ``worlds`` by real samplers, each world loading the state of the one before: what they
    yield is what the maths says, and the next epoch deals the last world's shards of that epoch (fixed, or mixed
    on the same ``(seed, epoch)`` schedule)."""
    assume(all(a != b for a, b in pairwise(worlds)))  # the same world again continues the segment, unrestriped
    kw: dict[str, Any] = {"seed": seed, "drop_last": drop_last, "mix": mix}
    yielded: list[int] = []
    state: dict[str, Any] | None = None
    for number, layout in enumerate(worlds):
        samplers = world_of(n, layout, **kw)
        for sampler in samplers:
            sampler.set_epoch(epoch)
            if state is not None:
                sampler.load_state_dict(state)
                sampler.set_epoch(epoch)  # an EPOCH_STARTED handler: the same epoch keeps the loaded position
        orders = [sampler.remaining_indices() for sampler in samplers]
        assert len({len(o) for o in orders}) <= 1 and all(len(o) <= len(samplers[0]) for o in orders)
        last = number == len(worlds) - 1
        take = len(orders[0]) if last else int(cuts[number] * len(orders[0]))
        for sampler, order in zip(samplers, orders, strict=True):
            it = iter(sampler)
            got = [next(it) for _ in range(take)]
            assert got == order[:take]
            yielded += got
        states = [sampler.state_dict() for sampler in samplers]
        assert all(s == states[0] for s in states)  # rank 0's copy stands for every rank
        state = states[0]
    expected, ran = epoch_over(n, worlds, cuts, epoch=epoch, shuffle=True, **kw)
    assert sorted(yielded) == sorted(expected)
    assert_once_up_to_padding(n, yielded, ran, drop_last)  # the maths above could share a sampler's mistake
    # the next epoch: the last world's shards (fixed, or that epoch's mixed ones), whole
    for sampler in samplers:
        sampler.set_epoch(epoch + 1)
        assert sampler.state_dict()["history"] == []
        assert list(sampler) == sampler.indices(epoch + 1)
        if n >= sampler.num_shards:
            shard = mixed_shards(n, sampler.num_shards, seed, epoch + 1, mix)[sampler.shard]
            assert set(sampler.indices(epoch + 1)) <= set(shard)
            if mix == 0.0:
                start, stop = shard_bounds(n, sampler.num_shards, sampler.shard)
                assert shard == list(range(start, stop))


@pytest.mark.parametrize("mix", [0.0, 0.05, 0.25, 1.0])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("epoch", range(8))
def test_a_chain_of_restripes_with_mixing_sees_every_sample_once_at_every_epoch(
    epoch: int, drop_last: bool, mix: float
) -> None:
    # The reported chain (4 ranks, then 3, then 2, within one epoch): with mixed shards the second restripe
    # replayed the first from segment 0's pool order instead of the order it was dealt in (142 samples lost).
    n, worlds, takes = 1001, [Layout(4), Layout(3), Layout(2)], (112, 80)
    yielded: list[int] = []
    state: dict[str, Any] | None = None
    ran: list[World] = []
    for number, layout in enumerate(worlds):
        samplers = world_of(n, layout, seed=5, mix=mix, drop_last=drop_last)
        for sampler in samplers:
            sampler.set_epoch(epoch)
            if state is not None:
                sampler.load_state_dict(state)
        length = len(samplers[0].remaining_indices())
        take = length if number == len(worlds) - 1 else takes[number]
        pool = n - len(set(yielded))  # what no rank consumed yet
        for sampler in samplers:
            it = iter(sampler)
            yielded += [next(it) for _ in range(take)]
        ran.append(World(layout, pool, length, take))
        state = samplers[0].state_dict()
    assert_once_up_to_padding(n, yielded, ran, drop_last)
    assert n - len(set(yielded)) <= 1


def test_state_grows_by_one_small_entry_per_world_and_holds_no_indices() -> None:
    n = 200_000
    old = ShardedDistributedSampler(range(n), num_replicas=8, rank=0)
    mid = ShardedDistributedSampler(range(n), num_replicas=4, rank=0)
    mid.load_state_dict(old.state_dict(consumed=1000))
    state = mid.state_dict(consumed=500)
    assert state["history"] == [{"num_replicas": 8, "shard_by": "rank", "num_shards": 8, "consumed": 1000}]
    assert len(pickle.dumps(state)) < 600
    new = ShardedDistributedSampler(range(n), num_replicas=3, rank=2, shard_by="node", nnodes=3)
    new.load_state_dict(state)
    assert [h["num_replicas"] for h in new.state_dict()["history"]] == [8, 4]
    assert len(new.remaining_indices()) == -(-(n - 8 * 1000 - 4 * 500) // 3)


def test_a_world_that_consumed_nothing_leaves_no_trace() -> None:
    old = ShardedDistributedSampler(range(90), num_replicas=3, rank=0)
    mid = ShardedDistributedSampler(range(90), num_replicas=2, rank=0)
    mid.load_state_dict(old.state_dict(consumed=10))
    new = ShardedDistributedSampler(range(90), num_replicas=5, rank=0)
    new.load_state_dict(mid.state_dict(consumed=0))  # preempted again before its first batch
    assert [h["num_replicas"] for h in new.state_dict()["history"]] == [3]


def test_remaining_indices_follow_the_passes() -> None:
    old = ShardedDistributedSampler(range(40), num_replicas=4, rank=0, seed=1)
    new = ShardedDistributedSampler(range(40), num_replicas=2, rank=1, seed=1)
    new.load_state_dict(old.state_dict(consumed=4))
    share = new.remaining_indices()
    assert len(share) == 12 and new.state_dict()["consumed"] == 0
    it = iter(new)
    assert [next(it) for _ in range(5)] == share[:5]
    assert new.state_dict()["consumed"] == 5 and new.state_dict()["history"][0]["consumed"] == 4
    assert new.remaining_indices() == new.indices()  # the next pass is a whole epoch of the new world
    again = ShardedDistributedSampler(range(40), num_replicas=2, rank=1, seed=1)
    again.load_state_dict(new.state_dict())  # the same world: the restriped pass continues where it was
    assert again.remaining_indices() == share[5:]
    new.set_consumed(99)
    assert new.state_dict()["consumed"] == 12  # capped at the pass's length, not len(sampler) == 20


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"epoch": 0, "consumed": 11, "num_replicas": 2, "num_shards": 2}, "more than the 10 indices"),
        ({"epoch": 0, "consumed": 3, "num_replicas": 4, "history": "x"}, "history must be a list"),
        ({"epoch": 0, "consumed": 3, "num_replicas": 4, "history": [{"consumed": 1}]}, "needs num_replicas"),
        ({"epoch": 0, "consumed": 0, "num_replicas": 3, "num_shards": 3,
          "history": [{"num_replicas": 4, "shard_by": "rank", "num_shards": 4, "consumed": 9}]},
         "segment 0 .* consumed=9, but its ranks yield only 5"),
        ({"epoch": 0, "consumed": 1, "num_replicas": 3, "shard_by": "node", "num_shards": 2}, "not a multiple"),
        ({"epoch": 0, "consumed": 1, "num_replicas": 2, "shard_by": "host"}, "shard_by must be one of"),
    ],
)  # fmt: skip
def test_states_no_world_could_have_written_are_refused(state: dict[str, Any], match: str) -> None:
    sampler = ShardedDistributedSampler(range(20), num_replicas=2, rank=0)
    with pytest.raises(ValueError, match=match):
        sampler.load_state_dict(state)
    assert sampler.remaining_indices() == sampler.indices()


# --- the Engine handler, one engine per rank ------------------------------------------------------------------------


def run_engines(
    n: int,
    layout: Layout,
    batch: int,
    saved: tuple[dict[str, Any], dict[str, Any]] | None,
    stop_at: int | None,
    max_epochs: int,
) -> tuple[list[list[tuple[int, list[int]]]], tuple[dict[str, Any], dict[str, Any]], list[Engine]]:
    """Every rank's (engine epoch, batch) records; rank 0's engine and sampler states at the stop."""
    records: list[list[tuple[int, list[int]]]] = []
    engines, samplers = [], []
    for sampler in world_of(n, layout, seed=5):
        loader = DataLoader(range(n), batch_size=batch, sampler=sampler)
        seen: list[tuple[int, list[int]]] = []
        engine = Engine(lambda engine, b, seen=seen: seen.append((engine.state.epoch, b.tolist())))
        SamplerHandler(sampler, loader).attach(engine)
        if stop_at is not None:
            engine.add_event_handler(Events.ITERATION_COMPLETED(once=stop_at), lambda engine: engine.terminate())
        if saved is not None:
            engine.load_state_dict(saved[0])
            sampler.load_state_dict(saved[1])
        engine.run(loader, max_epochs=max_epochs)
        records.append(seen)
        engines.append(engine)
        samplers.append(sampler)
    return records, (engines[0].state_dict(), samplers[0].state_dict()), engines


@pytest.mark.parametrize(
    ("n", "old", "new", "batch", "stop_at"),
    [
        (100, Layout(4), Layout(2), 4, 3),  # 4 -> 2: an even split
        (100, Layout(4), Layout(3), 4, 3),  # 4 -> 3: uneven, the new world pads
        (97, Layout(2), Layout(4, "node", 2), 5, 6),  # more ranks, node shards, short batches
        (64, Layout(4, "node", 2), Layout(1), 3, 14),  # the second epoch, down to one rank
    ],
)
def test_engines_resumed_on_another_world_see_the_epoch_once_and_count_its_batches(
    n: int, old: Layout, new: Layout, batch: int, stop_at: int
) -> None:
    before, saved, _ = run_engines(n, old, batch, None, stop_at, max_epochs=3)
    epoch = saved[1]["epoch"]  # 0-based epoch of the stop
    after, _, engines = run_engines(n, new, batch, saved, None, max_epochs=3)
    seen = [i for rank in before for e, b in rank if e == epoch + 1 for i in b]
    seen += [i for rank in after for e, b in rank if e == epoch + 1 for i in b]
    assert set(seen) == set(range(n))
    kw: dict[str, Any] = {"seed": 5, "epoch": epoch, "drop_last": False, "shuffle": True}
    segments = [Segment(old, saved[1]["consumed"])]
    expected = [
        i for shard, local in ranks_of(old) for i in restripe(n, [], old, shard, local, **kw)[: segments[0].consumed]
    ]
    expected += [i for shard, local in ranks_of(new) for i in restripe(n, segments, new, shard, local, **kw)]
    assert Counter(seen) == Counter(expected)  # the pure maths, realised by engines that were stopped and resumed
    assert len(seen) - n <= (old.num_replicas - 1) + (new.num_replicas - 1)  # padding only
    per_epoch = -(-new.length(n, False) // batch)
    for engine, rank in zip(engines, after, strict=True):
        assert engine.state.epoch == 3 and engine.state.epoch_length == per_epoch
        assert engine.state.iteration == 3 * per_epoch  # the count of a run that always had this world
        for e in range(epoch + 2, 4):  # the later epochs: the new world's fixed shards, whole
            assert sum(len(b) for ep, b in rank if ep == e) == new.length(n, False)
    for e in range(epoch + 2, 4):
        assert sorted(i for rank in after for ep, b in rank if ep == e for i in b) == sorted(
            i for sampler in world_of(n, new, seed=5) for i in sampler.indices(e - 1)
        )


def test_engine_checkpoint_at_the_end_of_an_epoch_starts_the_next_on_the_new_world() -> None:
    _, saved, _ = run_engines(48, Layout(4), 4, None, 3, max_epochs=2)  # 3 batches per epoch: the end
    assert saved[0]["iteration"] == 3 and saved[1]["consumed"] == 12
    after, _, engines = run_engines(48, Layout(2), 4, saved, None, max_epochs=2)
    assert all(e == 2 for rank in after for e, _ in rank)  # nothing of epoch 1 again
    assert engines[0].state.iteration == 12 and engines[0].state.epoch_length == 6


def test_handler_needs_one_engine_epoch_per_pass_and_its_own_loader() -> None:
    sampler = ShardedDistributedSampler(range(20), num_replicas=2, rank=0)
    loader = DataLoader(range(20), batch_size=4, sampler=sampler)
    engine = Engine(lambda engine, b: None)
    SamplerHandler(sampler, loader).attach(engine)
    with pytest.raises(ValueError, match="one engine epoch per pass"):
        engine.run(loader, max_epochs=1, epoch_length=2)
    with pytest.raises(ValueError, match="does not draw its indices from this sampler"):
        SamplerHandler(sampler, DataLoader(range(20), batch_size=4))
    with pytest.raises(ValueError, match="batch_size"):
        SamplerHandler(sampler, DataLoader(range(20), batch_size=None, sampler=sampler))


@pytest.mark.distributed  # DataLoader worker processes
def test_handler_counts_what_the_loop_took_however_far_the_workers_prefetch() -> None:
    class Counting(ShardedDistributedSampler):
        handed = 0

        def __iter__(self) -> Iterator[int]:
            for idx in super().__iter__():
                self.handed += 1
                yield idx

    sampler = Counting(range(200), num_replicas=2, rank=0, seed=9)
    loader = DataLoader(range(200), batch_size=5, sampler=sampler, num_workers=2, prefetch_factor=4)
    states: list[tuple[int, int]] = []
    engine = Engine(lambda engine, b: None)
    SamplerHandler(sampler, loader).attach(engine)

    @engine.on(Events.ITERATION_COMPLETED)
    def _save(engine: Engine) -> None:  # after the handler or before it: the count is already there
        states.append((sampler.state_dict()["consumed"], sampler.handed))

    engine.run(loader, max_epochs=1)
    assert [c for c, _ in states] == [5 * k for k in range(1, 21)]
    assert any(y > c for c, y in states)  # the workers did run ahead of the loop


def test_the_guides_figure_a_4_to_3_share_halfway_lies_in_the_new_shard() -> None:
    n, old, new = 10_000, Layout(4), Layout(3)
    segments = [Segment(old, old.length(n, False) // 2)]
    inside = total = 0
    for rank in range(3):
        share = set(restripe(n, segments, new, rank, seed=1, epoch=0, drop_last=False, shuffle=True))
        start, stop = shard_bounds(n, 3, rank)
        inside += len({i for i in share if start <= i < stop})
        total += len(share)
    assert inside / total >= 0.995
