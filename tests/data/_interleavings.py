"""Every interleaving of a few actors' steps on one real arena, up to a bound, and a SIGKILL of any actor at any step.

Run as a script (``python -m tests.data._interleavings SCENARIO MUTATION PREEMPTIONS KILLS``, ``""`` for no
mutation), it prints what it explored as JSON.
It loads the arena's modules without the package's ``__init__`` (no torch), so that forking an actor costs about a
millisecond.

*Actors* are processes forked per execution, each running a body (read an index, store one, follow a set) against
one arena file in ``/dev/shm``. A *step* is an actor's run from one step line to the next: a line of the arena's
modules that reads or writes the shared file or its lock (:func:`step_lines`; the lines between them touch only
the actor's own memory, so where else it could be stopped changes nothing another actor sees). A tracer in the
actor stops it before each step line until the scheduler (this process) lets it go. The scheduler runs the actors
one step at a time, so an execution is a sequence of decisions: run actor ``a`` one step, or SIGKILL it (the
kernel then releases its ``flock``, as for any process). An actor waiting to take the lock that another live actor
holds is not runnable.

*Scope*: every execution with at most :data:`PREEMPTIONS` preemptions (a switch away from an actor that could go
on; switching when it ends or waits is free) and at most :data:`KILLS` kills, enumerated depth first, each once
(a stateless search: each execution replays a prefix of decisions, then goes on by default, and its later decision
points branch).

*Invariants*, checked after every decision (on the file as any process sees it):

* every published entry holds exactly its sample's bytes, and no two published entries overlap;
* when no live actor holds the lock: every free range of a following arena lies in ``[pin, used)`` and overlaps
  no published entry and no range a live process is writing;

and at the end of an execution:

* a reader returned its sample's exact bytes or a miss;
* a recount (an eviction by a process of its own) frees every byte of ``[pin, used)`` that no published entry
  holds: space lost to a killed writer comes back;
* the file passes the checks of a restarted or persisted cache's opening (``consistent``), and serves every index
  as its exact bytes or a miss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import json
import os
import re
import signal
import sys
import textwrap
import time
import types
from collections.abc import Callable
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: Preemptions per execution (the 0.4.0 review's two races each need two) and SIGKILLs per execution.
PREEMPTIONS = 2
KILLS = 1
#: Seconds an actor may take to reach its next step line: a step is a few lines of Python.
STEP_TIMEOUT_S = 30.0
N = 4  # indices of the arenas explored; index 3 is never stored (the final recount keeps a set no actor kept)
SIZE = 200  # bytes per sample: 256 with alignment
CAPACITY = 1 << 16

# A line that reads or writes the arena file or takes its lock: the words of the header, the table, the counters,
# the data, the bookkeeping of a following arena, and the flock calls.
_SHARED = re.compile(
    r"header\[|table\[|\bstats\[|words\[|\.data\[|flock\(|posix_fallocate"
    r"|self\._(count|sizes|offsets|inflight)\b|\bsizes\[|space\.(take|hold|release|rebuild|free_bytes)"
)
# Of those, a line that writes: an item assignment (``x[...] = ``, ``+=``, ``-=``) or an allocation. A line that only
# reads is a step outside the lock only: under it, no other process writes what it reads.
_WRITES = re.compile(r"\]\s*(\+=|-=|=)(?!=)|posix_fallocate")


def modules() -> list[types.ModuleType]:
    """The arena's modules: the ones traced, where the steps are."""
    load_slim()
    from ignite_ext.data.cache import _counters, _follow, _life, _mapping, _space, _table, arena

    return [arena, _life, _table, _space, _counters, _follow, _mapping]


def load_slim() -> types.ModuleType:
    """The arena module, imported without the package's ``__init__`` modules (which import torch)."""
    for name in ("ignite_ext", "ignite_ext.data", "ignite_ext.data.cache"):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [str(ROOT / name.replace(".", "/"))]
            sys.modules[name] = module
    import ignite_ext.data.cache.arena as arena

    return arena


def step_lines(modules: list[types.ModuleType]) -> dict[tuple[str, int], str]:
    """``{(file, line): kind}`` of the step lines of ``modules``: ``"lock"``, ``"unlock"``, ``"write"``, ``"read"``."""
    steps = {}
    for module in modules:
        path = module.__file__
        assert path is not None
        for number, text in enumerate(Path(path).read_text().splitlines(), start=1):
            code = text.split("#", 1)[0]
            if "flock(" in code and "LOCK_EX" in code:
                steps[(path, number)] = "lock"
            elif "flock(" in code and "LOCK_UN" in code:
                steps[(path, number)] = "unlock"
            elif _SHARED.search(code) and not code.lstrip().startswith(("def ", "class ", '"')):
                steps[(path, number)] = "write" if _WRITES.search(code) else "read"
    return steps


def expected(index: int) -> bytes:
    return bytes([0x41 + index]) * SIZE


# ---- the actors' bodies: each gets the arena (its own mapping and lock descriptor) and a point() to stop at ----


def store(arena: Any, index: int, point: Callable[[str], None]) -> str:
    """What ``Tiers.store`` does with one tier: reserve, write, publish; abandon on an error."""
    offset = arena.reserve(index, SIZE)
    if offset is None:
        return "no room" if not arena.holds(index) else "stored by another"
    try:
        point("write")
        arena.data_view(offset, SIZE)[:] = expected(index)
    except BaseException:
        arena.abandon(offset)
        raise
    return "stored" if arena.publish(index, offset, SIZE) else "lost the race"


def read(arena: Any, index: int, point: Callable[[str], None]) -> bytes | None:
    raw = arena.lookup(index)
    point("consume")  # a view of a non-following arena is read after lookup returns: another actor may run first
    return None if raw is None else bytes(raw)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """An arena's state before the actors start, and the actors: (name, what it does, its argument)."""

    follow_first: bool  # whether the arena follows before the actors start
    stored: tuple[int, ...]  # indices stored before they start
    actors: tuple[tuple[str, str, Any], ...]
    preemptions: int = PREEMPTIONS  # the bound its exploration runs at (two actors afford a higher one)


SCENARIOS = {
    # A reader of an entry that an evictor evicts while a writer stores another sample, which may reuse its range.
    "evict-while-read": Scenario(
        True, (0,), (("reader", "read", 0), ("evictor", "follow", (1, 2)), ("writer", "store", 1))
    ),
    # A writer in an arena that starts following meanwhile (another process's first follow), then evicts.
    "first-follow": Scenario(
        False, (0,), (("writer", "store", 1), ("follower", "follow", (0, 1, 2)), ("evictor", "follow", (1, 2)))
    ),
    # Two writers of one index and a reader of it, in an arena that does not follow.
    "two-writers": Scenario(False, (), (("writer", "store", 1), ("writer2", "store", 1), ("reader", "read", 1))),
    # A reader of an arena that another process makes follow, stores into, evicts from and stores into again.
    "read-across-first-follow": Scenario(
        False,
        (),
        (
            ("reader", "read", 1),
            ("loader", "then", (("follow", (0, 1, 2)), ("store", 1), ("follow", (2,)), ("store", 2))),
        ),
        preemptions=3,  # the reader's view must outlive a follow, a store and an eviction: three switches
    ),
    # Two writers of different samples and an evictor, in a following arena: free ranges carved and recounted.
    "write-while-evict": Scenario(
        True, (0, 1), (("writer", "store", 2), ("evictor", "follow", (2,)), ("writer2", "store", 0))
    ),
}

# Orderings that handed a reader another sample's bytes, put back: the exploration must find each. The two of the
# 0.4.0 review, and the one the exploration itself found in 0.5.0. Each: (method, how, its arguments), line counts
# kept (the tracer knows steps by line): "swap" two lines, "drop" lines (made ``pass``), "replace" parts of lines.
MUTATIONS: dict[str, tuple[str, str, Any]] = {
    # The era bumped before the evicted entries are marked empty.
    "era-before-evict": ("Following.follow", "swap", ("table[gone, 0] = EMPTY", "header[H_ERA] += 1")),
    # A reserve that checked "not following" without the lock, and not again under it.
    "reserve-without-recheck": ("AppendOnly.reserve", "drop", ("if header[H_FOLLOW]:  # another process made it", 3)),
    # A lookup that asks whether the arena follows before it reads the entry, not after.
    "follow-asked-first": (
        "AppendOnly.read",
        "replace",
        (
            ("table = local.table", "table, was = local.table, local.header[H_FOLLOW]"),
            ("if local.header[H_FOLLOW]:  # asked after the entry", "if was:  # asked after the entry"),
        ),
    ),
}


def mutate(name: str) -> None:
    """Replace a space policy's method by its mutated source, compiled at its own file and lines (still traced)."""
    from ignite_ext.data.cache import _space

    target, how, edit = MUTATIONS[name]
    owner, function = target.split(".")
    lines, start = inspect.getsourcelines(getattr(getattr(_space, owner), function))

    def at(text: str) -> int:
        found = [i for i, line in enumerate(lines) if text in line]
        assert len(found) == 1, f"the mutation {name} no longer applies: the code changed"
        return found[0]

    if how == "swap":
        first, second = at(edit[0]), at(edit[1])
        lines[first], lines[second] = lines[second], lines[first]
    elif how == "drop":
        first = at(edit[0])
        indent = lines[first][: len(lines[first]) - len(lines[first].lstrip())]
        lines[first : first + edit[1]] = [indent + "pass\n"] * edit[1]
    else:
        for old, new in edit:
            lines[at(old)] = lines[at(old)].replace(old, new)
    source = "\n" * (start - 1) + textwrap.dedent("".join(lines))
    flags = annotations.compiler_flag  # the feature this module imports: the source compiled as the module is
    code = compile(source, str(_space.__file__), "exec", flags=flags, dont_inherit=True)
    namespace: dict[str, Any] = {}
    exec(code, vars(_space), namespace)
    setattr(getattr(_space, owner), function, namespace[function])


# ---- invariants ----


def published(arena: Any, m: types.ModuleType) -> list[tuple[int, int, int]]:
    """``(index, offset, length)`` of the published entries of ``arena``."""
    table = arena._mapped().table
    from ignite_ext.data.cache._mapping import ENTRY_WORDS, READY

    words = ENTRY_WORDS
    return [(i, int(table[i * words + 1]), int(table[i * words + 2])) for i in range(N) if table[i * words] == READY]


def check(arena: Any, m: types.ModuleType, locked: bool) -> str | None:
    """What is wrong with the file as any process sees it now, or None; ``locked``: a live process holds the lock."""
    from ignite_ext._fs import pid_alive
    from ignite_ext.data.cache import _mapping as L
    from ignite_ext.data.cache._space import follow_space

    local = arena._mapped()
    entries = published(arena, m)
    spans = sorted((off, off + L.aligned(length), i) for i, off, length in entries)
    for i, off, length in entries:
        if bytes(local.data[off : off + length]) != expected(i):
            return f"published entry {i} does not hold its bytes"
    if any(start < end for (_, end, _), (start, _, _) in itertools.pairwise(spans)):
        return "two published entries overlap"
    if locked or not local.header[L.H_FOLLOW]:
        return None
    space = follow_space(local)
    pin, used = int(local.header[L.H_PIN]), int(local.header[L.H_USED])
    count = int(space._count[0])
    free = [(int(o), int(o) + int(s)) for o, s in zip(space._offsets[:count], space._sizes[:count], strict=True)]
    held = space._inflight[space._inflight[:, 0] != 0]
    writing = [(int(o), int(o) + int(s)) for p, o, s in held if pid_alive(int(p))]
    for start, end in free:
        if start < pin or end > used:
            return f"free range [{start}, {end}) outside [pin {pin}, used {used})"
        if any(start < other_end and other_start < end for other_start, other_end, *_ in [*spans, *writing]):
            return f"free range [{start}, {end}) overlaps bytes in use: {spans} published, {writing} being written"
    return None


# ---- the actors ----


class _Actor:
    def __init__(self, index: int, name: str, pid: int, conn: Connection) -> None:
        self.index, self.name, self.pid, self.conn = index, name, pid, conn
        self.pending: Any = None  # the step it waits before (a step line, or a label of its body); None once ended
        self.alive = True
        self.result: Any = None

    @property
    def running(self) -> bool:
        return self.alive and self.pending is not None


def _serve(conn: Connection, m: types.ModuleType, path: str, steps: dict) -> None:
    """An actor's process: for each body the scheduler sends, run it, taking the steps granted, checking writes.

    The scheduler grants ``budget`` steps (-1: up to the end), and says whether another live actor holds the lock
    (then the actor stops before taking it). The actor reports the kinds of the steps it took, and where it stopped,
    how it ended, or the first violation it saw (after each write, at its next step: the state it left).
    """
    from ignite_ext.data.cache._space import AppendOnly

    traced = {file for file, _ in steps}
    arena = m.Arena.attach(path)
    state: dict[str, Any] = {}

    def stop_or_go(key: Any, kind: str) -> None:
        if state["dirty"]:
            state["dirty"] = False
            problem = check(arena, m, state["holding"] or state["others"])
            if problem is not None:
                conn.send(("violation", state["taken"], problem))
                os._exit(0)
        if state["budget"] == 0 or (kind == "lock" and state["others"]):
            conn.send(("at", state["taken"], key))
            state["budget"], state["others"] = conn.recv()
            state["taken"] = []
        state["taken"].append(kind)
        state["budget"] -= 1
        if kind in ("lock", "unlock"):
            state["holding"] = kind == "lock"
        state["dirty"] = kind in ("write", "unlock", "label")

    def point(label: str) -> None:
        sys.settrace(None)  # called by the body, not the tracer: what the check reads must not be a step
        stop_or_go(label, "label")
        sys.settrace(calls)

    def local(frame: types.FrameType, event: str, _: Any) -> Any:
        key = (frame.f_code.co_filename, frame.f_lineno)
        if event == "line" and (kind := steps.get(key)) is not None and (kind != "read" or not state["holding"]):
            stop_or_go(key, kind)
        return local

    def calls(frame: types.FrameType, event: str, _: Any) -> Any:
        return local if frame.f_code.co_filename in traced else None

    while True:
        kind, arg = conn.recv()
        mapped = arena._mapped()  # the file was reset: its mode and bookkeeping are read anew
        mapped.follow, mapped.space = None, AppendOnly
        state.update(holding=False, budget=0, others=False, taken=[], dirty=False)
        sys.settrace(calls)  # with a budget of 0: the first step reports where the actor starts
        try:
            if kind == "read":
                result: Any = read(arena, arg, point)
            elif kind == "store":
                result = store(arena, arg, point)
            elif kind == "follow":
                result = tuple(arena.follow(list(arg)))
            else:  # "then": a sequence of (kind, arg), one process doing them in turn
                result = [store(arena, a, point) if k == "store" else tuple(arena.follow(list(a))) for k, a in arg]
            sys.settrace(None)
            problem = check(arena, m, state["others"]) if state["dirty"] else None
            conn.send(("violation", state["taken"], problem) if problem else ("done", state["taken"], result))
        except BaseException as exc:  # reported to the scheduler as a violation
            sys.settrace(None)
            conn.send(("violation", state["taken"], f"raised {type(exc).__name__}: {exc}"))


class Pool:
    """A scenario's arena, in the state the actors start from, and one process per actor, forked again once killed.

    Each execution starts from the same bytes (:meth:`reset`), so an actor's process serves execution after
    execution, and a fork costs only where an execution killed one.
    """

    def __init__(self, m: types.ModuleType, scenario: Scenario, steps: dict) -> None:
        self.m, self.scenario, self.steps = m, scenario, steps
        self.arena = m.Arena.create(n=N, capacity=CAPACITY, sweep=False)
        if scenario.follow_first:
            self.arena.follow(range(N - 1))
        for index in scenario.stored:
            assert store(self.arena, index, lambda label: None) == "stored"
        self.snapshot = bytes(self.arena._mapped().mm)
        self.processes: list[tuple[int, Connection] | None] = [None] * len(scenario.actors)

    def reset(self) -> None:
        from ignite_ext.data.cache._space import AppendOnly

        local = self.arena._mapped()
        local.mm[:] = self.snapshot
        local.follow, local.space = None, AppendOnly

    def process(self, index: int) -> tuple[int, Connection]:
        if (held := self.processes[index]) is not None:
            return held
        mine, theirs = Pipe()
        pid = os.fork()
        if pid == 0:
            mine.close()
            try:
                _serve(theirs, self.m, self.arena.path, self.steps)
            finally:
                os._exit(1)
        theirs.close()
        self.processes[index] = (pid, mine)
        return pid, mine

    def killed(self, index: int) -> None:
        held = self.processes[index]
        if held is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(held[0], signal.SIGKILL)
            os.waitpid(held[0], 0)
            held[1].close()
            self.processes[index] = None

    def close(self) -> None:
        for index in range(len(self.processes)):
            self.killed(index)
        self.arena.close()


class Execution:
    """One execution: the decisions of ``prefix``, then the default ones, from the pool's starting state.

    The default is to go on with the actor that ran last while it can, else to run the first actor that can. An
    actor runs as many steps at once as the decisions grant it (the others stand still meanwhile), and the
    scheduler records, for each step, which actors could have run instead: where the search branches.
    """

    def __init__(self, pool: Pool, prefix: list[tuple[str, int]]) -> None:
        self.pool, self.m, self.scenario, self.steps, self.prefix = pool, pool.m, pool.scenario, pool.steps, prefix
        self.arena = pool.arena
        self.points: list[tuple[list[int], int | None, int, int, list[int]]] = []  # enabled, current, p, k, alive
        self.decisions: list[tuple[str, int]] = []
        self.violation: str | None = None
        self.holder: int | None = None

    def run(self) -> None:
        self.pool.reset()
        self.actors = []
        for index, (name, kind, arg) in enumerate(self.scenario.actors):
            pid, conn = self.pool.process(index)
            actor = _Actor(index, name, pid, conn)
            conn.send((kind, arg))
            self.actors.append(actor)
            self._receive(actor)
        try:
            self._schedule()
        finally:
            for actor in self.actors:
                if not actor.alive or actor.pending is not None or self.violation is not None:
                    self.pool.killed(actor.index)  # killed, or stopped half-way: its process is of no more use
        if self.violation is None:
            self._final()

    def _receive(self, actor: _Actor) -> list[str]:
        """The steps ``actor`` took since it was let go, and where it stopped (or how it ended)."""
        if not actor.conn.poll(STEP_TIMEOUT_S):
            raise TimeoutError(f"{actor.name} did not reach its next step in {STEP_TIMEOUT_S} s")
        what, taken, detail = actor.conn.recv()
        if what == "at":
            actor.pending = detail
        else:
            actor.pending, actor.result = None, detail
            if what == "violation":
                self.violation = f"{actor.name}: {detail}"
        return taken  # type: ignore[no-any-return]

    def _enabled(self) -> list[int]:
        return [
            a.index
            for a in self.actors
            if a.running and not (self.steps.get(a.pending) == "lock" and self.holder not in (None, a.index))
        ]

    def _schedule(self) -> None:
        current: int | None = None
        preemptions = kills = 0
        while self.violation is None:
            enabled = self._enabled()
            alive = [a.index for a in self.actors if a.running]
            if not enabled:
                if alive:
                    self.violation = f"deadlock: {[self.actors[i].name for i in alive]} wait"
                return
            position = len(self.decisions)
            default = ("run", current if current in enabled else enabled[0])
            kind, who = self.prefix[position] if position < len(self.prefix) else default
            actor = self.actors[who]
            if kind == "kill":
                self.points.append((enabled, current, preemptions, kills, alive))
                self.decisions.append(("kill", who))
                self.pool.killed(who)
                actor.alive = False
                if self.holder == who:
                    self.holder = None  # the kernel releases a dead process's flock
                kills += 1
                self.violation = check(self.arena, self.m, self.holder is not None)
                continue
            before, preempted = current, preemptions
            if current in enabled and who != current:
                preemptions += 1
            current = who
            granted = 0  # the steps the prefix grants this actor in a row; -1: up to its end (the default)
            while position + granted < len(self.prefix) and self.prefix[position + granted] == ("run", who):
                granted += 1
            if position + granted >= len(self.prefix):
                granted = -1
            actor.conn.send((granted, self.holder not in (None, who)))
            for j, step in enumerate(self._receive(actor)):  # each step taken was a point where others could run
                running = [a.index for a in self.actors if a.running or a is actor]
                if j == 0:
                    self.points.append((enabled, before, preempted, kills, alive))
                else:
                    self.points.append((self._enabled_or(who), who, preemptions, kills, running))
                self.decisions.append(("run", who))
                if step == "lock":
                    self.holder = who
                elif step == "unlock":
                    self.holder = None

    def _enabled_or(self, who: int) -> list[int]:
        """The actors that could run now, ``who`` among them (it is running: its recorded step is stale)."""
        return sorted({*self._enabled(), who})

    def _final(self) -> None:
        from ignite_ext.data.cache import _mapping as L
        from ignite_ext.data.cache._space import follow_space

        m = self.m
        for actor in self.actors:
            kind = self.scenario.actors[actor.index][1]
            if kind == "read" and actor.result is not None:
                got = actor.result
                if got is not None and got != expected(self.scenario.actors[actor.index][2]):
                    self.violation = f"{actor.name} returned another sample's bytes"
                    return
        local = self.arena._mapped()
        if local.header[L.H_FOLLOW]:
            self.arena.follow(range(N))  # a set no actor kept: an eviction (the recount of a following arena)
            space = follow_space(local)
            pin, used = int(local.header[L.H_PIN]), int(local.header[L.H_USED])
            held = sum(L.aligned(length) for _, off, length in published(self.arena, m) if off >= pin)
            if space.free_bytes() != used - pin - held:
                self.violation = f"after a recount {space.free_bytes()} bytes free, not {used - pin - held}"
                return
        opened = m.Arena.attach(self.arena.path)
        try:
            problem = opened.consistent()
            if problem is not None:
                self.violation = f"the file fails the opening checks: {problem}"
                return
            for i in range(N):
                raw = opened.lookup(i)
                if raw is not None and bytes(raw) != expected(i):
                    self.violation = f"the opened file serves other bytes for {i}"
                    return
        finally:
            opened.close()


def explore(
    scenario_name: str, mutation: str | None = None, preemptions: int = PREEMPTIONS, kills: int = KILLS
) -> dict[str, Any]:
    """Every execution of a scenario within the bounds; stops at the first violation."""
    arena_module = load_slim()
    if mutation is not None:
        mutate(mutation)
    steps = step_lines(modules())
    scenario = SCENARIOS[scenario_name]
    started = time.monotonic()
    pool = Pool(arena_module, scenario, steps)
    try:
        return _search(pool, scenario_name, mutation, preemptions, kills, started)
    finally:
        pool.close()


def _search(
    pool: Pool, scenario_name: str, mutation: str | None, preemptions: int, kills: int, started: float
) -> dict[str, Any]:
    scenario = pool.scenario
    stack: list[list[tuple[str, int]]] = [[]]
    executions = longest = 0
    while stack:
        prefix = stack.pop()
        execution = Execution(pool, prefix)
        execution.run()
        executions += 1
        longest = max(longest, len(execution.decisions))
        if execution.violation is not None:
            return {
                "scenario": scenario_name,
                "mutation": mutation,
                "executions": executions,
                "violation": execution.violation,
                "schedule": [f"{k} {scenario.actors[w][0]}" for k, w in execution.decisions],
                "seconds": round(time.monotonic() - started, 1),
            }
        for position in range(len(prefix), len(execution.points)):
            enabled, current, preempted, killed, alive = execution.points[position]
            taken = execution.decisions[position]
            for who in enabled:
                if ("run", who) == taken:
                    continue
                if current in enabled and who != current and preempted >= preemptions:
                    continue
                stack.append([*execution.decisions[:position], ("run", who)])
            if killed < kills:
                for who in alive:
                    stack.append([*execution.decisions[:position], ("kill", who)])
    return {
        "scenario": scenario_name,
        "mutation": mutation,
        "executions": executions,
        "longest": longest,
        "steps": len(pool.steps),
        "violation": None,
        "seconds": round(time.monotonic() - started, 1),
    }


if __name__ == "__main__":
    name, mutation, preemptions, kills = sys.argv[1:5]
    print(json.dumps(explore(name, mutation or None, int(preemptions), int(kills))))
