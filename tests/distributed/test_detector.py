"""The failure detector in virtual time: every kill set of up to 8 ranks, at several moments of the beat cycle.

Each rank's real driver (:class:`~ignite_ext.distributed.liveness.Heartbeat`, without its thread) beats on one
in-memory store (torch's ``HashStore``) when the simulation's clock says so; the dead stop beating. Every
survivor must adopt exactly one cut, the set of ranks killed, within ``4/3 T`` of the deaths, whatever their
pattern (a lost host is a run of adjacent ranks; a switch or a rack any other set).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch.distributed as dist

from ignite_ext.distributed.liveness import Cut, Detector, Heartbeat

T = 6.0  # virtual seconds: beats every second


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(n: int, killed: set[int], death_at: float, seed: int) -> dict[int, tuple[list[Cut], float | None]]:
    """Run ``n`` ranks until ``3 T`` after ``killed`` die at ``death_at``; each survivor's cuts and when it learnt."""
    rng = random.Random(seed)
    clock, store = Clock(), dist.HashStore()
    hbs = [Heartbeat(store, r, n, clock=clock, start=False) for r in range(n)]
    every = T / 6
    # Each rank beats on a phase of its own, a little late now and then (a loaded host): up to a tenth of a beat.
    phase = [rng.uniform(0, every) for _ in range(n)]
    events = sorted((phase[r] + k * every + rng.uniform(0, every / 10), r) for r in range(n) for k in range(1, 40))
    learnt: dict[int, float | None] = dict.fromkeys(range(n))
    for at, r in events:
        if at > death_at + 3 * T:
            break
        if r in killed and at >= death_at:
            continue
        clock.now = at
        hbs[r]._beat()
        if learnt[r] is None and hbs[r].cuts():
            learnt[r] = at
    return {r: (hbs[r].cuts(), learnt[r]) for r in range(n) if r not in killed}


def _kill_sets(n: int) -> list[tuple[int, ...]]:
    return [s for k in range(1, n) for s in itertools.combinations(range(n), k)]


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_every_kill_set_is_one_cut_adopted_by_every_survivor_within_4_3_t(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IGNITE_EXT_HEARTBEAT_TIMEOUT", str(T))
    worst = 0.0
    for killed in _kill_sets(n):
        for offset in (0.0, 0.37, 0.81):  # where in a beat period the deaths fall
            death_at = 5 * T / 6 + offset
            seen = simulate(n, set(killed), death_at, seed=hash((n, killed, offset)))
            for r, (cuts, learnt) in seen.items():
                assert [c.ranks for c in cuts] == [killed], (n, killed, offset, r, cuts)
                assert learnt is not None
                worst = max(worst, learnt - death_at)
            assert len({cuts[0] for cuts, _ in seen.values()}) == 1, "survivors adopted different cuts"
    # 4/3 T, plus the beats' lateness of this simulation (a tenth of a beat, twice: the watcher's and the reader's).
    assert worst <= 4 / 3 * T + 2 * T / 60, worst


def test_nobody_is_declared_while_everyone_beats(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IGNITE_EXT_HEARTBEAT_TIMEOUT", str(T))
    seen = simulate(8, set(), death_at=1e9, seed=3)
    assert all(cuts == [] for cuts, _ in seen.values())


def test_a_rank_that_never_beat_is_silent_from_the_start_of_the_watch() -> None:
    d = Detector(0, 2, timeout=6.0, now=0.0)
    assert not d.observe(1.0, 0)  # its counter exists (the watcher made it) and never moved
    assert d.observe(2.0, 0)  # silent for more than T/4 since the watch began
    assert d.on_snapshot(2.0, {1: 0}) == ()
    assert d.observe(7.0, 0)
    assert d.on_snapshot(7.0, {1: 0}) == (1,)


def test_where_ranks_beat_from_their_first_block_one_that_never_beat_is_not_declared() -> None:
    d = Detector(0, 2, timeout=6.0, now=0.0, unborn_count=False)
    assert not any(d.observe(t, 0) for t in range(1, 60))


def test_a_suspect_that_beats_before_the_second_snapshot_is_not_declared() -> None:
    d = Detector(0, 3, timeout=6.0, now=0.0)
    d.observe(0.5, 4)
    assert d.observe(2.5, 4)
    d.on_snapshot(2.5, {1: 4, 2: 9})
    assert not d.observe(3.5, 5)  # it beat: suspicion over
    assert d.observe(5.5, 5)  # silent again: a new first snapshot, not a cut
    assert d.on_snapshot(5.5, {1: 5, 2: 9}) == ()
    assert not d.observe(9.0, 5)  # silent for 5.5 s < T
