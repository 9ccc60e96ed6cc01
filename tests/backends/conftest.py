"""The backend fixture of the matrix: one world launcher per backend, or a skip that says why not.

``world(body, *args)`` runs ``tests.backends._bodies.<body>`` on every rank of the backend's world and returns
each rank's value (failing with every failing rank's traceback). Every multi-process world has a hard deadline
after which its whole process tree is killed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._world import RankResult, run_world, values
from tests.backends import _bodies
from tests.backends._launch import publish

ROOT = Path(__file__).resolve().parents[2]
HOROVOD_NPROC = 4
# Starting a Horovod world (its Gloo rendezvous, four interpreters importing torch and horovod) takes 20-30 s on
# two busy cores: the first job of a launched world gets this long, every later job JOB_DEADLINE.
SUBPROCESS_DEADLINE = float(os.environ.get("IGNITE_EXT_BACKEND_DEADLINE", "120"))
JOB_DEADLINE = 60.0
_RENDEZVOUS_MISSED = "http_store.cc"  # where horovod's Gloo rendezvous reports "Wait timeout after N seconds"


@dataclass
class World:
    """How to run a body on one backend.

    ``world(body, *args)`` returns every rank's value or fails with every failing rank's report;
    ``world.results(body, *args, env=..., pg_timeout=...)`` returns the :class:`RankResult` of every rank as is
    (for bodies where some ranks are expected to die). ``pg_timeout`` is the native process group's timeout;
    ``env`` is added to every rank's environment.
    """

    name: str
    backend: str | None  # what idist.backend() says on every rank
    nprocs: int
    nproc_per_node: int
    run: Callable[..., list[RankResult]]

    @property
    def collective(self) -> bool:
        """Whether the scheduler waits with collectives here (Horovod, XLA) rather than through the store."""
        return self.name in ("horovod", "xla")

    def results(self, body: str, *args: Any, **options: Any) -> list[RankResult]:
        return self.run(body, *args, **options)

    def __call__(self, body: str, *args: Any, **options: Any) -> list[Any]:
        results = self.run(body, *args, **options)
        try:
            return values(results)
        except AssertionError as exc:
            output = next((r.extra["output"] for r in results if "output" in r.extra), "")
            raise AssertionError(f"{exc}\nlauncher output (tail):\n{output}" if output else str(exc)) from None


def _serial(body: str, *args: Any, env: dict[str, str] | None = None, pg_timeout: float | None = None) -> list[Any]:
    res = RankResult(rank=0)
    try:
        res.ok, res.value = True, getattr(_bodies, body)(*args)
    except Exception as exc:
        res.exc_type, res.message = type(exc).__name__, str(exc)
    return [res]


def _native(backend: str, nprocs: int, nproc_per_node: int | None = None) -> Callable[..., list[RankResult]]:
    def run(
        body: str, *args: Any, env: dict[str, str] | None = None, pg_timeout: float | None = None
    ) -> list[RankResult]:
        return run_world(
            getattr(_bodies, body),
            nprocs,
            nproc_per_node=nproc_per_node,
            backend=backend,
            args=args,
            env=env,
            pg_timeout=pg_timeout,
            deadline=60.0,
        )

    return run


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the launcher's process group and any descendant that left it (horovod starts its own)."""
    pids: list[int] = []
    try:
        import psutil

        pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    except Exception:  # psutil missing or the launcher already gone: the process group still catches most
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


class _LaunchedWorld:
    """A Horovod or XLA world started once by ``tests.backends._launch``, running one body per :meth:`call`."""

    def __init__(self, backend: str, nprocs: int, env: dict[str, str]) -> None:
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

    def call(self, body: str, args: tuple[Any, ...]) -> list[RankResult]:
        n, self.calls = self.calls, self.calls + 1
        # The first job also waits for the world to start.
        deadline = time.monotonic() + (SUBPROCESS_DEADLINE if n == 0 else JOB_DEADLINE)
        publish(self.jobdir / f"job{n}.pkl", (body, list(args)))
        paths = [self.jobdir / f"job{n}.rank{r}.pkl" for r in range(self.nprocs)]
        while not all(p.exists() for p in paths) and self.proc.poll() is None and time.monotonic() < deadline:
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
                res.timed_out = time.monotonic() >= deadline
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


def _subprocess_world(
    backend: str, nprocs: int, base_env: dict[str, str], launched: dict[str, _LaunchedWorld]
) -> Callable[..., list[RankResult]]:
    def run(
        body: str, *args: Any, env: dict[str, str] | None = None, pg_timeout: float | None = None
    ) -> list[RankResult]:
        if env:  # settings that take effect at start-up: a world of its own
            for _ in range(3):
                own = _LaunchedWorld(backend, nprocs, {**base_env, **env})
                try:
                    results = own.call(body, args)
                finally:
                    own.close()
                # A short Gloo timeout also bounds Horovod's start-up rendezvous, which a busy machine can miss:
                # that is the environment, not the behaviour under test, so start the world again.
                if any(r.ok or r.exc_type for r in results) or _RENDEZVOUS_MISSED not in results[0].extra["output"]:
                    return results
            return results
        shared = launched.get(backend)
        if shared is None or not shared.usable:
            shared = launched[backend] = _LaunchedWorld(backend, nprocs, base_env)
        return shared.call(body, args)

    return run


@pytest.fixture(scope="session")
def _launched_worlds() -> Iterator[dict[str, _LaunchedWorld]]:
    worlds: dict[str, _LaunchedWorld] = {}
    yield worlds
    for w in worlds.values():
        w.close()


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
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return "no CUDA GPU: NCCL needs one GPU per rank (run scripts/nccl_check.sh on a GPU machine)"
    if not torch.distributed.is_nccl_available():
        return "this torch build has no NCCL"
    return None


BACKENDS = [
    pytest.param("serial", id="serial"),
    pytest.param("gloo", id="gloo-4", marks=pytest.mark.distributed),
    pytest.param("gloo-2nodes", id="gloo-2x2", marks=[pytest.mark.distributed, pytest.mark.multinode]),
    pytest.param("horovod", id="horovod-4", marks=[pytest.mark.distributed, pytest.mark.horovod]),
    pytest.param("xla", id="xla-1", marks=pytest.mark.xla),
    pytest.param("nccl", id="nccl", marks=[pytest.mark.distributed, pytest.mark.nccl]),
]


@pytest.fixture(params=BACKENDS)
def world(request: pytest.FixtureRequest, _launched_worlds: dict[str, _LaunchedWorld]) -> World:
    name = str(request.param)
    if name == "serial":
        # With torch_xla importable and PJRT_DEVICE set, ignite takes a plain process for an XLA world of one.
        xla_context = _xla_skip_reason() is None and bool(os.environ.get("PJRT_DEVICE"))
        return World(name, "xla-tpu" if xla_context else None, 1, 1, _serial)
    if name == "gloo":
        return World(name, "gloo", 4, 4, _native("gloo", 4))
    if name == "gloo-2nodes":
        return World(name, "gloo", 4, 2, _native("gloo", 4, 2))
    if name == "horovod":
        reason = _horovod_skip_reason()
        if reason:
            pytest.skip(reason)
        env = {"HOROVOD_GLOO_TIMEOUT_SECONDS": "60"}
        return World(
            name,
            "horovod",
            HOROVOD_NPROC,
            HOROVOD_NPROC,
            _subprocess_world("horovod", HOROVOD_NPROC, env, _launched_worlds),
        )
    if name == "xla":
        reason = _xla_skip_reason()
        if reason:
            pytest.skip(reason)
        # Only one device works with PJRT on CPU, so the XLA world has one rank.
        return World(name, "xla-tpu", 1, 1, _subprocess_world("xla-tpu", 1, {"PJRT_DEVICE": "CPU"}, _launched_worlds))
    reason = _nccl_skip_reason()
    if reason:
        pytest.skip(reason)
    n = min(4, torch.cuda.device_count())
    return World(name, "nccl", n, n, _native("nccl", n))
