"""Run a function on several real processes, with a hard deadline, and always reap them.

Every multi-process test goes through :func:`run_world`: it starts ``nprocs`` processes (from a forkserver
that has torch and ignite preloaded, so a world starts in well under a second), optionally joins them in a
gloo process group through ``idist.initialize``, and collects what each rank returned or raised. If the
deadline passes, every live process first dumps its Python stacks to stderr (faulthandler on SIGUSR1) and
is then SIGKILLed, and the call fails: a hang is a test failure, never a stuck CI job.
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing as mp
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["RankResult", "WorldDeadlineError", "free_port", "run_world", "values"]

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "ignite.distributed", "ignite_ext.distributed"])


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
    faulthandler.register(signal.SIGUSR1, all_threads=True)
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
            if procs[rank].is_alive():
                os.kill(procs[rank].pid, signal.SIGUSR1)  # stacks to stderr, for the log
        if timed_out:
            time.sleep(0.5)
    finally:
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
        )
    return results


def values(results: list[RankResult]) -> list[Any]:
    """Return every rank's value, or fail with every failing rank's traceback."""
    bad = [r for r in results if not r.ok]
    if bad:
        raise AssertionError("some ranks failed:\n" + "\n".join(str(r) for r in bad))
    return [r.value for r in results]
