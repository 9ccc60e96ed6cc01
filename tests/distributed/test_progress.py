"""Slow, stalled or dead, on real gloo ranks: a first rank that advances slowly is waited for, one whose reported
work stops advancing is reported as stalled on every rank within the stall deadline, one that is stopped is dead."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ignite_ext.distributed as idist
from benchmarks.http_server import TestHTTPServer
from ignite_ext import progress
from ignite_ext.data import download_url
from tests._world import World

pytestmark = pytest.mark.timeout(240)

T = 2.0  # the heartbeat timeout of these worlds
S = 2.0  # the stall deadline of their blocks
# A stall is declared at the first beat after S without an advance (a beat is T/4 at most, see beat_interval), then
# reaches the waiting ranks at once (their wake key): S + a beat + a loaded machine's scheduling slack of T.
STALL_BOUND = S + T / 4 + T
ENV = {"IGNITE_EXT_HEARTBEAT_TIMEOUT": str(T), "IGNITE_EXT_WAIT_LOG_INTERVAL": "0.5"}


class _Lines(logging.Handler):
    """The scheduler's log lines on this rank."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _outcome(first: int, body: Any, stall_timeout: float | None = S) -> dict[str, Any]:
    """Run ``body`` in a block where ``first`` runs first; what this rank saw of it."""
    lines = _Lines()
    logger = logging.getLogger("ignite_ext.distributed")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    with idist.one_rank_first():
        pass  # every rank beats, its keeper started
    start = time.monotonic()
    try:
        with idist.one_rank_first(rank=first, stall_timeout=stall_timeout) as turn:
            if turn:
                body()
        return {"outcome": "ok", "after": time.monotonic() - start, "lines": lines.lines}
    except idist.RankFailedError as exc:
        return {
            "outcome": type(exc).__name__,
            "message": str(exc),
            "stalled": list(getattr(exc, "stalled", ())),
            "dead": list(exc.dead),
            "after": time.monotonic() - start,
            "lines": lines.lines,
        }


def body_downloads(url: str, root: str, stall_timeout: float | None) -> dict[str, Any]:
    return _outcome(0, lambda: download_url(url, root, progress=False, timeout=60), stall_timeout)


def test_a_steady_download_longer_than_the_stall_deadline_completes(world: World, tmp_path: Path) -> None:
    # 4 S of body at a steady 20 kB/s: slow is not stalled. The waiting ranks' log lines say how far rank 0 got.
    with TestHTTPServer() as server:
        url = server.add("/slow.bin", os.urandom(int(4 * S * 20_000)))
        server.fault("/slow.bin", trickle_bps=20_000, trickle_bytes=2_000)
        results = world.results(body_downloads, url, str(tmp_path), S, env=ENV, deadline=120)
    for r in results:
        assert r.ok and r.value["outcome"] == "ok", str(r)
        assert r.value["after"] >= 3 * S, r.value  # it did take longer than the deadline
    lines = [line for r in results[1:] for line in r.value["lines"] if "has waited" in line]
    assert any("rank 0: downloading slow.bin: " in line and " of 160.0 kB (" in line for line in lines), lines


def test_a_server_that_stops_sending_is_a_stall_on_every_rank(world: World, tmp_path: Path) -> None:
    # The body stops after 20 kB with the connection open (the download's own timeout is 60 s): every rank raises
    # RankStalledError naming rank 0 and its last progress within the bound, in this block; rank 0 too, as it
    # leaves once the server gives up.
    with TestHTTPServer() as server:
        url = server.add("/wedged.bin", os.urandom(200_000))
        server.fault("/wedged.bin", stall_after=20_000, stall_s=6 * S, times=1)
        results = world.results(body_downloads, url, str(tmp_path), S, env=ENV, deadline=120)
    for r in results[1:]:
        assert r.ok and r.value["outcome"] == "RankStalledError", str(r)
        assert r.value["stalled"] == [0] and r.value["dead"] == [], r.value
        assert "made no progress for" in r.value["message"] and "downloading wedged.bin" in r.value["message"]
        assert r.value["after"] < STALL_BOUND, r.value
    assert results[0].ok and results[0].value["outcome"] == "RankStalledError", str(results[0])


def _hold_a_lock(path: Path, seconds: float) -> None:
    """Another process (a stranger, not a rank) holds a lock on ``path`` for ``seconds``."""
    import subprocess
    import sys

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'w'); fcntl.lockf(f, fcntl.LOCK_EX); "
            "print('held', flush=True); time.sleep(float(sys.argv[2]))",
            str(path),
            str(seconds),
        ],
        stdout=subprocess.PIPE,
    )
    assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
    threading.Thread(target=holder.wait, daemon=True).start()


def _wait_for_the_lock(path: str) -> None:
    with open(path, "w") as f:
        fcntl.lockf(f, fcntl.LOCK_EX)  # blocks in the kernel (the GIL released) until the stranger lets go


def body_waits_for_a_lock(path: str, stall_timeout: float | None) -> dict[str, Any]:
    return _outcome(0, lambda: _wait_for_the_lock(path), stall_timeout)


@pytest.mark.parametrize("asked", [True, False], ids=["stall_timeout-given", "default"])
def test_a_first_rank_blocked_on_a_strangers_lock(world: World, tmp_path: Path, asked: bool) -> None:
    # Given stall_timeout=S, a body that reports nothing falls under it from its start: a stall on every rank.
    # By default (here 2 S) only a reported activity does: the same body is waited for until the lock is free.
    lock = tmp_path / "lock"
    _hold_a_lock(lock, 3 * S)
    env = {**ENV, "IGNITE_EXT_STALL_TIMEOUT": str(S)}
    results = world.results(body_waits_for_a_lock, str(lock), S if asked else None, env=env, deadline=120)
    if asked:
        for r in results:
            assert r.ok and r.value["outcome"] == "RankStalledError" and r.value["stalled"] == [0], str(r)
            assert "it reported none in this block" in r.value["message"], r.value
        assert all(r.value["after"] < STALL_BOUND for r in results[1:]), [r.value for r in results]
    else:
        assert all(r.ok and r.value["outcome"] == "ok" for r in results), [str(r) for r in results]


class _Slow(torch.utils.data.Dataset[int]):
    """Each item takes a fifth of S and reports one step: from the DataLoader worker that reads it."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, index: int) -> int:
        time.sleep(S / 5)
        progress.advance(what="filling the cache")
        return index


def _through_workers() -> None:
    # Forked workers, as DataLoader starts them by default on Linux (these ranks' default is the harness's
    # forkserver, whose workers are not the rank's children): 20 items in 2 workers, 2 S in all, progress from
    # the workers only.
    loader = torch.utils.data.DataLoader(_Slow(), num_workers=2, batch_size=None, multiprocessing_context="fork")
    for _ in loader:
        pass


def _through_a_thread(stop_after: float) -> None:
    def work() -> None:
        ends = time.monotonic() + stop_after
        while time.monotonic() < ends:
            progress.advance(what="tokenizing")
            time.sleep(S / 5)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    time.sleep(2 * S)  # the thread stopped advancing, its activity unfinished: a stall


def body_progress_from(where: str) -> dict[str, Any]:
    if where == "workers":
        return _outcome(0, _through_workers)
    return _outcome(0, lambda: _through_a_thread(2 * S))


@pytest.mark.parametrize("where", ["workers", "thread"])
def test_progress_from_dataloader_workers_and_threads_counts(world: World, where: str) -> None:
    results = world.results(body_progress_from, where, env=ENV, deadline=120)
    if where == "workers":  # 2 S of work reported by the workers only: not a stall
        assert all(r.ok and r.value["outcome"] == "ok" for r in results), [r.value.get("message") for r in results]
    else:  # 2 S reported by a thread, then silence with the activity unfinished: a stall after S more
        for r in results[1:]:
            assert r.ok and r.value["outcome"] == "RankStalledError", str(r)
            assert "tokenizing" in r.value["message"], r.value
            assert 2 * S <= r.value["after"] < 2 * S + STALL_BOUND, r.value


def _report_then_stop() -> None:
    progress.report(1, total=10, what="unpacking")
    os.kill(os.getpid(), signal.SIGSTOP)  # continued by the test, once the others have given up on it


def body_stopped_first_rank() -> dict[str, Any]:
    value = _outcome(2, _report_then_stop)
    if idist.get_rank() != 2:
        time.sleep(4 * T)  # the store (in rank 0) stays until the stopped rank, continued, has learnt its fate
    return value


def test_a_stopped_first_rank_that_reported_progress_is_dead_not_stalled(world: World) -> None:
    # Its heartbeat thread is stopped with it, so no stall is declared for it: its silence makes it dead, within
    # the heartbeat's bound (4/3 T), although its activity is older than S.
    def cont_later(procs: list[Any]) -> None:
        def cont() -> None:
            time.sleep(4.0 + 2 * T)
            os.kill(procs[2].pid, signal.SIGCONT)

        threading.Thread(target=cont, daemon=True).start()

    results = world.results(body_stopped_first_rank, env={**ENV}, on_start=cont_later, deadline=120)
    for r in results[:2] + results[3:]:
        assert r.ok and r.value["outcome"] == "RankFailedError" and r.value["dead"] == [2], str(r)
        assert r.value["stalled"] == [], r.value
    assert results[2].ok and results[2].value["outcome"] == "RankDiedError", str(results[2])


def _report_then_fail() -> None:
    progress.report(3, total=10, what="unpacking")
    raise OSError("disk full")


def body_first_rank_fails_after_progress() -> dict[str, Any]:
    try:
        return _outcome(0, _report_then_fail)
    except OSError as exc:
        return {"outcome": type(exc).__name__, "message": str(exc)}


def test_a_failed_first_ranks_error_carries_its_last_progress(world: World) -> None:
    results = world.results(body_first_rank_fails_after_progress, env=ENV, deadline=120)
    assert results[0].ok and results[0].value == {"outcome": "OSError", "message": "disk full"}, str(results[0])
    for r in results[1:]:
        assert r.ok and r.value["outcome"] == "RankFailedError", str(r)
        assert "OSError: disk full [last progress: unpacking: 3 of 10 (30 %)" in r.value["message"], r.value


def _terminal_wait() -> dict[str, Any]:
    """Rank 0 tokenizes for 6 beats; ranks 2 and 3 wait with a terminal for standard error, rank 1 without."""
    import pty

    master = None
    if idist.get_rank() in (2, 3):
        master, follower = pty.openpty()
        sys.stderr = os.fdopen(follower, "w")
        os.set_blocking(master, False)

    def tokenize() -> None:
        for i in range(60):
            progress.report(i, total=60, what="tokenizing")
            time.sleep(T / 4 * 6 / 60)  # 6 beats in all

    value = _outcome(0, tokenize, stall_timeout=None)
    if master is not None:
        sys.stderr.flush()
        chunks = []
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(master, 65536):
                chunks.append(chunk)
        value["terminal"] = b"".join(chunks).decode(errors="replace")
    return value


def test_on_a_terminal_one_line_per_node_is_rewritten_with_the_awaited_progress(world: World) -> None:
    results = world(_terminal_wait, nprocs=4, nproc_per_node=2, env=ENV, deadline=120)
    assert all(r["outcome"] == "ok" for r in results), results
    waiting = [line for line in results[1]["lines"] if "has waited" in line]
    assert waiting and "tokenizing" in waiting[-1], results[1]  # no terminal: the log lines, with the progress
    shown = results[2]["terminal"]  # its node's local rank 0: one line, rewritten at each beat interval
    assert shown.endswith("\r\n") and shown.count("\n") == 1, shown  # ended once, when the wait was over
    refreshes = [part for part in shown[:-2].split("\r") if part]  # (the terminal writes a newline as \r\n)
    assert len(refreshes) >= 3, shown
    assert all(part.startswith("\x1b[Krank 2 has waited") for part in refreshes), shown
    assert "rank 0: tokenizing" in refreshes[-1] and "of 60" in refreshes[-1], shown
    assert not [line for line in results[2]["lines"] if "has waited" in line], results[2]  # the line instead
    assert results[3]["terminal"] == "", results[3]  # the node's other rank: quiet while it waits
    assert not [line for line in results[3]["lines"] if "has waited" in line], results[3]
