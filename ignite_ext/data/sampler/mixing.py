"""Shards that mix: each epoch a fraction of every shard moves to other shards, as pure index maths.

Fixed shards keep a cache hitting but train every rank (or node) on the same subset for ever; a full reshuffle each
epoch mixes but leaves a cache almost nothing to hit. With ``mix=f`` the shards start as the fixed, contiguous
blocks of :func:`~ignite_ext.data.sampler.indices.shard_bounds` and, each epoch, about a fraction ``f`` of every
shard is exchanged with the other shards, so that a shard's content is renewed over about ``1/f`` epochs while a
cache keeps hitting on the ``1 - f`` that stayed.

How. The ``n // S`` *core* samples of each of the ``S`` shards are cut into ``C = min(n // S, MIX_COHORTS)``
*cohorts* (position ``j`` of a seeded permutation of the shard's core goes to cohort ``j % C``), so that cohort
``c`` has one *block* of the same size in every shard. Every block of a cohort sits in the shard its origin plus
the cohort's *offset* (mod ``S``) names, all offsets 0 in epoch 0. Each epoch ``k = round(f * C)`` cohorts (at
least one when ``f > 0``) drawn from ``(seed, epoch)`` move: their offset grows by a step drawn from ``1 .. S-1``.
Hence, in every epoch and on every rank alike, without communication:

* every shard has exactly the size it has without mixing (each holds one block of every cohort, plus the one
  extra sample a shard of ``n // S + 1`` keeps), and every sample is in exactly one shard;
* the moving samples are exactly the chosen cohorts' blocks, and every one of them changes shard: the churn is
  ``f`` rounded to whole cohorts (a cohort is ``1/C`` of a shard's core to one sample), the same in every shard;
* a cohort's offset is a random walk over the shards: over epochs every sample visits every shard.

Cost: ``O(n log n)`` per epoch and rank for the arrangement, plus ``O(epoch * C)`` to replay the offsets (a few
milliseconds at epoch 1,000; the last epoch's offsets are kept, so consecutive epochs replay one step).

.. versionadded:: 0.4.0
"""

from __future__ import annotations

import hashlib
import math
import threading

import torch

from ignite_ext.data.sampler.indices import check_int, shard_bounds

__all__ = ["MIX_COHORTS", "check_mix", "epoch_pool", "mixed_shards", "moving_cohorts"]

#: The most cohorts a shard's core is cut into: the granularity of the churn (and the cost of replaying it).
MIX_COHORTS = 1024

# The last offsets computed, per (seed, shards, cohorts, moving): consecutive epochs replay one step, not all.
_OFFSETS: dict[tuple[int, int, int, int], tuple[int, torch.Tensor]] = {}
_OFFSETS_LOCK = threading.Lock()


def check_mix(mix: object) -> float:
    """``mix`` as a float in ``[0, 1]``, or ``TypeError``/``ValueError`` saying what it must be.

    Examples:
        >>> from ignite_ext.data.sampler.mixing import check_mix
        >>> check_mix(0.25)
        0.25
        >>> check_mix(1.5)
        Traceback (most recent call last):
        ...
        ValueError: mix must be a fraction in [0, 1] (the part of every shard exchanged each epoch), got 1.5

    .. versionadded:: 0.4.0
    """
    if isinstance(mix, bool) or not isinstance(mix, int | float):
        raise TypeError(f"mix must be a float in [0, 1], got {type(mix).__name__}: {mix!r}")
    value = float(mix)
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"mix must be a fraction in [0, 1] (the part of every shard exchanged each epoch), got {mix}")
    return value


def _generator(*key: object) -> torch.Generator:
    digest = hashlib.blake2b(":".join(map(str, key)).encode(), digest_size=8).digest()
    generator = torch.Generator()
    generator.manual_seed(int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF)
    return generator


def _cohorts(n: int, num_shards: int) -> int:
    return min(n // num_shards, MIX_COHORTS)


def _moving(cohorts: int, mix: float) -> int:
    return 0 if mix == 0.0 or cohorts == 0 else max(1, min(cohorts, round(mix * cohorts)))


def moving_cohorts(n: int, num_shards: int, seed: int, epoch: int, mix: float) -> list[int]:
    """Return the cohorts that move into ``epoch`` (none in epoch 0), sorted: ``round(mix * C)`` of ``C``.

    Examples:
        >>> from ignite_ext.data.sampler.mixing import moving_cohorts
        >>> len(moving_cohorts(4000, 4, seed=0, epoch=3, mix=0.25)), moving_cohorts(4000, 4, 0, 0, 0.25)
        (250, [])

    .. versionadded:: 0.4.0
    """
    cohorts = _cohorts(n, num_shards)
    moving = _moving(cohorts, check_mix(mix))
    if epoch == 0 or moving == 0:
        return []
    return sorted(torch.randperm(cohorts, generator=_generator("mix", seed, epoch))[:moving].tolist())


def _offsets(num_shards: int, cohorts: int, moving: int, seed: int, epoch: int) -> torch.Tensor:
    """Every cohort's offset in ``epoch``: the sum of its steps (each in ``1 .. S-1``), mod ``S``."""
    key = (seed, num_shards, cohorts, moving)
    with _OFFSETS_LOCK:
        done, offsets = _OFFSETS.get(key, (0, torch.zeros(cohorts, dtype=torch.int64)))
    if done > epoch:
        done, offsets = 0, torch.zeros(cohorts, dtype=torch.int64)
    offsets = offsets.clone()
    for step in range(done + 1, epoch + 1):
        generator = _generator("mix", seed, step)
        chosen = torch.randperm(cohorts, generator=generator)[:moving]
        offsets[chosen] += 1 + torch.randint(0, num_shards - 1, (moving,), generator=generator)
        offsets %= num_shards
    with _OFFSETS_LOCK:
        _OFFSETS[key] = (epoch, offsets)
    return offsets


def mixed_shards(n: int, num_shards: int, seed: int, epoch: int, mix: float) -> list[list[int]]:
    """Return every shard's samples in ``epoch`` with mixing ``mix``, each shard ascending.

    ``mix=0`` (or a single shard, or shards too small to cut) gives the fixed contiguous shards of
    :func:`~ignite_ext.data.sampler.indices.shard_bounds` in every epoch, and so does ``epoch=0`` for any ``mix``.

    Args:
        n: dataset size, ``>= 0``.
        num_shards: number of shards ``S``, ``>= 1``.
        seed: base seed, the same everywhere.
        epoch: epoch number, ``>= 0``.
        mix: the fraction of every shard exchanged each epoch, in ``[0, 1]``.

    Returns:
        ``S`` ascending lists; list ``s`` has the length of :func:`~ignite_ext.data.sampler.indices.shard_bounds`
        ``(n, S, s)``, and together they hold every index of ``range(n)`` once.

    Examples:
        >>> from ignite_ext.data.sampler.mixing import mixed_shards
        >>> mixed_shards(8, 2, seed=0, epoch=0, mix=0.5)
        [[0, 1, 2, 3], [4, 5, 6, 7]]
        >>> one = mixed_shards(8, 2, seed=0, epoch=1, mix=0.5)
        >>> [len(s) for s in one], sorted(one[0] + one[1]), len(set(one[0]) - {0, 1, 2, 3})
        ([4, 4], [0, 1, 2, 3, 4, 5, 6, 7], 2)

    .. versionadded:: 0.4.0
    """
    n = check_int("n", n, 0)
    num_shards = check_int("num_shards", num_shards, 1)
    epoch = check_int("epoch", epoch, 0)
    seed = check_int("seed", seed)
    bounds = [shard_bounds(n, num_shards, s) for s in range(num_shards)]
    cohorts = _cohorts(n, num_shards)
    moving = _moving(cohorts, check_mix(mix))
    if epoch == 0 or moving == 0 or num_shards == 1:
        return [list(range(start, stop)) for start, stop in bounds]
    core_size = n // num_shards
    # core[b, j]: the j-th sample of shard b's core in a seeded order; column j belongs to cohort j % C.
    orders = [torch.randperm(core_size, generator=_generator("core", seed, b)) for b in range(num_shards)]
    core = torch.stack([start + order for (start, _), order in zip(bounds, orders, strict=True)])
    offsets = _offsets(num_shards, cohorts, moving, seed, epoch)
    column_offsets = offsets[torch.arange(core_size) % cohorts]
    origin = (torch.arange(num_shards).unsqueeze(1) - column_offsets.unsqueeze(0)) % num_shards
    arranged = core.gather(0, origin).sort(dim=1).values
    shards = arranged.tolist()
    for s, (start, stop) in enumerate(bounds):
        if stop - start > core_size:  # the one extra sample of a longer shard never moves
            shards[s].append(stop - 1)
            shards[s].sort()
    return [list(map(int, shard)) for shard in shards]


def epoch_pool(n: int, num_shards: int, seed: int, epoch: int, mix: float) -> list[int] | range:
    """Return ``range(n)`` arranged so that dealing it in contiguous blocks gives the epoch's mixed shards.

    What a fresh epoch deals (:func:`~ignite_ext.data.sampler.indices.pool_order` cuts shard ``s`` at
    :func:`~ignite_ext.data.sampler.indices.shard_bounds` ``(n, S, s)`` of it): ``range(n)`` itself when nothing
    mixes, else the shards of :func:`mixed_shards` one after another.

    Examples:
        >>> from ignite_ext.data.sampler.mixing import epoch_pool
        >>> epoch_pool(6, 2, seed=0, epoch=4, mix=0.0)
        range(0, 6)
        >>> sorted(epoch_pool(6, 2, seed=0, epoch=4, mix=0.5))
        [0, 1, 2, 3, 4, 5]

    .. versionadded:: 0.4.0
    """
    if _moving(_cohorts(check_int("n", n, 0), check_int("num_shards", num_shards, 1)), check_mix(mix)) == 0:
        return range(n)
    if epoch == 0 or num_shards == 1:
        return range(n)
    return [idx for shard in mixed_shards(n, num_shards, seed, epoch, mix) for idx in shard]
