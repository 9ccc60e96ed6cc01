"""The fault sweep: every case of a small scope, on real gloo ranks, checked against the scheduler's promises.

A *trial* runs one scenario on ``N`` real processes (gloo, the store served by rank 0 as under ``env://`` or by a
process of its own as torchrun's agent serves it) and injects one fault:

* **kill**: a set of ranks lost at once, their keepers with them (a lost host is a run of adjacent ranks; a
  switch or a rack any set), SIGKILLed at a *moment* of the scenario. The sweep enumerates every non-empty proper
  subset of the ranks (``N = 4``), or every run of adjacent ranks plus a seeded sample of other subsets
  (``N = 8``), at every moment.
* **exit**: the same sets, but only the ranks' processes die; their hosts (and keepers) live on, as after a
  segfault or the OOM killer. Run with a larger ``T`` (10 s by default), so that a death reported before
  ``11/12 T`` can only have been reported by its keeper: the bound is the remaining work and slack, not ``T``.
* **pause**: the same sets SIGSTOPped for ``2 T`` at the same moments, then SIGCONTed.
* **crash**: one rank SIGKILLs itself just before or just after its ``k``-th store request of the scenario, for
  every ``k`` found by counting the requests of a clean run (so the sweep follows the protocol as it changes).
* **stall**: the rank that fires a moment inside a body stops advancing there, alive (every body reports
  progress as it starts; the stall deadline is ``T``): it holds still for the deadline and ``2 T`` more, then
  goes on. Every rank, the stalled one included, must raise ``RankStalledError`` naming it, in the same block.

The scenario (every rank): block **A** ``one_rank_first()`` (rank 0 works ``W`` seconds, the others a fifth of
it), block **B** ``rank_scheduler(Ordered())`` with a nested ``one_rank_first()`` inside, block **C**
``rank_scheduler(SharedPath(tmp))``. The moments, each fired by one rank when it reaches it:

.. code-block:: text

    entry        rank 0 enters A late: the others wait at A's entry
    first-runs   rank 0 inside A's body (the others wait for it)
    later-run    rank 1 inside A's body (rank 0 waits at A's exit)
    between      rank 0 between A and B (the others are at B's entry or on their way)
    ordered      rank 1 inside B's body (rank 2 and later wait for it, rank 0 at B's exit)
    nested       rank 0 inside the nested scheduler of B

**Invariants** checked on every trial (:func:`check`): no survivor hangs; survivors raise only the package's
errors; each names exactly the lost ranks, sorted, without duplicates, the same set on every survivor; they fail
in the same block; no block body runs twice, nor after a rank it waited for failed; detection within ``4/3 T``
plus the scenario's remaining work and a scheduling slack; a paused rank raises ``RankDiedError`` (it was
declared dead) or, when nobody needed it meanwhile, carries on with the others; after a stall, every rank raises
``RankStalledError`` naming the stalled rank alone, in one block, within :func:`stall_bound`.

Run ``python -m benchmarks.fault_sweep [--n 4] [--sample K --seed S]``; without ``--sample`` the whole scope is
swept and the table written to ``docs/benchmarks/fault_sweep.md``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "MOMENTS",
    "Trial",
    "TrialResult",
    "check",
    "clean_run",
    "count_requests",
    "crash_trials",
    "fault_trials",
    "keepers",
    "requests_in_block",
    "run_trial",
    "stall_bound",
    "stall_trials",
]

#: Who fires each moment (see the module docstring).
MOMENTS: dict[str, int] = {
    "entry": 0,
    "first-runs": 0,
    "later-run": 1,
    "between": 0,
    "ordered": 1,
    "nested": 0,
}
#: Seconds rank 0 works in block A (the others a fifth of it); what a survivor may still have to finish after a
#: fault before it can learn of it.
WORK_S = 1.0
#: The package's errors a survivor may raise (the store host lost with rank 0 is a StoreLostError).
PACKAGE_ERRORS = ("RankFailedError", "RankDiedError", "StoreLostError")
#: The moments inside a body, where a rank can stall (at the entry and between blocks nothing is reported).
STALL_MOMENTS = ("first-runs", "later-run", "ordered", "nested")


@dataclass(frozen=True)
class Trial:
    """One trial: a fault (``kill``, ``pause``, ``crash`` or ``none``) and where it strikes."""

    n: int
    fault: str
    store: str  # "rank0" (env://) or "agent" (a process of its own)
    victims: tuple[int, ...] = ()
    moment: str = ""
    request: int = 0  # crash: the victim's k-th own store request (1-based)
    when: str = ""  # crash: "before" or "after" the request
    heartbeat_timeout: float = 3.0

    def describe(self) -> str:
        """One line for the sweep's log."""
        where = f"request {self.request} ({self.when})" if self.fault == "crash" else self.moment
        return f"{self.fault} {list(self.victims)} at {where}, N={self.n}, store={self.store}"


@dataclass
class TrialResult:
    """What a trial's ranks did, and the invariants it broke (none: it passed)."""

    trial: Trial
    ranks: list[dict[str, Any]] = field(default_factory=list)  # per rank: events and outcome
    fired_at: float | None = None
    hung: list[int] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    detection: dict[int, float] = field(default_factory=dict)  # survivor -> seconds from the fault to its error
    kept: bool = False  # exit: every victim's keeper was up when the fault struck


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- inside a rank ----------------------------------------------------------------------------------------------


class _CrashingStore:
    """The process group's store, counting the rank's own requests (main thread) and crashing at one of them."""

    def __init__(self, inner: Any, counter: list[int], crash_at: int, when: str, out: Path) -> None:
        self._inner, self._counter, self._crash_at, self._when, self._out = inner, counter, crash_at, when, out

    def _crash(self) -> None:
        (self._out / "crashed_at").write_text(repr(time.monotonic()))
        os.kill(os.getpid(), signal.SIGKILL)

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._inner, name)  # no clone where torch's store has none (before 2.6), as torch's
        if name == "clone":
            return lambda: _CrashingStore(target(), self._counter, self._crash_at, self._when, self._out)
        if not callable(target) or name == "set_timeout":
            return target

        def counted(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is not threading.main_thread():
                return target(*args, **kwargs)
            self._counter[0] += 1
            if self._counter[0] == self._crash_at and self._when == "before":
                self._crash()
            value = target(*args, **kwargs)
            if self._counter[0] == self._crash_at and self._when == "after":
                self._crash()
            return value

        return counted


def _install_store_proxy(counter: list[int], crash_at: int, when: str, out: Path) -> None:
    from torch.distributed import distributed_c10d

    real = distributed_c10d._get_default_store
    proxies: dict[int, _CrashingStore] = {}

    def proxied() -> Any:  # one proxy per store: the scheduler keys its state by the store object
        store = real()
        return proxies.setdefault(id(store), _CrashingStore(store, counter, crash_at, when, out))

    distributed_c10d._get_default_store = proxied


#: The rank's own store requests so far (counted where a trial counts them): each event records it.
_REQUESTS = [0]


class _Log:
    def __init__(self, path: Path) -> None:
        self._file = path.open("a")

    def __call__(self, event: str, **data: Any) -> None:
        record = {"t": time.monotonic(), "event": event, "requests": _REQUESTS[0], **data}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()


def _scenario(rank: int, trial: Trial, out: Path, fire: Any) -> None:
    import ignite_ext.distributed as idist
    from ignite_ext import progress

    log = _Log(out / f"rank{rank}.jsonl")

    def moment(name: str) -> None:
        if name == trial.moment and MOMENTS[name] == rank:
            log("fire", moment=name)
            fire.set()
            if trial.fault == "stall":  # alive, its body's activity unfinished, not advancing
                time.sleep(trial.heartbeat_timeout + 2 * trial.heartbeat_timeout)
            elif rank in trial.victims:
                time.sleep(1.0)  # the fault lands here (a paused rank goes on after this)

    def body(name: str, **data: Any) -> None:
        log("body", block=name, **data)
        if trial.fault == "stall":
            progress.advance(what=f"block {name}")

    block = "A"
    try:
        if rank == 0:
            time.sleep(0.5)  # the others wait at A's entry
            moment("entry")
        log("enter", block="A")
        with idist.one_rank_first() as first:
            body("A")
            if first:
                moment("first-runs")
                time.sleep(WORK_S)
            else:
                moment("later-run")
                time.sleep(WORK_S / 5)
            log("done", block="A")
        block = "between"
        moment("between")
        time.sleep(0.2)
        block = "B"
        log("enter", block="B")
        with idist.rank_scheduler(order=idist.Ordered()):
            body("B")
            moment("ordered")
            with idist.one_rank_first():
                moment("nested")
                time.sleep(0.05)
            log("done", block="B")
        block = "C"
        log("enter", block="C")
        with idist.rank_scheduler(order=idist.SharedPath(out / "shared")) as turn:
            body("C", first=bool(turn))
            time.sleep(0.05)
            log("done", block="C")
        log("ok")
    except BaseException as exc:  # every outcome is recorded, then judged
        log(
            "raise",
            block=block,
            type=type(exc).__name__,
            dead=list(getattr(exc, "dead", ())),
            ranks=list(getattr(exc, "ranks", ())),
            stalled=list(getattr(exc, "stalled", ())),
            message=str(exc)[:500],
        )


def _rank_main(rank: int, trial: Trial, port: int, out: str, fire: Any) -> None:
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(trial.n),
        "LOCAL_WORLD_SIZE": str(trial.n),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        "IGNITE_EXT_HEARTBEAT_TIMEOUT": str(trial.heartbeat_timeout),
        "IGNITE_EXT_STALL_TIMEOUT": str(trial.heartbeat_timeout),
    }
    if trial.store == "agent":
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        env["TORCHELASTIC_RESTART_COUNT"] = "0"  # torchrun sets it too; torch before 2.6 requires it
    os.environ.update(env)
    counter = _REQUESTS
    counting = trial.fault in ("crash", "count")
    if counting:
        victim = rank in trial.victims
        _install_store_proxy(counter, trial.request if victim and trial.fault == "crash" else 0, trial.when, Path(out))
    import ignite.distributed as ignite_idist

    ignite_idist.initialize("gloo")
    _scenario(rank, trial, Path(out), fire)
    if counting:
        Path(out, f"rank{rank}.count").write_text(str(counter[0]))
    # Exit handlers run (rank 0 keeps the store it hosts until the others have read the last outcome), the rest
    # of interpreter teardown does not: a rank whose peers were killed must not block in a destructor.
    atexit._run_exitfuncs()
    os._exit(0)


# --- the parent -------------------------------------------------------------------------------------------------


def _serve(conn: Any) -> None:
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    conn.send(store.port)
    time.sleep(600)  # killed by the parent long before


@contextlib.contextmanager
def _store_server(kind: str, ctx: Any) -> Iterator[int]:
    """A port for the ranks' store: free (rank 0 serves it) or served by a process of its own (torchrun's agent)."""
    if kind != "agent":
        yield _free_port()
        return
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_serve, args=(send,), daemon=True)
    proc.start()
    try:
        if not recv.poll(60):
            raise RuntimeError("the store server did not start within 60 s")
        yield int(recv.recv())
    finally:
        proc.kill()
        proc.join()


def keepers(pid: int) -> list[int]:
    """The keeper processes of rank process ``pid``: its children (the rank starts no other process here)."""
    children: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(c) for c in f.read().split()]
    return children


def _wait_for_keepers(pids: list[int], seconds: float) -> bool:
    """Whether every rank of ``pids`` has its keeper within ``seconds``."""
    end = time.monotonic() + seconds
    while not all(keepers(pid) for pid in pids):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _deadline(trial: Trial) -> float:
    """How long a trial may take before its survivors count as hung: far beyond any detection bound."""
    return 3 * WORK_S + 2.0 + 12 * trial.heartbeat_timeout


def run_trial(trial: Trial, ctx: Any = None) -> TrialResult:
    """Run ``trial`` on fresh processes; every process is reaped, whatever happens."""
    ctx = ctx or _context()
    result = TrialResult(trial)
    with tempfile.TemporaryDirectory(prefix="ignite_ext_sweep_") as tmp, _store_server(trial.store, ctx) as port:
        out = Path(tmp)
        (out / "shared").mkdir()
        fire = ctx.Event()
        procs = [ctx.Process(target=_rank_main, args=(r, trial, port, tmp, fire)) for r in range(trial.n)]
        try:
            for proc in procs:
                proc.start()
            end = time.monotonic() + _deadline(trial)
            if trial.fault == "stall" and fire.wait(max(0.0, end - time.monotonic())):
                result.fired_at = time.monotonic()
            if trial.fault in ("kill", "pause", "exit") and fire.wait(max(0.0, end - time.monotonic())):
                sig = signal.SIGSTOP if trial.fault == "pause" else signal.SIGKILL
                if trial.fault == "exit":  # the victim sleeps a second at the moment: its keeper is surely up
                    result.kept = _wait_for_keepers([procs[v].pid for v in trial.victims], 0.5)
                if trial.fault == "kill":  # the host goes, the keepers with it (first: they must not report)
                    for v in trial.victims:
                        for keeper in keepers(procs[v].pid):
                            os.kill(keeper, signal.SIGKILL)
                for v in trial.victims:
                    os.kill(procs[v].pid, sig)
                result.fired_at = time.monotonic()
                if trial.fault == "pause":
                    time.sleep(2 * trial.heartbeat_timeout)
                    for v in trial.victims:
                        os.kill(procs[v].pid, signal.SIGCONT)
            for proc in procs:
                proc.join(max(0.1, end - time.monotonic()))
            result.hung = [r for r, proc in enumerate(procs) if proc.is_alive()]
        finally:
            for proc in procs:
                if proc.is_alive():
                    for keeper in keepers(proc.pid):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(keeper, signal.SIGKILL)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGCONT)
                    proc.kill()
                proc.join()
        for r in range(trial.n):
            path = out / f"rank{r}.jsonl"
            events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
            count = out / f"rank{r}.count"
            result.ranks.append(
                {
                    "events": events,
                    "exitcode": procs[r].exitcode,
                    "requests": int(count.read_text()) if count.exists() else None,
                }
            )
        crashed = out / "crashed_at"
        if crashed.exists():
            result.fired_at = float(crashed.read_text())
    check(result)
    return result


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "ignite.distributed", "ignite_ext.distributed"])
    return ctx


# --- the invariants ---------------------------------------------------------------------------------------------


def _outcome(rank: dict[str, Any]) -> dict[str, Any] | None:
    for e in rank["events"]:
        if e["event"] in ("raise", "ok"):
            return e  # type: ignore[no-any-return]
    return None


def _plan_after(block: str, rank: int) -> list[int]:
    """The ranks ``rank`` waits for before running ``block``'s body (C's plan depends on the census: not checked)."""
    if block == "A":
        return [] if rank == 0 else [0]
    if block == "B":
        return [] if rank == 0 else [rank - 1]
    return []


def check(result: TrialResult) -> None:
    """Fill ``result.violations`` (empty: every invariant held) and ``result.detection``."""
    trial, bad = result.trial, result.violations
    lost = set(trial.victims) if trial.fault in ("kill", "crash", "exit") else set()
    if trial.fault == "crash" and result.ranks[trial.victims[0]]["exitcode"] != -signal.SIGKILL:
        lost = set()  # the crash point was never reached (the run took a shorter path): nothing was lost
    survivors = [r for r in range(trial.n) if r not in lost]
    if result.hung:
        bad.append(f"ranks {result.hung} still running at the deadline ({_deadline(trial):.0f} s)")
    outcomes = {r: _outcome(result.ranks[r]) for r in survivors}
    for r, o in outcomes.items():
        if o is None and r not in result.hung:
            bad.append(f"rank {r} ended without an outcome (exit code {result.ranks[r]['exitcode']})")
    # Bodies: never twice, never after a rank waited for failed.
    for r in range(trial.n):
        bodies = Counter(e["block"] for e in result.ranks[r]["events"] if e["event"] == "body")
        for block, times in bodies.items():
            if times > 1:
                bad.append(f"rank {r} ran block {block}'s body {times} times")
            for peer in _plan_after(block, r):
                done = any(e["event"] == "done" and e["block"] == block for e in result.ranks[peer]["events"])
                if not done:
                    bad.append(f"rank {r} ran block {block}'s body although rank {peer}, which it waits for, did not")
    raised = {r: o for r, o in outcomes.items() if o is not None and o["event"] == "raise"}
    if trial.fault == "stall":
        _check_stall(result, outcomes)
        return
    if not lost:
        if trial.fault == "pause":
            _check_pause(result, outcomes)
        elif raised:
            bad.append(f"ranks {sorted(raised)} raised without a fault: {next(iter(raised.values()))}")
        return
    store_lost = 0 in lost and trial.store == "rank0"
    finished = [r for r, o in outcomes.items() if o is not None and o["event"] == "ok"]
    if finished and raised:
        bad.append(f"ranks {finished} finished every block while ranks {sorted(raised)} raised")
    # A rank that died after its exit from the last block was counted was needed by nobody: the others finish.
    last_done = all(any(e["event"] == "done" and e["block"] == "C" for e in result.ranks[v]["events"]) for v in lost)
    for r, o in outcomes.items():
        if o is None:
            continue
        if o["event"] == "ok":
            if not last_done:
                bad.append(f"rank {r} finished every block although ranks {sorted(lost)} were lost")
            continue
        if o["type"] not in PACKAGE_ERRORS:
            bad.append(f"rank {r} raised {o['type']}: {o['message']}")
            continue
        if store_lost:
            continue  # the store went with rank 0's process: StoreLostError or a failure, both typed
        if o["dead"] != sorted(set(o["dead"])):
            bad.append(f"rank {r} names dead ranks {o['dead']}: not sorted or duplicated")
        if sorted(set(o["dead"])) != sorted(lost):
            bad.append(f"rank {r} names dead ranks {o['dead']}, lost were {sorted(lost)}")
        if result.fired_at is not None:
            result.detection[r] = o["t"] - result.fired_at
    blocks = {o["block"] for o in raised.values()}
    if len(blocks) > 1 and not store_lost:
        bad.append(f"survivors failed in different blocks: { {r: o['block'] for r, o in raised.items()} }")
    bound = keeper_bound(trial.heartbeat_timeout) if result.kept else detection_bound(trial.heartbeat_timeout)
    late = {r: round(s, 2) for r, s in result.detection.items() if s > bound}
    if late:
        bad.append(f"detection later than {bound:.1f} s: {late}")


def detection_bound(t: float) -> float:
    """The latest a survivor may raise after a fault: ``4/3 T``, the work it may still have to finish, and slack.

    The slack (half a ``T`` plus a second) is for scheduling on a loaded machine: four ranks and a store server on
    two cores, each beat a thread that must get the GIL and a core.
    """
    return 4 / 3 * t + WORK_S + 0.5 * t + 1.0


def keeper_bound(t: float) -> float:
    """The latest a survivor may raise after a process death its keeper saw: the work left, and slack.

    No multiple of ``T``: the keeper posts the cut :data:`~ignite_ext.distributed.liveness.keeper.SETTLE` seconds
    after the death and every process's listener hears it at once. The slack is the same as in
    :func:`detection_bound` for ``T`` = 3 s (2.5 s: scheduling on a loaded machine), well under the ``11/12 T`` of
    silence that the heartbeat needs at the ``T`` = 10 s the exit trials run with.
    """
    return WORK_S + 2.5


def stall_bound(t: float) -> float:
    """The latest a rank may raise after a stall began: the deadline (``T`` here), a beat, and the same slack.

    The stalled rank's heartbeat thread posts it at its first beat after the deadline (a beat is ``T/6``), and
    every waiting rank hears it at once (its wake key); the slack is :func:`detection_bound`'s.
    """
    return t + t / 6 + 0.5 * t + 1.0


def _check_stall(result: TrialResult, outcomes: dict[int, dict[str, Any] | None]) -> None:
    """Every rank raises RankStalledError naming the stalled rank, in one block; the others within the bound."""
    trial, bad = result.trial, result.violations
    stalled = list(trial.victims)
    for r, o in outcomes.items():
        if o is None:
            continue
        if o["event"] != "raise" or o["type"] != "RankStalledError":
            bad.append(f"rank {r} ended with {o.get('type', 'no error')}, not RankStalledError: {o.get('message')}")
        elif o["stalled"] != stalled or o["dead"]:
            bad.append(f"rank {r} names stalled {o['stalled']} and dead {o['dead']}; stalled was {stalled}")
        elif r not in stalled and result.fired_at is not None:
            result.detection[r] = o["t"] - result.fired_at
    blocks = {o["block"] for o in outcomes.values() if o is not None and o["event"] == "raise"}
    if len(blocks) > 1:
        bad.append(f"ranks raised in different blocks: { {r: o['block'] for r, o in outcomes.items() if o} }")
    bound = stall_bound(trial.heartbeat_timeout)
    late = {r: round(s, 2) for r, s in result.detection.items() if s > bound}
    if late:
        bad.append(f"stall reported later than {bound:.1f} s: {late}")


def _check_pause(result: TrialResult, outcomes: dict[int, dict[str, Any] | None]) -> None:
    trial, bad = result.trial, result.violations
    paused = set(trial.victims)
    raised = {r: o for r, o in outcomes.items() if o is not None and o["event"] == "raise"}
    if not raised:
        return  # nobody needed the paused ranks while they were stopped: they carried on
    for r, o in raised.items():
        if o["type"] not in PACKAGE_ERRORS:
            bad.append(f"rank {r} raised {o['type']}: {o['message']}")
        elif 0 in paused and trial.store == "rank0":
            continue  # the store was paused with rank 0: a StoreLostError, or whatever came first, typed
        elif r in paused and o["type"] == "StoreLostError" and trial.store == "rank0" and 0 in raised:
            continue  # rank 0 gave up on it and exited meanwhile, with the store its process hosted
        elif r in paused and o["type"] != "RankDiedError":
            bad.append(f"paused rank {r} raised {o['type']}, not RankDiedError: {o['message'][:200]}")
        elif r not in paused and sorted(o["dead"]) != sorted(paused):
            bad.append(f"rank {r} names dead ranks {o['dead']}, paused were {sorted(paused)}")
    for r in paused:
        if r not in raised and not (0 in paused and trial.store == "rank0"):
            bad.append(f"paused rank {r} carried on although the others declared it dead")


# --- the scope --------------------------------------------------------------------------------------------------


def kill_sets(n: int, rng: random.Random | None = None, extra: int = 8) -> list[tuple[int, ...]]:
    """The kill sets: all of them for ``n <= 4``, else the hosts' runs of ranks and a sample of the others.

    That is every non-empty proper subset of ``n <= 4`` ranks; for larger ``n`` every run of adjacent ranks of a
    host (2 or 4 ranks per host) plus ``extra`` other subsets drawn with ``rng``.

    Examples:
        >>> from benchmarks.fault_sweep import kill_sets
        >>> len(kill_sets(4)), kill_sets(3)
        (14, [(0,), (1,), (2,), (0, 1), (0, 2), (1, 2)])
        >>> kill_sets(8, extra=0)[:3]
        [(0, 1), (2, 3), (4, 5)]
    """
    if n <= 4:
        return [s for k in range(1, n) for s in itertools.combinations(range(n), k)]
    hosts = [tuple(range(h, h + per)) for per in (2, 4) for h in range(0, n, per)]
    others = [s for k in range(1, n) for s in itertools.combinations(range(n), k) if s not in hosts]
    rng = rng or random.Random(0)
    return hosts + sorted(rng.sample(others, min(extra, len(others))))


def fault_trials(
    n: int, fault: str, t: float, rng: random.Random | None = None, stores: tuple[str, ...] = ("agent", "rank0")
) -> list[Trial]:
    """Every kill (or pause) set of :func:`kill_sets` at every moment, with each kind of store in ``stores``."""
    return [
        Trial(n, fault, store, victims, moment, heartbeat_timeout=t)
        for victims in kill_sets(n, rng)
        for moment in MOMENTS
        for store in stores
    ]


def stall_trials(n: int, t: float, stores: tuple[str, ...] = ("agent", "rank0")) -> list[Trial]:
    """A stall at every moment inside a body (:data:`STALL_MOMENTS`), by the rank that fires it.

    Examples:
        >>> from benchmarks.fault_sweep import stall_trials
        >>> [(t.moment, t.victims) for t in stall_trials(4, 3.0, ("agent",))]
        [('first-runs', (0,)), ('later-run', (1,)), ('ordered', (1,)), ('nested', (0,))]
    """
    return [
        Trial(n, "stall", store, (MOMENTS[moment],), moment, heartbeat_timeout=t)
        for moment in STALL_MOMENTS
        for store in stores
    ]


def count_requests(n: int, t: float, store: str = "agent") -> list[int]:
    """Each rank's own store requests in a clean run of the scenario (the crash points to enumerate)."""
    return [r["requests"] for r in clean_run(n, t, store).ranks]


def clean_run(n: int, t: float, store: str = "agent") -> TrialResult:
    """A run without a fault, counting each rank's requests (each event records the count so far)."""
    result = run_trial(Trial(n, "count", store, heartbeat_timeout=t))
    assert not result.violations, result.violations
    return result


def requests_in_block(result: TrialResult, rank: int, block: str) -> range:
    """The numbers of ``rank``'s own requests (1-based) from its entry into ``block`` to its next event after it."""
    events = result.ranks[rank]["events"]
    start = next(i for i, e in enumerate(events) if e["event"] == "enter" and e["block"] == block)
    end = next(
        i for i, e in enumerate(events) if i > start and e["event"] in ("enter", "ok") and e.get("block") != block
    )
    return range(events[start]["requests"] + 1, events[end]["requests"] + 1)


def crash_trials(n: int, t: float, counts: list[int], store: str = "agent") -> list[Trial]:
    """For each rank and each of its store requests in a clean run: exit just before it and just after it."""
    return [
        Trial(n, "crash", store, (r,), request=k, when=when, heartbeat_timeout=t)
        for r in range(n)
        for k in range(1, counts[r] + 1)
        for when in ("before", "after")
    ]


def pattern(victims: tuple[int, ...], n: int) -> str:
    """``one rank``, ``adjacent run`` (a lost host: consecutive ranks) or ``other set`` (a switch, a rack).

    Examples:
        >>> from benchmarks.fault_sweep import pattern
        >>> pattern((2,), 4), pattern((1, 2, 3), 4), pattern((0, 3), 4)
        ('one rank', 'adjacent run', 'other set')
    """
    if len(victims) == 1:
        return "one rank"
    return "adjacent run" if victims == tuple(range(victims[0], victims[0] + len(victims))) else "other set"


def table(results: list[TrialResult]) -> list[dict[str, Any]]:
    """One row per store, fault, moment (or crash point's rank) and pattern: trials, passed, worst detection."""
    groups: dict[tuple[int, str, str, str, str], list[TrialResult]] = {}
    for r in results:
        t = r.trial
        where = t.moment if t.fault != "crash" else f"rank {t.victims[0]}'s requests"
        key = (t.n, t.store, t.fault, where, pattern(t.victims, t.n) if t.fault != "crash" else "one rank")
        groups.setdefault(key, []).append(r)
    rows = []
    for (n, store, fault, where, kind), group in groups.items():
        t = group[0].trial.heartbeat_timeout
        worst = max((s for r in group for s in r.detection.values()), default=None)
        rows.append(
            {
                "N": n,
                "store": store,
                "T (s)": t,
                "fault": fault,
                "moment": where,
                "pattern": kind,
                "trials": len(group),
                "passed": sum(not r.violations for r in group),
                "worst detection (s)": "" if worst is None else round(worst, 2),
                "worst (x T)": "" if worst is None else round(worst / t, 2),
            }
        )
    return rows


def write_results(results: list[TrialResult], seed: int | str, seconds: float) -> None:
    """The sweep's table: ``benchmarks/results/fault_sweep.{json,md}`` and ``docs/fault_sweep_results.rst``."""
    rows = table(results)
    here = Path(__file__).parent
    passed = sum(not r.violations for r in results)
    summary = (
        f"{passed} of {len(results)} trials kept every invariant (seeds and commits {seed}, {seconds / 60:.0f} min on "
        f"{os.cpu_count()} cores). Detection is measured from the fault to each survivor's error; it includes what "
        f"the survivor still had to finish first (up to {WORK_S:g} s of work in block A). Empty: the store went "
        "with rank 0's process (the survivors raise StoreLostError at once), nothing was lost (a crash point "
        "the run did not reach), or a pause (not timed: its check is that the paused ranks raise RankDiedError "
        "when they resume and that every survivor names exactly them). A kill takes the ranks' keepers along (a "
        "lost host); an exit and a crash do not (the process dies, its host lives): its keeper reports it."
    )
    (here / "results" / "fault_sweep.json").write_text(json.dumps({"seed": seed, "rows": rows, "summary": summary}))
    keys = list(rows[0])
    md = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    md += ["| " + " | ".join(str(row[k]) for k in keys) + " |" for row in rows]
    (here / "results" / "fault_sweep.md").write_text("\n".join(["## Fault sweep", "", *md, "", summary, ""]))
    rst = [".. list-table::", "   :header-rows: 1", ""]
    for row in [keys, *[[str(row[k]) for k in keys] for row in rows]]:
        rst += [("   * - " if i == 0 else "     - ") + (c or " ") for i, c in enumerate(row)]
    (here.parent / "docs" / "fault_sweep_results.rst").write_text("\n".join([*rst, "", summary, ""]))


def _commit() -> str:
    """The checkout's commit, as the results name the code they measured."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def _save(path: str, seed: int, seconds: float, results: list[TrialResult]) -> None:
    rows = [
        {"trial": asdict(r.trial), "violations": r.violations, "detection": r.detection, "fired": r.fired_at}
        for r in results
    ]
    saved = {"seed": seed, "commit": _commit(), "seconds": seconds, "results": rows}
    Path(path).write_text(json.dumps(saved, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--t", type=float, default=3.0, help="heartbeat timeout of the trials")
    parser.add_argument("--exit-t", type=float, default=10.0, help="heartbeat timeout of the exit trials")
    parser.add_argument("--faults", default="kill,exit,pause,crash,stall")
    parser.add_argument("--stores", default="agent,rank0", help="who serves the store: agent, rank0 or both")
    parser.add_argument("--sample", type=int, default=0, help="run this many trials drawn at random (0: all)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--out", default="", help="also write every trial's result to this JSON file")
    parser.add_argument("--write", action="store_true", help="write the table to benchmarks/results and the docs")
    parser.add_argument("--table", nargs="*", default=None, help="write the table from these --out files, run none")
    args = parser.parse_args(argv)
    if args.table is not None:
        loaded, seeds, seconds = [], [], 0.0
        for path in args.table:
            saved = json.loads(Path(path).read_text())
            seeds.append(f"{saved['seed']} at {saved.get('commit', 'unknown')}")
            seconds += saved.get("seconds", 0.0)
            for row in saved["results"]:
                trial = Trial(**{**row["trial"], "victims": tuple(row["trial"]["victims"])})
                detection = {int(k): v for k, v in row["detection"].items()}
                loaded.append(TrialResult(trial, violations=row["violations"], detection=detection))
        write_results(loaded, ", ".join(seeds), seconds)
        return 0
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"[sweep] seed {seed}", flush=True)
    ctx = _context()
    trials: list[Trial] = []
    for fault in args.faults.split(","):
        if fault == "crash":
            trials += crash_trials(args.n, args.t, count_requests(args.n, args.t))
        elif fault == "stall":
            trials += stall_trials(args.n, args.t, tuple(args.stores.split(",")))
        else:
            t = args.exit_t if fault == "exit" else args.t
            trials += fault_trials(args.n, fault, t, random.Random(seed), tuple(args.stores.split(",")))
    if args.sample:
        trials = rng.sample(trials, min(args.sample, len(trials)))
    results = []
    started = time.monotonic()
    for i, trial in enumerate(trials):
        res = run_trial(trial, ctx)
        results.append(res)
        if args.out:  # after every trial: a sweep cut short still leaves its results
            _save(args.out, seed, time.monotonic() - started, results)
        worst = max(res.detection.values(), default=0.0)
        status = "ok" if not res.violations else "VIOLATED: " + "; ".join(res.violations)
        print(f"[sweep] {i + 1}/{len(trials)} {trial.describe()}: {worst:.2f} s, {status}", flush=True)
    if args.write:
        write_results(results, f"{seed} at {_commit()}", time.monotonic() - started)
    failed = [r for r in results if r.violations]
    print(f"[sweep] {len(results) - len(failed)} of {len(results)} trials kept every invariant (seed {seed})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
