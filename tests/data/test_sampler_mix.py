"""Shards that mix (``ShardedDistributedSampler(mix=f)``): the invariants of the index maths, as property tests.

Each epoch every sample is in exactly one shard, every shard keeps its size, the moving part is exactly the chosen
cohorts (``f`` rounded to whole cohorts) and every moving sample changes shard; ranks yield their shard's samples,
covering the dataset once per epoch up to the padding; ``mix=0`` is the fixed shards. Resuming on other worlds
with mixing is in test_sampler_resume.py (``resume_across_worlds``).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ignite_ext.data import ShardedDistributedSampler
from ignite_ext.data.sampler import shard_bounds, shard_indices
from ignite_ext.data.sampler.mixing import MIX_COHORTS, epoch_pool, mixed_shards, moving_cohorts

FAST = settings(deadline=None, max_examples=60, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
MIXES = st.sampled_from([0.0, 0.01, 0.05, 0.25, 0.5, 1.0])


def cohort_sizes(n: int, shards: int) -> list[int]:
    """How many samples cohort ``c`` has in each shard: the core's positions ``j`` with ``j % C == c``."""
    core = n // shards
    cohorts = min(core, MIX_COHORTS)
    return [len(range(c, core, cohorts)) for c in range(cohorts)]


@FAST
@given(
    n=st.integers(0, 3000), shards=st.integers(1, 9), seed=st.integers(0, 2**32), epoch=st.integers(0, 40), mix=MIXES
)
def test_every_epoch_the_shards_partition_the_dataset_and_keep_their_sizes(
    n: int, shards: int, seed: int, epoch: int, mix: float
) -> None:
    got = mixed_shards(n, shards, seed, epoch, mix)
    assert sorted(i for shard in got for i in shard) == list(range(n))
    for s, shard in enumerate(got):
        start, stop = shard_bounds(n, shards, s)
        assert len(shard) == stop - start and shard == sorted(shard)
    if mix == 0.0 or epoch == 0 or shards == 1:
        assert got == [list(range(*shard_bounds(n, shards, s))) for s in range(shards)]
    pool = epoch_pool(n, shards, seed, epoch, mix)
    assert [list(pool[slice(*shard_bounds(n, shards, s))]) for s in range(shards)] == got


@FAST
@given(
    n=st.integers(2, 6000), shards=st.integers(2, 9), seed=st.integers(0, 2**32), epoch=st.integers(1, 40), mix=MIXES
)
def test_the_churn_is_exactly_the_chosen_cohorts_and_every_mover_changes_shard(
    n: int, shards: int, seed: int, epoch: int, mix: float
) -> None:
    before = [set(s) for s in mixed_shards(n, shards, seed, epoch - 1, mix)]
    after = [set(s) for s in mixed_shards(n, shards, seed, epoch, mix)]
    chosen = moving_cohorts(n, shards, seed, epoch, mix)
    sizes = cohort_sizes(n, shards)
    moved = sum(sizes[c] for c in chosen)
    for old, new in zip(before, after, strict=True):
        assert len(old - new) == len(new - old) == moved  # the same in every shard, and nothing else moves
    core = n // shards
    if mix > 0.0 and core > 0:
        cohorts = len(sizes)
        assert len(chosen) == max(1, round(mix * cohorts))
        # the asked fraction, rounded to whole cohorts: each of floor(core / C) or ceil(core / C) samples (when C
        # does not divide the core, which cohorts move decides which of the two sizes they have)
        assert abs(len(chosen) - mix * cohorts) <= 0.5 or len(chosen) == 1
        assert len(chosen) * (core // cohorts) <= moved <= len(chosen) * math.ceil(core / cohorts)
    else:
        assert moved == 0


@settings(deadline=None, max_examples=8, derandomize=True)
@given(shards=st.integers(3, 8), seed=st.integers(0, 2**32), mix=st.sampled_from([0.05, 0.25]))
def test_a_shard_is_renewed_over_about_one_over_mix_epochs(shards: int, seed: int, mix: float) -> None:
    n = shards * MIX_COHORTS * 2
    origin = [set(range(*shard_bounds(n, shards, s))) for s in range(shards)]
    # After 4/f epochs a cohort has moved 4 times on average and its random walk over the shards is close to
    # uniform: a shard keeps about 1/S of what it started with (a cohort stays put with probability (1-f)^(4/f),
    # under 2 %), 1,024 cohorts make the fraction's noise about 1.5 %; the margin is 10 %.
    later = mixed_shards(n, shards, seed, math.ceil(4 / mix), mix)
    for s in range(shards):
        kept = len(origin[s] & set(later[s])) / len(origin[s])
        assert kept <= 1 / shards + 0.10, (s, kept)
    # ... while one epoch keeps 1 - f of it, the part a cache keeps hitting on
    one = mixed_shards(n, shards, seed, 1, mix)
    assert all(abs(len(origin[s] & set(one[s])) / len(origin[s]) - (1 - mix)) < 0.01 for s in range(shards))


@FAST
@given(
    n=st.integers(0, 800),
    ranks=st.integers(1, 8),
    by_node=st.booleans(),
    seed=st.integers(0, 2**20),
    epoch=st.integers(0, 30),
    mix=MIXES,
    drop_last=st.booleans(),
)
def test_ranks_yield_their_mixed_shard_and_cover_the_epoch_once_up_to_the_padding(
    n: int, ranks: int, by_node: bool, seed: int, epoch: int, mix: float, drop_last: bool
) -> None:
    node = {"shard_by": "node", "nnodes": 2 if ranks % 2 == 0 else 1} if by_node else {}
    samplers = [
        ShardedDistributedSampler(range(n), num_replicas=ranks, rank=r, seed=seed, mix=mix, drop_last=drop_last, **node)  # type: ignore[arg-type]
        for r in range(ranks)
    ]
    shards = mixed_shards(n, samplers[0].num_shards, seed, epoch, mix)
    yielded: list[int] = []
    for sampler in samplers:
        sampler.set_epoch(epoch)
        order = list(sampler)
        assert len(order) == len(sampler)
        if n >= sampler.num_shards:
            assert set(order) <= set(shards[sampler.shard])  # a permutation of its shard, padded with its own
        yielded += order
    counts = Counter(yielded)
    if drop_last:
        assert max(counts.values(), default=1) == 1 and n - len(yielded) < ranks
    else:
        assert set(counts) == set(range(n)) and len(yielded) - n < ranks


@FAST
@given(n=st.integers(0, 500), ranks=st.integers(1, 6), seed=st.integers(0, 99), epoch=st.integers(0, 20))
def test_mix_zero_is_the_fixed_shards(n: int, ranks: int, seed: int, epoch: int) -> None:
    for r in range(ranks):
        sampler = ShardedDistributedSampler(range(n), num_replicas=ranks, rank=r, seed=seed, mix=0.0)
        assert sampler.indices(epoch) == shard_indices(n, ranks, r, seed=seed, epoch=epoch)


def test_the_schedule_depends_on_seed_and_epoch_only_in_any_order_of_calls() -> None:
    n, shards = 5000, 4
    forward = [mixed_shards(n, shards, 3, e, 0.25) for e in range(12)]
    backward = [mixed_shards(n, shards, 3, e, 0.25) for e in reversed(range(12))][::-1]
    assert forward == backward
    assert mixed_shards(n, shards, 4, 11, 0.25) != forward[11]  # another seed, another schedule
    assert forward[11] != forward[10]


@pytest.mark.parametrize(
    ("mix", "error"),
    [(-0.1, ValueError), (1.5, ValueError), (math.nan, ValueError), ("0.1", TypeError), (True, TypeError)],
)
def test_a_bad_mix_is_refused_by_the_sampler(mix: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="mix must be"):
        ShardedDistributedSampler(range(10), num_replicas=2, rank=0, mix=mix)  # type: ignore[arg-type]


def test_a_state_saved_with_another_mix_is_refused_and_an_old_state_mixed_nothing() -> None:
    mixing = ShardedDistributedSampler(range(100), num_replicas=2, rank=0, mix=0.25)
    fixed = ShardedDistributedSampler(range(100), num_replicas=2, rank=0)
    with pytest.raises(ValueError, match=r"saved with mix=0\.0, this sampler has mix=0\.25"):
        mixing.load_state_dict(fixed.state_dict())
    old = {k: v for k, v in fixed.state_dict(consumed=3).items() if k != "mix"}  # as written before 0.4.0
    fixed.load_state_dict(old)
    with pytest.raises(ValueError, match="mix"):
        mixing.load_state_dict(old)
