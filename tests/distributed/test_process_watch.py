"""Process watching on real gloo ranks: each rank's keeper (a process outside its interpreter) tells a long GIL
hold from a death, and reports a death on a live host at once, not after the heartbeat timeout."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ignite_ext.distributed as idist
from ignite_ext.distributed.liveness.keeper import process_identity, running
from ignite_ext.distributed.liveness.watch import CutListener, KeeperHandle, wire_address
from ignite_ext.distributed.store.clients import clone, default_store, namespaced, read
from ignite_ext.distributed.store.keys import NAMESPACE_KEY, cut_key
from ignite_ext.distributed.store.wire import FLAVOURS, WireStore, flavour_for, prove
from tests._world import World

pytestmark = pytest.mark.timeout(240)


def _hold_the_gil(seconds: float) -> None:
    """A C call that keeps the GIL (``PyDLL`` does not release it), as a C extension's long loop would."""
    ctypes.PyDLL(None).usleep(int(seconds * 1e6))


def body_holds_the_gil(holder: int, seconds: float) -> dict[str, Any]:
    with idist.one_rank_first():
        pass  # every rank beats, its keeper started
    start = time.monotonic()
    try:
        with idist.one_rank_first(rank=holder) as first:
            if first:
                _hold_the_gil(seconds)
        with idist.one_rank_first():
            pass
        return {"outcome": "ok", "after": time.monotonic() - start}
    except idist.RankFailedError as exc:
        return {"outcome": type(exc).__name__, "dead": list(exc.dead), "after": time.monotonic() - start}


@pytest.mark.parametrize("watch", ["1", "0"], ids=["kept", "not-kept"])
def test_a_long_gil_hold_is_not_a_death(world: World, watch: str) -> None:
    # T = 2 s, the holder keeps the GIL for 3 T: its heartbeat thread cannot run, its keeper beats for it.
    t = 2.0
    env = {"IGNITE_EXT_HEARTBEAT_TIMEOUT": str(t), "IGNITE_EXT_PROCESS_WATCH": watch}
    results = world.results(body_holds_the_gil, 1, 3 * t, env=env, deadline=120)
    outcomes = [r.value["outcome"] if r.ok else r.exc_type for r in results]
    if watch == "1":
        assert outcomes == ["ok"] * len(results), [str(r) for r in results]
    else:  # without a keeper, the silence looks like a death: what the keeper is for
        assert outcomes[1] != "ok", [str(r) for r in results]
        assert all(r.value["outcome"] == "RankFailedError" for r in results if r.rank != 1), [str(r) for r in results]


def body_holds_the_gil_in_its_first_block(seconds: float, before: bool = False) -> dict[str, Any]:
    start = time.monotonic()
    if before:  # outside any block, once the group watcher's heartbeat has its keeper up (what the docs promise)
        from ignite_ext.distributed.liveness.heartbeat import Heartbeat

        while not Heartbeat._instances and time.monotonic() - start < 30:
            time.sleep(0.05)
        assert all(hb._watched.wait(30) for hb in list(Heartbeat._instances.values()))
        if idist.get_rank() == 0:
            _hold_the_gil(seconds)
    try:
        with idist.one_rank_first() as first:  # the first block, entered right after init_process_group
            if first and not before:
                _hold_the_gil(seconds)
        return {"outcome": "ok", "after": time.monotonic() - start}
    except idist.RankFailedError as exc:
        return {"outcome": type(exc).__name__, "dead": list(exc.dead), "after": time.monotonic() - start}


def test_a_gil_hold_in_a_first_block_entered_right_after_the_group_forms_is_not_a_death(world: World) -> None:
    # The block's entry waits for this rank's keeper (a fraction of a second, once): the body's first line may
    # hold the GIL for 3 T, its keeper beats for it.
    t = 2.0
    results = world.results(
        body_holds_the_gil_in_its_first_block,
        3 * t,
        nprocs=2,
        env={"IGNITE_EXT_HEARTBEAT_TIMEOUT": str(t)},
        deadline=120,
    )
    assert [r.value["outcome"] if r.ok else r.exc_type for r in results] == ["ok", "ok"], [str(r) for r in results]


def test_a_gil_hold_before_the_first_block_once_the_keeper_runs_is_not_a_death(world: World) -> None:
    # Before any block, a rank beats from its group's start (the group watcher) and its keeper starts right after:
    # a hold from then on is beaten for. (One that starts before the keeper runs, a fraction of a second after
    # init_process_group, and lasts longer than T is a death, as a hang is: the scheduling guide says so.)
    t = 2.0
    results = world.results(
        body_holds_the_gil_in_its_first_block,
        3 * t,
        True,
        nprocs=2,
        env={"IGNITE_EXT_HEARTBEAT_TIMEOUT": str(t)},
        deadline=120,
    )
    assert [r.value["outcome"] if r.ok else r.exc_type for r in results] == ["ok", "ok"], [str(r) for r in results]


def body_waits_for_a_death(victims: list[int], kill_at: float, work: float) -> dict[str, Any]:
    pids = idist.all_gather(torch.tensor([os.getpid()])).tolist()
    with idist.one_rank_first():
        pass
    if idist.get_rank() == victims[0]:  # the victims go down together, SIGKILLed from one of them

        def kill() -> None:
            time.sleep(kill_at)
            for v in sorted(victims, reverse=True):
                os.kill(pids[v], signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()
    start = time.monotonic()
    try:
        with idist.one_rank_first(rank=victims[0]) as first:  # the others wait for the first victim's outcome
            if first:
                time.sleep(work)
        return {"outcome": "ok"}
    except idist.RankFailedError as exc:
        return {"outcome": type(exc).__name__, "dead": list(exc.dead), "after": time.monotonic() - start}


@pytest.mark.parametrize("victims", [[2], [2, 3]], ids=["one-rank", "two-ranks-together"])
def test_a_death_on_a_live_host_is_reported_at_once(world: World, victims: list[int]) -> None:
    # T = 30 s: the heartbeat alone cannot declare a death before 11/12 T = 27.5 s of silence. Killed 2 s into the
    # block (the first victim works 8 s, the others wait for it), the victims must be reported within T/6 = 5 s of
    # the kill: the keeper's path (pidfd, settle 0.1 s, a cut, the listeners) takes a fraction of a second; the
    # margin is for a loaded machine.
    t, kill_at = 30.0, 2.0
    env = {"IGNITE_EXT_HEARTBEAT_TIMEOUT": str(t)}
    results = world.results(body_waits_for_a_death, victims, kill_at, 8.0, env=env, deadline=90)
    survivors = [r for r in results if r.rank not in victims]
    for r in survivors:
        assert r.ok and r.value["outcome"] == "RankFailedError", str(r)
        assert r.value["dead"] == victims, r.value  # both of a host's ranks in one cut, alike everywhere
        assert r.value["after"] < kill_at + t / 6, r.value


def test_a_keeper_spells_its_ranks_keys_whatever_the_environment_says_by_then(world: World) -> None:
    # The ranks imported the package before this world's restart count reached their environment (the harness's
    # fork server preloads it, as a launcher that imports early would): their keepers, started with the
    # environment's count 3, must spell the same keys as their ranks (the root is one for every attempt: each
    # incarnation has a store of its own), or a death on a live host is found by silence only (27.5 s here).
    t, kill_at = 30.0, 2.0
    env = {"IGNITE_EXT_HEARTBEAT_TIMEOUT": str(t), "TORCHELASTIC_RESTART_COUNT": "3"}
    results = world.results(body_waits_for_a_death, [2], kill_at, 8.0, env=env, deadline=90)
    for r in results:
        if r.rank != 2:
            assert r.ok and r.value["outcome"] == "RankFailedError" and r.value["dead"] == [2], str(r)
            assert r.value["after"] < kill_at + t / 6, r.value


def body_checks_for_cuts_after_the_others_left() -> dict[str, Any]:
    with idist.one_rank_first():
        pass
    if idist.get_rank() != 0:
        return {"cut": None}
    time.sleep(2.0)  # the others have ended their processes normally meanwhile
    store = default_store()
    assert store is not None
    return {"cut": read(store, cut_key(1))}


def test_a_normal_exit_is_not_a_death(world: World) -> None:
    results = world.results(body_checks_for_cuts_after_the_others_left, env={"IGNITE_EXT_HEARTBEAT_TIMEOUT": "30"})
    assert all(r.ok for r in results), [str(r) for r in results]
    assert results[0].value["cut"] is None


def body_stops(victim: int, t: float) -> dict[str, Any]:
    with idist.one_rank_first():
        pass
    start = time.monotonic()
    try:
        with idist.one_rank_first() as first:
            if idist.get_rank() == victim:
                os.kill(os.getpid(), signal.SIGSTOP)  # continued by the test 2 T later
            if first:
                time.sleep(0.2)
        return {"outcome": "ok"}
    except (idist.RankFailedError, idist.RankDiedError) as exc:
        if idist.get_rank() != victim:
            time.sleep(4 * t)  # the store (in rank 0) stays until the victim, continued, has learnt its fate
        return {
            "outcome": type(exc).__name__,
            "dead": list(getattr(exc, "dead", ())),
            "after": time.monotonic() - start,
        }


def test_a_stopped_rank_is_not_kept_alive(world: World) -> None:
    # SIGSTOP is not a GIL hold: the process does not run, so its keeper does not beat for it.
    t = 2.0

    def cont_later(procs: list[Any]) -> None:
        def cont() -> None:
            time.sleep(4.0 + 2 * t)
            os.kill(procs[2].pid, signal.SIGCONT)

        threading.Thread(target=cont, daemon=True).start()

    results = world.results(
        body_stops, 2, t, env={"IGNITE_EXT_HEARTBEAT_TIMEOUT": str(t)}, deadline=90, on_start=cont_later
    )
    assert results[2].ok and results[2].value["outcome"] == "RankDiedError", str(results[2])
    for r in results[:2] + results[3:]:
        assert r.ok and r.value["outcome"] == "RankFailedError" and r.value["dead"] == [2], str(r)


def test_the_wire_client_speaks_torchs_tcpstore() -> None:
    import datetime

    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    torchs = dist.PrefixStore("default_pg", dist.PrefixStore("0", server))
    group = namespaced(torchs)  # torch's own store where it clones itself, else the package's namespaced client
    assert namespaced(torchs) is group
    group.set("ignite_ext/cuts", "0")
    address, why = wire_address(group, rank=0)
    assert address is not None, why
    if hasattr(torchs, "clone"):  # torch 2.6 and later: torch's store and its prefix, as rank 0 lists it
        assert group is torchs and address[2] == "0/default_pg/"
        assert torchs.get("ignite_ext/wire_prefix") == b"p:0/default_pg/"  # published for the other ranks
        assert wire_address(dist.PrefixStore("default_pg", dist.PrefixStore("0", server)), rank=3)[0] == address
    else:  # the package's own connections, under the group's namespace
        token = read(torchs, NAMESPACE_KEY)
        assert group is not torchs and token is not None and address[2] == f"ignite_ext-{token.decode()}/"
    assert address[3] in FLAVOURS
    host, port, prefix, flavour = address
    wire = WireStore(host, port, prefix, timeout=5.0, flavour=flavour)
    assert wire.add("ignite_ext/hb/1", 5) == 5 and group.add("ignite_ext/hb/1", 1) == 6
    assert wire.compare_set("k", b"", b"v") == b"v" and group.get("k") == b"v"
    assert wire.compare_set("k", b"x", b"w") == b"v" and wire.read("k") == b"v" and wire.read("absent") is None
    assert wire.check(["k"]) and not wire.check(["k", "absent"]) and wire.get("k") == b"v"
    wire.set("s", b"ab")
    assert group.get("s") == b"ab"
    waiter = WireStore(host, port, prefix, timeout=None, flavour=flavour)
    done = threading.Event()
    threading.Thread(target=lambda: (waiter.wait(["late"]), done.set()), daemon=True).start()
    time.sleep(0.2)
    assert not done.is_set()
    group.set("late", "1")
    assert done.wait(5)
    wire.close()
    waiter.close()
    assert wire_address(dist.HashStore())[0] is None
    # Another prefix (or another protocol) is caught before anything relies on it: no process watching then.
    assert prove(host, port, "another/", group, "ignite_ext/proof/x", flavour)[0] is None
    with pytest.raises(ValueError, match="does not read"):
        CutListener((host, port, "another/", flavour), b"0", 1, lambda index: None)
    heard: list[int] = []
    listener = CutListener(address, b"0", 1, heard.append)
    group.set("ignite_ext/cut/1", "0|3.000|2")
    group.set("ignite_ext/cut/2", "0|3.000|3")
    deadline = time.monotonic() + 5
    while len(heard) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    listener.close()
    assert heard == [1, 2]


def test_a_thread_blocked_in_a_wait_never_blocks_another_threads_requests() -> None:
    # torch before 2.6 has no Store.clone: a waiter and the heartbeat shared one client, and a beat queued behind
    # a long wait (healthy ranks declared dead). The package's clients are connections of their own on any torch.
    import datetime

    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    group = namespaced(dist.PrefixStore("default_pg", server))
    waiter, beater = clone(group), clone(group)
    blocked = threading.Thread(target=lambda: waiter.wait(["never"], datetime.timedelta(seconds=3)), daemon=True)
    with contextlib.suppress(RuntimeError):
        blocked.start()
        time.sleep(0.2)
        start = time.monotonic()
        for _ in range(5):
            beater.add("ignite_ext/hb/0", 1)
        assert time.monotonic() - start < 2.0, "a request waited behind another thread's wait"
        assert group.add("ignite_ext/hb/0", 0) == 5
    blocked.join(10)


def test_what_a_keeper_sees_of_a_process() -> None:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        identity = process_identity(child.pid)
        assert identity is not None and running(child.pid)
        child.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        assert not running(child.pid) and process_identity(child.pid) == identity
        child.send_signal(signal.SIGCONT)
        child.kill()
        child.wait()
        assert process_identity(child.pid) is None and not running(child.pid)
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("goodbye", [False, True], ids=["killed", "said-goodbye"])
def test_a_rank_gone_before_its_keeper_started_is_reported_unless_it_said_goodbye(goodbye: bool) -> None:
    # A loaded host takes a second or more to start the keeper's interpreter: a rank killed in that time was once
    # "gone already" to its keeper, which ended without a word, and the death waited for the silence (T).
    import datetime
    import subprocess
    import sys

    from ignite_ext.distributed.liveness import keeper
    from ignite_ext.distributed.store.codecs import cut_ranks
    from ignite_ext.distributed.store.keys import proc_key

    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    identity = process_identity(rank.pid)
    assert identity is not None
    server.set(proc_key(3), identity)
    beats, out = os.pipe()
    if goodbye:
        os.write(out, b"q")
    rank.kill()
    rank.wait()
    flavour, why = prove("127.0.0.1", server.port, "", server, "proof", flavour_for(torch.__version__))
    assert flavour is not None, why
    args = ["127.0.0.1", str(server.port), "", "3", "4", str(rank.pid), str(beats), "0.5", flavour, identity]
    started = subprocess.run(
        [sys.executable, "-I", "-S", keeper.__file__, *args], pass_fds=(beats,), capture_output=True, timeout=60
    )
    os.close(beats)
    os.close(out)
    assert started.returncode == 0, started.stderr
    assert keeper.READY not in started.stdout  # it never watched a live rank
    posted = read(server, cut_key(1))
    if goodbye:
        assert posted is None
    else:
        assert posted is not None and cut_ranks(posted) == {3}, posted


def body_forks_then_waits_for_a_death(kill_at: float) -> dict[str, Any]:
    from ignite_ext.distributed.liveness.heartbeat import Heartbeat

    def listening() -> list[bool]:
        return [hb._listener is not None and hb._listener._thread.is_alive() for hb in Heartbeat._instances.values()]

    with idist.one_rank_first():
        pass
    deadline = time.monotonic() + 30
    while listening() != [True] and time.monotonic() < deadline:  # up before the fork: the fork is what is tested
        time.sleep(0.05)
    child = os.fork()
    if child == 0:  # a normal exit's handlers, as a user's forked helper runs them (not the test harness's reply)
        atexit._run_exitfuncs()
        os._exit(0)
    os.waitpid(child, 0)
    time.sleep(0.2)
    return {**body_waits_for_a_death([2], kill_at, 8.0), "listening": listening()}


def test_a_forked_child_ending_normally_leaves_its_parents_watching_alone(world: World) -> None:
    # The child's exit handlers must neither say goodbye to the parent's keeper nor shut down the parent's listener
    # connection (a socket shared by the fork): the death is then still reported by the keeper, at once.
    t, kill_at = 30.0, 2.0
    results = world.results(
        body_forks_then_waits_for_a_death, kill_at, env={"IGNITE_EXT_HEARTBEAT_TIMEOUT": str(t)}, deadline=90
    )
    for r in results[:2] + results[3:]:
        assert r.ok and r.value["listening"] == [True], str(r)  # the fork's exit left the connection alone
        assert r.value["outcome"] == "RankFailedError" and r.value["dead"] == [2], str(r)
        assert r.value["after"] < kill_at + t / 6, r.value


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_sent_while_a_keeper_starts_does_not_end_it(signum: signal.Signals) -> None:
    # A launcher's SIGTERM reaches every process of a job (Slurm's scancel and preemption): one that lands while
    # the keeper's interpreter starts, before it ignores the signal, must not end it (it ended it before 0.6.0).
    import datetime

    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    address, _ = wire_address(server)
    handle = KeeperHandle(address, rank=0, world_size=1, every=0.5, identity=process_identity(os.getpid()) or "")
    os.kill(handle.pid, signum)  # right after exec: the interpreter has not run the keeper's first line yet
    deadline = time.monotonic() + 30  # an interpreter's start, on a loaded machine
    while not handle.ready() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert handle.ready() and running(handle.pid), f"the keeper ended at {signum.name}"
    os.kill(handle.pid, signum)  # and once it runs
    time.sleep(0.2)
    assert running(handle.pid), f"the running keeper ended at {signum.name}"
    assert handle.stop() == 0
