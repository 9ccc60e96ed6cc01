"""The package's contract with torch's store, on whatever torch runs the suite (``scripts/compat.sh`` runs it on each).

Each test here stands for a guarantee that rests on something torch does not promise: a client of one's own per
thread (``Store.clone`` arrived late), the store's wire protocol (changed between releases), the error a timed-out
wait raises (``DistStoreError`` arrived late), ``check`` (missing from old Python stores). Run on torch 2.1.2 and
2.5.1, today's code failed the first two tests and raised ``AttributeError`` in the third.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from typing import Any

import pytest
import torch.distributed as dist

import ignite_ext.distributed as idist
from benchmarks._store_server import StoreServer
from ignite_ext.distributed.liveness.watch import wire_address
from ignite_ext.distributed.store.clients import check, clone, endpoint, group_store, namespaced, timed_out
from ignite_ext.distributed.store.wire import FLAVOURS, flavour_for
from tests._world import World, agent_store_env

T = 2.0


def _agent_env(port: int) -> dict[str, str]:
    return agent_store_env(port, T)


def body_slow_first_rank(work: float) -> dict[str, Any]:
    start = time.monotonic()
    try:
        with idist.one_rank_first() as first:
            if first:
                time.sleep(work)  # a download: the others wait in the store meanwhile, and must keep beating
        return {"outcome": "ok", "after": time.monotonic() - start}
    except idist.RankFailedError as exc:
        return {"outcome": type(exc).__name__, "message": str(exc)}


def test_a_first_rank_working_for_several_timeouts_fails_nobody(world: World) -> None:
    # torch 2.5.1: ranks 1 and 2, alive and waiting, were declared dead after T (their beat queued behind their
    # own wait on a shared client).
    with StoreServer() as server:
        results = world.results(body_slow_first_rank, 3 * T, env=_agent_env(server.port), deadline=120)
    for r in results:
        assert r.ok and r.value["outcome"] == "ok", str(r)
        assert r.value["after"] >= 3 * T - 0.1, r.value


def body_first_rank_killed() -> dict[str, Any]:
    with idist.one_rank_first():
        pass
    deadline = time.monotonic() + 30  # until this rank's keeper runs (the guarantee is the keeper's)
    from ignite_ext.distributed.liveness.heartbeat import Heartbeat

    while time.monotonic() < deadline and not all(hb._watched.is_set() for hb in Heartbeat._instances.values()):
        time.sleep(0.05)
    idist.barrier()
    start = time.monotonic()
    try:
        with idist.one_rank_first() as first:
            if first:
                os.kill(os.getpid(), signal.SIGKILL)
        return {"outcome": "ok"}
    except idist.RankFailedError as exc:
        return {
            "outcome": type(exc).__name__,
            "dead": list(exc.dead),
            "message": str(exc),
            "after": time.monotonic() - start,
        }


def test_a_rank_killed_inside_its_block_is_reported_by_its_keeper(world: World) -> None:
    # torch 2.5.1: StoreLostError after 2 s, or no result at all; torch 2.1.2: a raw AttributeError.
    with StoreServer() as server:
        results = world.results(body_first_rank_killed, env=_agent_env(server.port), deadline=90)
    assert results[0].killed
    for r in results[1:]:
        assert r.ok and r.value["outcome"] == "RankFailedError" and r.value["dead"] == [0], str(r)
        assert "its process was killed or crashed" in r.value["message"], r.value
        assert r.value["after"] < T, r.value  # the keeper's report, not the silence (4/3 T)


def test_the_package_reaches_the_group_store_on_its_own_clients() -> None:
    import torch

    ours_flavour = flavour_for(torch.__version__)
    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    assert group_store() is None  # no process group here: the private accessor answers, and says so
    torchs = dist.PrefixStore("default_pg", dist.PrefixStore("0", server))
    ours = namespaced(torchs)
    if hasattr(torchs, "clone"):  # torch clones its stores itself: its store is used as it is
        assert ours is torchs
    else:  # the package's own connections, its keys under the group's namespace
        place = endpoint(ours)
        assert place is not None and place.port == server.port and place.prefix.startswith("ignite_ext-")
    other = clone(ours)
    other.set("k", "v")
    assert other is not ours and ours.get("k") == b"v"
    assert check(ours, ["k"]) and not check(ours, ["k", "absent"])
    asked = time.monotonic()
    with pytest.raises(RuntimeError) as caught:  # DistStoreError where torch has it
        ours.wait(["absent"], datetime.timedelta(seconds=0.2))
    # torch 2.5 raises "failed to format addr" instead where reverse DNS fails at once (the suite's resolver setting)
    assert timed_out(caught.value, time.monotonic() - asked, 0.2), caught.value
    address, why = wire_address(ours, rank=0)  # every opcode proven against torch's own client
    assert address is not None and address[3] == ours_flavour and ours_flavour in FLAVOURS, why


def test_a_blocks_channel_is_freed_when_the_block_lets_go_of_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # The channel holds the store, and the store's heartbeat beats until the store is freed: a reference cycle
    # between the channel and its waiter would keep both until the cycle collector happens to run.
    import gc
    import weakref

    from ignite_ext.distributed._state import GroupState
    from ignite_ext.distributed._store_channel import StoreChannel

    monkeypatch.setenv("IGNITE_EXT_PROCESS_WATCH", "0")
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    gc.disable()
    try:
        channel = StoreChannel(0, 2, "block 1", None, store, 1, GroupState())
        freed = weakref.ref(channel)
        del channel
        assert freed() is None
    finally:
        gc.enable()
