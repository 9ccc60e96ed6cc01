"""The scheduler at scale, measured on real gloo ranks: store requests per rank that do not grow with the length of a
wait, and ranks that die together reported together."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from typing import Any

import pytest

import ignite_ext.distributed as idist
from benchmarks.bench_scale import CountingStore, own_requests
from ignite_ext.distributed import _channel_choice
from ignite_ext.distributed.policies import Plan, Policy, Turn, World
from tests._world import World as TestWorld

pytestmark = pytest.mark.timeout(240)


def _counting(monkeypatch_store: Counter[str]) -> None:
    real = _channel_choice.default_store
    wrapped: dict[int, CountingStore] = {}

    def default_store() -> Any:
        store = real()
        if store is None:
            return None
        if id(store) not in wrapped:  # one wrapper per store: the scheduler keys its state by the store
            wrapped[id(store)] = CountingStore(store, monkeypatch_store)
        return wrapped[id(store)]

    _channel_choice.default_store = default_store  # type: ignore[assignment]


def body_requests(seconds: float) -> dict[str, Any]:
    counts: Counter[str] = Counter()
    _counting(counts)
    with idist.one_rank_first():
        pass  # a first block starts the heartbeat threads
    counts.clear()
    with idist.one_rank_first() as first:
        if first:
            time.sleep(seconds)
    main = own_requests(counts)
    assert main > 0, counts  # the count reaches the threads that send the requests
    return {"rank": idist.get_rank(), "main": main, "heartbeat": counts["ignite_ext-heartbeat"]}


def test_a_wait_costs_a_few_requests_whatever_its_length(world: TestWorld) -> None:
    # Slices last the log interval (60 s here) while the heartbeat thread watches the successor, so a 4 s wait
    # is one slice: a wait, deleting its wake-up, one read. Polling (the former design) cost hundreds; slices of a
    # third of the heartbeat timeout with a read of the successor's beat in each cost 4 per second here.
    # T = 12 s: what is counted here does not depend on T (but for the beats, bounded below), and a TCPStore
    # server stalled for 5 s (a reverse DNS lookup of a client, seen on machines whose resolver does not answer)
    # must not pass for dead ranks in a test of request counts.
    env = {"IGNITE_EXT_HEARTBEAT_TIMEOUT": "12", "IGNITE_EXT_WAIT_LOG_INTERVAL": "60"}
    short = world(body_requests, 0.0, env=env, deadline=90)
    long = world(body_requests, 4.0, env=env, deadline=90)
    waiting_short = max(s["main"] for s in short[1:])
    waiting_long = max(s["main"] for s in long[1:])
    assert waiting_short <= 25, short
    assert waiting_long <= waiting_short + 4, long
    assert long[0]["main"] <= 30, long  # the first rank: its block, its outcome, the wake-ups, one wait
    # Heartbeats: 2 requests per beat, a beat every T/6 = 2 s, plus a wake-up per slice (bounded as for 0.5 s).
    assert all(s["heartbeat"] <= 2 * 4.5 / 0.5 + 10 for s in long), long


KILL_AFTER_S = 2.0


class _Together(Policy):
    """Every rank runs at once."""

    def plan(self, world: World, comm: Any) -> Plan:
        everyone = tuple(range(world.world_size))
        return Plan(tuple(Turn(r, True, frozenset(), everyone, 0) for r in everyone))


def body_lost_node(victims: tuple[int, ...]) -> dict[str, Any]:
    with idist.one_rank_first():
        pass  # every rank beats from here on
    idist.barrier()
    start = time.monotonic()
    try:
        with idist.rank_scheduler(order=_Together()):
            if idist.get_rank() in victims:
                time.sleep(KILL_AFTER_S)  # long enough for a few beats: ranks that have run for a while
                os.kill(os.getpid(), signal.SIGKILL)  # a node lost with all its ranks at once
        return {"outcome": "ok"}
    except idist.RankFailedError as exc:
        return {"outcome": "RankFailedError", "dead": list(exc.dead), "after": time.monotonic() - start}


def test_ranks_that_die_together_are_reported_together(world: TestWorld) -> None:
    timeout = 3.0
    victims = (2, 3, 4)
    env = {"IGNITE_EXT_HEARTBEAT_TIMEOUT": str(timeout)}
    results = world.results(body_lost_node, victims, nprocs=6, env=env, deadline=120)
    survivors = [r for r in results if r.rank not in victims]
    assert all(results[v].killed for v in victims)
    for r in survivors:
        assert r.ok and r.value["outcome"] == "RankFailedError", str(r)
        assert r.value["dead"] == list(victims), r.value
        # All three within ~1.5 timeouts of their death (one after another, they took a timeout each).
        assert r.value["after"] < KILL_AFTER_S + 1.5 * timeout + 1.0, r.value
