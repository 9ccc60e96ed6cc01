"""Run a function on several real processes, with a hard deadline, and always reap them.

Every multi-process test goes through the ``world`` fixture (``tests/conftest.py``), which runs bodies with the
:class:`World` of its param. Native worlds go through :func:`run_world`: it starts ``nprocs`` processes (from a
forkserver that has torch and ignite preloaded, so a world starts in well under a second), optionally joins them
in a gloo process group through ``idist.initialize``, and collects what each rank returned or raised. If the
deadline passes, every live process first dumps its Python stacks to stderr (faulthandler on SIGUSR1) and is
then SIGKILLed, and the call fails: a hang is a test failure, never a stuck CI job. Horovod and XLA worlds are
started once by ``tests.backends._launch`` (:class:`LaunchedWorld`) under the same kind of deadline, and killed
with their whole process tree.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import importlib.util
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import pytest

from benchmarks._node_memory import descendants

__all__ = [
    "BACKENDS",
    "CHANNELS",
    "LaunchedWorld",
    "RankResult",
    "World",
    "WorldDeadlineError",
    "free_port",
    "make_world",
    "run_world",
    "values",
]

_CTX = mp.get_context("forkserver")
# This module too: every rank unpickles ``_child`` from it, and bodies from test modules that import pytest.
_CTX.set_forkserver_preload(["torch", "ignite.distributed", "ignite_ext.distributed", "pytest", "tests._world"])


@dataclass
class RankResult:
    """What one rank of a world did."""

    rank: int
    ok: bool = False
    value: Any = None
    exc_type: str | None = None
    message: str | None = None
    traceback: str | None = None
    exitcode: int | None = None
    timed_out: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def killed(self) -> bool:
        return self.exitcode == -signal.SIGKILL

    def __str__(self) -> str:
        if self.ok:
            return f"rank {self.rank}: ok -> {self.value!r}"
        if self.exc_type:
            return f"rank {self.rank}: {self.exc_type}: {self.message}\n{self.traceback}"
        return f"rank {self.rank}: no result (exit code {self.exitcode}, timed out: {self.timed_out})"


class WorldDeadlineError(AssertionError):
    """Some ranks were still running at the deadline (they have been killed)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_STACKS: Any = None


def _main_stacks(text: str, frames: int = 8) -> str:
    """The main threads' stacks in faulthandler dumps (the threads not started by ``threading``), innermost first."""
    blocks = [b.strip().splitlines() for b in text.split("\n\n") if b.strip()]
    return "\n".join("\n".join(b[: frames + 1]) for b in blocks if "threading.py" not in b[-1] or len(b) == 1)


def _child(
    conn: Connection,
    rank: int,
    env: dict[str, str],
    backend: str | None,
    pg_timeout: float | None,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    os.environ.update(env)
    global _STACKS
    # Appended to by the rank and by the DataLoader workers it forks (they inherit the handler and the file).
    _STACKS = open(env["_WORLD_STACKS"], "a")  # noqa: SIM115 - open for the process's life
    faulthandler.register(signal.SIGUSR1, file=_STACKS, all_threads=True)
    try:
        if backend is not None:
            from datetime import timedelta

            import ignite.distributed as idist

            init_kwargs: dict[str, Any] = {}
            if pg_timeout is not None:
                init_kwargs["timeout"] = timedelta(seconds=pg_timeout)
            idist.initialize(backend, **init_kwargs)
        value = fn(*args, **kwargs)
        conn.send(("ok", value))
    except BaseException as exc:  # report everything, SystemExit included
        conn.send(("err", type(exc).__name__, str(exc), traceback.format_exc()))
    finally:
        conn.close()
    # Exit handlers run as at a normal exit (rank 0 waits there for its peers to read the last outcome), but
    # the rest of interpreter teardown (and idist.finalize) is skipped: a rank whose peers failed must not
    # block in a destructor, and the parent only needs the result that was just sent.
    atexit._run_exitfuncs()
    os._exit(0)


def run_world(
    fn: Callable[..., Any],
    nprocs: int = 4,
    *,
    nproc_per_node: int | None = None,
    backend: str | None = "gloo",
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    deadline: float = 60.0,
    pg_timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    rank_env: Callable[[int], Mapping[str, str]] | None = None,
    on_start: Callable[[list[Any]], None] | None = None,
    allow_deadline: bool = False,
) -> list[RankResult]:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` processes and return one :class:`RankResult` per rank.

    ``nproc_per_node`` < ``nprocs`` simulates several nodes: ``LOCAL_RANK`` is ``rank % nproc_per_node`` and
    idist derives ``node_rank = rank // nproc_per_node``. ``backend=None`` starts plain processes (``RANK`` is
    still set). ``on_start`` receives the started processes (e.g. to SIGKILL one later from a thread).
    """
    npn = nproc_per_node or nprocs
    port = free_port()
    procs: list[Any] = []
    conns: dict[Connection, int] = {}
    results = [RankResult(rank=r) for r in range(nprocs)]
    stacks = tempfile.mkdtemp(prefix="world-stacks-")
    dumped = ""
    try:
        for rank in range(nprocs):
            child_env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(nprocs),
                "LOCAL_RANK": str(rank % npn),
                "LOCAL_WORLD_SIZE": str(npn),
                "GROUP_RANK": str(rank // npn),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                **(env or {}),
                **(rank_env(rank) if rank_env else {}),
                "_WORLD_STACKS": os.path.join(stacks, f"rank{rank}"),
            }
            parent_conn, child_conn = _CTX.Pipe(duplex=False)
            proc = _CTX.Process(
                target=_child,
                args=(child_conn, rank, child_env, backend, pg_timeout, fn, tuple(args), dict(kwargs or {})),
                # Not daemonic: a rank may start DataLoader workers. Every process is reaped in ``finally``.
                daemon=False,
            )
            proc.start()
            child_conn.close()
            procs.append(proc)
            conns[parent_conn] = rank
        if on_start is not None:
            on_start(procs)
        end = time.monotonic() + deadline
        pending = dict(conns)
        while pending:
            left = end - time.monotonic()
            if left <= 0:
                break
            for conn in wait(list(pending), timeout=left):
                rank = pending.pop(conn)  # type: ignore[call-overload]
                try:
                    msg = conn.recv()
                except EOFError:
                    continue  # died without reporting (e.g. SIGKILL): exit code tells
                res = results[rank]
                if msg[0] == "ok":
                    res.ok, res.value = True, msg[1]
                else:
                    res.exc_type, res.message, res.traceback = msg[1], msg[2], msg[3]
        timed_out = sorted(pending.values())
        for rank in timed_out:
            results[rank].timed_out = True
            # The rank, or the workers it forked, which keep its end of the pipe open after it died.
            for pid in [procs[rank].pid, *descendants(procs[rank].pid)]:
                with open(os.path.join(stacks, f"rank{rank}"), "a") as f:
                    f.write(f"\npid {pid}:\n\n")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
                time.sleep(0.2)  # one process at a time: their dumps share the file
        if timed_out:
            time.sleep(0.3)
            for rank in timed_out:
                with contextlib.suppress(OSError):
                    text = Path(stacks, f"rank{rank}").read_text()
                    sys.stderr.write(f"rank {rank} and its children, every thread:\n{text}\n")
                    dumped += f"rank {rank} (or a process it forked), main threads:\n{_main_stacks(text)}\n"
    finally:
        shutil.rmtree(stacks, ignore_errors=True)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(5)
        for rank, proc in enumerate(procs):
            results[rank].exitcode = proc.exitcode
        for conn in conns:
            conn.close()
    if timed_out and not allow_deadline:
        raise WorldDeadlineError(
            f"ranks {timed_out} were still running after {deadline}s and were killed:\n"
            + "\n".join(str(r) for r in results)
            + (f"\n{dumped}" if dumped else "")
        )
    return results


def values(results: list[RankResult]) -> list[Any]:
    """Return every rank's value, or fail with every failing rank's traceback."""
    bad = [r for r in results if not r.ok]
    if bad:
        raise AssertionError("some ranks failed:\n" + "\n".join(str(r) for r in bad))
    return [r.value for r in results]


# ---------------------------------------------------------------------------------------------- the world fixture
#
# ``tests/conftest.py`` turns these into the ``world`` fixture: a :class:`World` per backend (or scheduler
# channel), each with a launcher. Native worlds (gloo, NCCL) go through :func:`run_world`; Horovod and XLA worlds
# are started once by ``tests.backends._launch`` and run one job per call; the serial world calls the body in the
# test's own process.

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_WORLD = "gloo"  # what a test gets from ``world`` when nothing parametrises it
DEADLINE = 60.0
HOROVOD_NPROC = 4
# Starting a Horovod world (its Gloo rendezvous, four interpreters importing torch and horovod) takes 20-30 s on
# two busy cores: the first job of a launched world gets this long, every later job JOB_DEADLINE.
SUBPROCESS_DEADLINE = float(os.environ.get("IGNITE_EXT_BACKEND_DEADLINE", "120"))
JOB_DEADLINE = 60.0
_RENDEZVOUS_MISSED = "http_store.cc"  # where horovod's Gloo rendezvous reports "Wait timeout after N seconds"
COLLECTIVE_CHANNEL = {"IGNITE_EXT_SCHEDULER_CHANNEL": "collective"}


def agent_store_env(port: int, heartbeat_timeout: float) -> dict[str, str]:
    """The environment of ranks whose store another process serves, as torchrun's agent serves it.

    Torch before 2.6 also wants the restart count torchrun sets beside ``TORCHELASTIC_USE_AGENT_STORE``.
    """
    return {
        "IGNITE_EXT_HEARTBEAT_TIMEOUT": str(heartbeat_timeout),
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }


@dataclass
class World:
    """How to run a function on every rank of one world.

    ``world(fn, *args, **options)`` runs ``fn(*args)`` on every rank and returns every rank's value, or fails with
    every failing rank's report; ``world.results(fn, *args, **options)`` returns the :class:`RankResult` of every
    rank as is (for bodies where some ranks are expected to die). ``fn`` must be defined at module level: it
    travels to the ranks pickled by reference. Options, all optional:

    * every world: ``env`` (added to every rank's environment), ``pg_timeout`` (the native process group's
      timeout), ``deadline`` (seconds before the whole world is killed); the serial world ignores them;
    * native worlds (gloo, NCCL) also take ``nprocs``, ``nproc_per_node`` (fewer than ``nprocs`` simulates several
      nodes), ``backend`` (``None``: plain processes, no process group), ``rank_env``, ``on_start`` and
      ``allow_deadline`` (see :func:`run_world`).
    """

    name: str
    backend: str | None  # what idist.backend() says on every rank
    nprocs: int
    nproc_per_node: int
    run: Callable[..., list[RankResult]]

    @property
    def collective(self) -> bool:
        """Whether the scheduler waits with collectives here (the forced channel) or through a store (every backend)."""
        return self.name == "gloo-collective"

    @property
    def serial(self) -> bool:
        """Whether the body runs in the test's own process (no world at all)."""
        return self.name == "serial"

    def results(self, fn: Callable[..., Any], *args: Any, **options: Any) -> list[RankResult]:
        return self.run(fn, args, **options)

    def __call__(self, fn: Callable[..., Any], *args: Any, **options: Any) -> list[Any]:
        results = self.run(fn, args, **options)
        try:
            return values(results)
        except AssertionError as exc:
            output = next((r.extra["output"] for r in results if "output" in r.extra), "")
            raise AssertionError(f"{exc}\nlauncher output (tail):\n{output}" if output else str(exc)) from None


def _serial(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    env: Mapping[str, str] | None = None,
    pg_timeout: float | None = None,
    deadline: float | None = None,
) -> list[RankResult]:
    # No process: env, pg_timeout and deadline have nothing to apply to (the test's own timeout still holds).
    res = RankResult(rank=0)
    try:
        res.value = fn(*args)
        res.ok = True
    except Exception as exc:
        res.exc_type, res.message, res.traceback = type(exc).__name__, str(exc), traceback.format_exc()
    return [res]


def _native(
    backend: str, nprocs: int, nproc_per_node: int | None = None, base_env: Mapping[str, str] | None = None
) -> Callable[..., list[RankResult]]:
    default_backend, default_nprocs, default_npn = backend, nprocs, nproc_per_node

    def run(
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        *,
        nprocs: int = default_nprocs,
        nproc_per_node: int | None = default_npn,
        backend: str | None = default_backend,
        env: Mapping[str, str] | None = None,
        deadline: float = DEADLINE,
        **options: Any,  # pg_timeout, rank_env, on_start, allow_deadline: run_world's
    ) -> list[RankResult]:
        return run_world(
            fn,
            nprocs,
            nproc_per_node=nproc_per_node,
            backend=backend,
            args=args,
            env={**(base_env or {}), **(env or {})},
            deadline=deadline,
            **options,
        )

    return run


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the launcher's process group and any descendant that left it (horovod starts its own).

    The multiprocessing semaphores they had mapped go too: their resource tracker dies with them and would have
    unlinked them (a Horovod world left 20 ``/dev/shm/sem.mp-*`` per teardown).
    """
    pids: list[int] = []
    try:
        import psutil

        pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    except Exception:  # psutil missing or the launcher already gone: the process group still catches most
        pass
    semaphores = set()
    for pid in (proc.pid, *pids):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            semaphores.update(line.split()[5] for line in maps if "/dev/shm/sem.mp-" in line)  # its path
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    for path in semaphores:
        with contextlib.suppress(OSError):
            os.unlink(path)


class LaunchedWorld:
    """A Horovod or XLA world started once by ``tests.backends._launch``, running one function per :meth:`call`."""

    def __init__(self, backend: str, nprocs: int, env: Mapping[str, str]) -> None:
        self.backend, self.nprocs, self.calls = backend, nprocs, 0
        self.jobdir = Path(tempfile.mkdtemp(prefix="ignite_ext_world_"))
        cmd = [sys.executable, "-m", "tests.backends._launch", backend, str(nprocs), str(self.jobdir)]
        child_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
        with open(self.jobdir / "launcher.log", "wb") as log:  # a file, not a pipe: nothing to drain
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=child_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.in_step = True  # every rank reported ok on the last job, so all wait for the next one

    @property
    def usable(self) -> bool:
        return self.in_step and self.proc.poll() is None

    def output(self) -> str:
        return (self.jobdir / "launcher.log").read_bytes().decode(errors="replace")[-6000:]

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], deadline: float | None = None) -> list[RankResult]:
        from tests.backends._launch import publish

        n, self.calls = self.calls, self.calls + 1
        # The first job also waits for the world to start.
        job_deadline = deadline or JOB_DEADLINE
        end = time.monotonic() + (max(SUBPROCESS_DEADLINE, job_deadline) if n == 0 else job_deadline)
        publish(self.jobdir / f"job{n}.pkl", (fn, list(args)))  # fn pickles by reference: ranks import its module
        paths = [self.jobdir / f"job{n}.rank{r}.pkl" for r in range(self.nprocs)]
        while not all(p.exists() for p in paths) and self.proc.poll() is None and time.monotonic() < end:
            time.sleep(0.02)
        results = []
        for rank, path in enumerate(paths):
            res = RankResult(rank=rank, exitcode=self.proc.poll())
            if path.exists():
                record = pickle.loads(path.read_bytes())
                if record[0] == "ok":
                    res.ok, res.value = True, record[1]
                else:
                    res.exc_type, res.message, res.traceback = record[1:]
            else:
                res.timed_out = time.monotonic() >= end
            results.append(res)
        # A rank that failed may be out of step with the others: never give this world another job.
        self.in_step = all(r.ok for r in results)
        if not self.in_step:
            self.close(keep_log=True)
            output = self.output()  # the only trace of ranks that died without reporting
            shutil.rmtree(self.jobdir, ignore_errors=True)
            for r in results:
                r.extra["output"] = output
        return results

    def close(self, keep_log: bool = False) -> None:
        # Killed rather than stopped: every result is in, and a graceful Horovod shutdown takes another 10-15 s.
        _kill_tree(self.proc)  # stragglers outlive a launcher that returned, or one that is stuck
        self.in_step = False
        if not keep_log:
            shutil.rmtree(self.jobdir, ignore_errors=True)


def _launched(
    backend: str, nprocs: int, base_env: Mapping[str, str], launched: dict[str, LaunchedWorld]
) -> Callable[..., list[RankResult]]:
    def run(
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        *,
        env: Mapping[str, str] | None = None,
        pg_timeout: float | None = None,  # no native process group here: nothing to apply it to
        deadline: float | None = None,
    ) -> list[RankResult]:
        if env:  # settings that take effect at start-up: a world of its own
            for _ in range(3):
                own = LaunchedWorld(backend, nprocs, {**base_env, **env})
                try:
                    results = own.call(fn, args, deadline)
                finally:
                    own.close()
                # A short Gloo timeout also bounds Horovod's start-up rendezvous, which a busy machine can miss:
                # that is the environment, not the behaviour under test, so start the world again.
                if any(r.ok or r.exc_type for r in results) or _RENDEZVOUS_MISSED not in results[0].extra["output"]:
                    return results
            return results
        shared = launched.get(backend)
        if shared is None or not shared.usable:
            shared = launched[backend] = LaunchedWorld(backend, nprocs, base_env)
        return shared.call(fn, args, deadline)

    return run


@cache
def _horovod_skip_reason() -> str | None:
    failed = os.environ.get("IGNITE_EXT_HOROVOD_BUILD_FAILED")
    if failed:
        return f"horovod wheel build failed: {failed}"
    if importlib.util.find_spec("horovod") is None:
        return "horovod not installed (scripts/horovod_wheel.sh builds and installs it; scripts/test.sh runs it)"
    # Import its compiled torch extension in a child: a broken build fails there, not in this process.
    probe = subprocess.run([sys.executable, "-c", "import horovod.torch"], capture_output=True, timeout=120)
    if probe.returncode != 0:
        return "horovod.torch does not import: " + probe.stderr.decode(errors="replace").strip().splitlines()[-1]
    return None


def _xla_skip_reason() -> str | None:
    if importlib.util.find_spec("torch_xla") is None:
        return "torch_xla not installed: the XLA tests run in their own venv through scripts/xla_tests.sh"
    return None


def _nccl_skip_reason() -> str | None:
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return "no CUDA GPU: NCCL needs one GPU per rank (run scripts/nccl_check.sh on a GPU machine)"
    if not torch.distributed.is_nccl_available():
        return "this torch build has no NCCL"
    return None


def make_world(name: str, launched: dict[str, LaunchedWorld]) -> World:
    """The world called ``name`` (a param of the ``world`` fixture), or a skip that says why it cannot run here."""
    if name == "serial":
        # With torch_xla importable and PJRT_DEVICE set, ignite takes a plain process for an XLA world of one.
        xla_context = _xla_skip_reason() is None and bool(os.environ.get("PJRT_DEVICE"))
        return World(name, "xla-tpu" if xla_context else None, 1, 1, _serial)
    if name == "gloo":
        return World(name, "gloo", 4, 4, _native("gloo", 4))
    if name == "gloo-2nodes":
        return World(name, "gloo", 4, 2, _native("gloo", 4, 2))
    if name == "gloo-collective":
        return World(name, "gloo", 4, 4, _native("gloo", 4, base_env=COLLECTIVE_CHANNEL))
    if name == "horovod":
        reason = _horovod_skip_reason()
        if reason:
            pytest.skip(reason)
        env = {"HOROVOD_GLOO_TIMEOUT_SECONDS": "60"}
        run = _launched("horovod", HOROVOD_NPROC, env, launched)
        return World(name, "horovod", HOROVOD_NPROC, HOROVOD_NPROC, run)
    if name == "xla":
        reason = _xla_skip_reason()
        if reason:
            pytest.skip(reason)
        # Only one device works with PJRT on CPU, so the XLA world has one rank.
        return World(name, "xla-tpu", 1, 1, _launched("xla-tpu", 1, {"PJRT_DEVICE": "CPU"}, launched))
    if name == "nccl":
        reason = _nccl_skip_reason()
        if reason:
            pytest.skip(reason)
        import torch

        n = min(4, torch.cuda.device_count())
        return World(name, "nccl", n, n, _native("nccl", n))
    raise ValueError(f"no world called {name!r}")


# The backend matrix (tests/backends): ``pytest.mark.parametrize("world", BACKENDS, indirect=True)``.
BACKENDS = [
    pytest.param("serial", id="serial"),
    pytest.param("gloo", id="gloo-4", marks=pytest.mark.distributed),
    pytest.param("gloo-2nodes", id="gloo-2x2", marks=[pytest.mark.distributed, pytest.mark.multinode]),
    pytest.param("horovod", id="horovod-4", marks=[pytest.mark.distributed, pytest.mark.horovod]),
    pytest.param("xla", id="xla-1", marks=[pytest.mark.distributed, pytest.mark.xla]),
    pytest.param("nccl", id="nccl", marks=[pytest.mark.distributed, pytest.mark.nccl]),
]

# The scheduler's ways of waiting (tests/distributed/test_schedule.py): in one process, through the store, and
# with collectives (forced with IGNITE_EXT_SCHEDULER_CHANNEL=collective on the same gloo world).
CHANNELS = [
    pytest.param("serial", id="serial"),
    pytest.param("gloo", id="store", marks=pytest.mark.distributed),
    pytest.param("gloo-collective", id="collective", marks=pytest.mark.distributed),
]
