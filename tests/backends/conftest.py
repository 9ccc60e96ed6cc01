"""The backend fixture of the matrix: one world launcher per backend, or a skip that says why not.

``world(body, *args)`` runs ``tests.backends._bodies.<body>`` on every rank of the backend's world and returns
each rank's value (failing with every failing rank's traceback). Every multi-process world has a hard deadline
after which its whole process tree is killed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._world import RankResult, run_world, values
from tests.backends import _bodies

ROOT = Path(__file__).resolve().parents[2]
HOROVOD_NPROC = 4
# Starting a Horovod world (its Gloo rendezvous, four interpreters importing torch) takes seconds on two cores.
SUBPROCESS_DEADLINE = float(os.environ.get("IGNITE_EXT_BACKEND_DEADLINE", "120"))


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


def _subprocess_world(backend: str, nprocs: int, base_env: dict[str, str]) -> Callable[..., list[RankResult]]:
    def run(
        body: str, *args: Any, env: dict[str, str] | None = None, pg_timeout: float | None = None
    ) -> list[RankResult]:
        with tempfile.TemporaryDirectory(prefix="ignite_ext_world_") as outdir:
            cmd = [sys.executable, "-m", "tests.backends._launch", backend, str(nprocs), outdir, body, json.dumps(args)]
            child_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **base_env, **(env or {})}
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                out, _ = proc.communicate(timeout=SUBPROCESS_DEADLINE)
            except subprocess.TimeoutExpired:
                _kill_tree(proc)
                out = proc.stdout.read() if proc.stdout else b""
                raise AssertionError(
                    f"{backend} world of {nprocs} still running after {SUBPROCESS_DEADLINE}s; killed. Output:\n"
                    + out.decode(errors="replace")[-6000:]
                ) from None
            finally:
                _kill_tree(proc)  # stragglers outlive a launcher that returned early
            results = []
            for rank in range(nprocs):
                res = RankResult(rank=rank, exitcode=proc.returncode)
                path = Path(outdir, f"rank{rank}.pkl")
                if path.exists():
                    record = pickle.loads(path.read_bytes())
                    if record[0] == "ok":
                        res.ok, res.value = True, record[1]
                    else:
                        res.exc_type, res.message, res.traceback = record[1:]
                results.append(res)
            if not all(r.ok for r in results):
                # The launcher's output is the only trace of ranks that died without reporting.
                for r in results:
                    r.extra["output"] = out.decode(errors="replace")[-6000:]
            return results

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
def world(request: pytest.FixtureRequest) -> World:
    name = str(request.param)
    if name == "serial":
        return World(name, None, 1, 1, _serial)
    if name == "gloo":
        return World(name, "gloo", 4, 4, _native("gloo", 4))
    if name == "gloo-2nodes":
        return World(name, "gloo", 4, 2, _native("gloo", 4, 2))
    if name == "horovod":
        reason = _horovod_skip_reason()
        if reason:
            pytest.skip(reason)
        env = {"HOROVOD_GLOO_TIMEOUT_SECONDS": "60"}
        return World(name, "horovod", HOROVOD_NPROC, HOROVOD_NPROC, _subprocess_world("horovod", HOROVOD_NPROC, env))
    if name == "xla":
        reason = _xla_skip_reason()
        if reason:
            pytest.skip(reason)
        # Only one device works with PJRT on CPU, so the XLA world has one rank.
        return World(name, "xla-tpu", 1, 1, _subprocess_world("xla-tpu", 1, {"PJRT_DEVICE": "CPU"}))
    reason = _nccl_skip_reason()
    if reason:
        pytest.skip(reason)
    n = min(4, torch.cuda.device_count())
    return World(name, "nccl", n, n, _native("nccl", n))
