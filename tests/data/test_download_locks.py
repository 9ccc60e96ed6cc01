"""The download lock (a POSIX record lock, the kind NFS and GPFS make coherent), what waiting processes say, whom
they wait for how long, the failure they share, and where a file came from."""

from __future__ import annotations

import hashlib
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks.http_server import TestHTTPServer
from ignite_ext import _locks
from ignite_ext.data import DownloadError, download_url
from ignite_ext.data.download._http import BACKOFF_ENV
from tests._world import World

DATA = random.Random(3).randbytes(200_000)
SHA = hashlib.sha256(DATA).hexdigest()

# Tries a record lock on the file from another process: exit 0 if it got it, 1 if it is held.
_PROBE = textwrap.dedent(
    """
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        sys.exit(1)
    sys.exit(0)
    """
)
# Holds the lock until killed, after saying so.
_HOLDER = textwrap.dedent(
    """
    import sys, time
    from ignite_ext._locks import RecordLock
    lock = RecordLock(sys.argv[1])
    lock.acquire()
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
    lock.release()
    """
)
# Holds the lock as a program that is not a download does: the standard library's lockf, nothing written.
_BARE_HOLDER = textwrap.dedent(
    """
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o666)
    fcntl.lockf(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
    """
)


def _probe(path: Path) -> int:
    return subprocess.run([sys.executable, "-c", _PROBE, str(path)], timeout=60).returncode


def _hold(path: Path, seconds: float, script: str = _HOLDER) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", script, str(path), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _holding(cmd: list[str], env: dict[str, str], lock: Path) -> subprocess.Popen[str]:
    """Start the download ``cmd`` and return once it holds ``lock`` (within 30 s)."""
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 30
    while _locks.holder(lock) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return first


@pytest.mark.distributed
def test_the_lock_is_a_record_lock_that_other_processes_see(tmp_path: Path) -> None:
    # flock and record locks do not see each other on a local Linux filesystem: this fails for an flock.
    path = tmp_path / ".a.bin.lock"
    lock = _locks.RecordLock(str(path))
    assert lock.acquire()
    try:
        assert _probe(path) == 1
        assert _locks.holder(path) == f"{socket.gethostname()} {os.getpid()}"
    finally:
        lock.release()
    assert _probe(path) == 0


@pytest.mark.distributed
def test_a_killed_holder_releases_the_lock(tmp_path: Path) -> None:
    path = tmp_path / ".a.bin.lock"
    proc = _hold(path, 60)
    try:
        assert not _locks.RecordLock(str(path)).acquire(blocking=False)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    lock = _locks.RecordLock(str(path))
    assert lock.acquire(blocking=False)
    lock.release()


def test_threads_of_one_process_exclude_each_other_and_never_drop_the_processs_lock(tmp_path: Path) -> None:
    path = tmp_path / ".a.bin.lock"
    inside: list[int] = []
    overlap: list[bool] = []

    def work(i: int) -> None:
        with _locks.exclusive(path, "a test", logging.getLogger("test")):
            inside.append(i)
            overlap.append(len(inside) > 1)
            time.sleep(0.05)
            inside.remove(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert overlap == [False] * 6


@pytest.mark.distributed
def test_a_waiting_process_says_whom_it_waits_for_and_leaves_the_outcome_to_its_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_locks, "WAIT_LOG_INTERVAL_S", 0.3)
    path = tmp_path / ".a.bin.lock"
    proc = _hold(path, 1.5)
    try:
        with (
            caplog.at_level(logging.INFO, logger="test"),
            _locks.exclusive(path, "a test", logging.getLogger("test")) as w,
        ):
            assert w
    finally:
        proc.wait(30)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == f"waiting for a test (held by {socket.gethostname()} pid {proc.pid})", lines
    assert any(line.startswith("still waiting (") for line in lines), lines
    # Nothing was taken over: the holder may have done the work, which only the caller can tell.
    assert all(line.startswith(("waiting for", "still waiting (")) for line in lines), lines


# Waits for the lock, logging each line with its time; holds it for 3 s once it gets it.
_WAITER = textwrap.dedent(
    """
    import logging, os, sys, time
    from pathlib import Path
    from ignite_ext import _locks
    _locks.WAIT_LOG_INTERVAL_S = 0.3
    logging.basicConfig(level=logging.INFO, format="%(created)f %(message)s", stream=sys.stdout)
    with _locks.exclusive(Path(sys.argv[1]), "a test", logging.getLogger("waiter")):
        print(f"{time.time()} got {os.getpid()}", flush=True)
        time.sleep(3)
    """
)


@pytest.mark.distributed
def test_a_waiter_names_the_holder_that_took_over_not_the_one_killed(tmp_path: Path) -> None:
    # The holder is killed while two processes wait: one takes the lock over, and the other's next lines name it,
    # not the dead one (they named the dead holder until the next slice of patience, 120 s).
    path = tmp_path / ".a.bin.lock"
    first = _hold(path, 60)
    waiters = [
        subprocess.Popen([sys.executable, "-c", _WAITER, str(path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        time.sleep(1.5)  # both wait, and have named the first holder
        killed_at = time.time()
        first.kill()
        outs = [w.communicate(timeout=60)[0] for w in waiters]
    finally:
        for proc in (first, *waiters):
            proc.kill()
            proc.wait(30)
    got = sorted((float(line.split()[0]), int(line.split()[2])) for out in outs for line in out.splitlines()
                 if " got " in line)  # fmt: skip
    assert len(got) == 2, outs
    winner = got[0][1]
    [loser_out] = [out for out, w in zip(outs, waiters, strict=True) if w.pid != winner]
    lines = [(float(line.split()[0]), line) for line in loser_out.splitlines() if "held by" in line]
    assert any(f"pid {first.pid}" in line for at, line in lines if at < killed_at), lines  # named it while it held
    # Within a line interval and a loaded machine's second after the kill, the lines name the new holder only.
    after = [line for at, line in lines if at > killed_at + 0.3 + 1.0 and at < got[1][0]]
    assert after, lines
    assert not [line for line in after if f"pid {first.pid}" in line], after
    assert all(f"pid {winner}" in line for line in after), after


@pytest.mark.distributed
def test_a_process_of_this_user_is_waited_for_past_the_bound(tmp_path: Path) -> None:
    path = tmp_path / ".a.bin.lock"
    proc = _hold(path, 3.0, _BARE_HOLDER)  # this user's, but not this package: it writes nothing, never beats
    try:
        started = time.monotonic()
        with _locks.exclusive(path, "a test", logging.getLogger("test"), patience_s=0.5) as waited:
            took = time.monotonic() - started
            assert waited
    finally:
        proc.wait(30)
    assert proc.returncode == 0 and took > 4 * 0.5


@pytest.mark.distributed
def test_a_wait_given_up_on_never_keeps_the_lock_and_is_adopted_by_the_next_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Taken for another user's (as the second-user test of test_download_neighbours.py does for real): given up.
    monkeypatch.setattr(_locks, "_identify", lambda fd: ("pid 1 on this host (user x, y)", True, 1))
    path = tmp_path / ".a.bin.lock"
    proc = _hold(path, 60, _BARE_HOLDER)
    try:
        started = time.monotonic()
        with (
            pytest.raises(_locks.LockWaitExpired, match=r"gave up after \d+ s waiting for a test: .*for 0.5 s"),
            _locks.exclusive(path, "a test", logging.getLogger("test"), patience_s=0.5),
        ):
            pass
        assert 0.5 <= time.monotonic() - started < 10
        with pytest.raises(_locks.LockWaitExpired):  # the next call adopts the pending F_SETLKW: no second one
            _locks.RecordLock(str(path)).wait(0.2, lambda who: None)
        assert not _locks.RecordLock(str(path)).acquire(blocking=False)
        assert [t.name for t in threading.enumerate()].count("ignite_ext-lock-wait") == 1
    finally:
        proc.kill()
        proc.wait(30)
    deadline = time.monotonic() + 30  # the abandoned F_SETLKW got the lock when the holder died, and let go of it
    while _probe(path) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _probe(path) == 0
    lock = _locks.RecordLock(str(path))
    assert lock.acquire(blocking=False)
    lock.release()


@pytest.mark.distributed
def test_this_users_downloads_wait_for_its_download_in_progress_past_their_bound_and_fetch_once(
    server: TestHTTPServer, tmp_path: Path
) -> None:
    url = server.add("/a.bin", DATA)
    # The fetch's first answer is a 503 with Retry-After: 8 s: the fetcher holds the lock 8 s without a byte.
    server.fault("/a.bin", status=503, retry_after="8", times=1)
    cmd = [sys.executable, "-m", "ignite_ext", "download", url, "--root", str(tmp_path), "--sha256", SHA]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    first = _holding(cmd, env, tmp_path / ".a.bin.lock")
    started = time.monotonic()
    # Their bound for another user's lock: min(deadline, 2 * (30 + 30)) = 3 s; it does not apply to this user's.
    waiter = [*cmd, "--deadline", "3"]
    others = [
        subprocess.Popen(waiter, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)
    ]
    outs = [p.communicate(timeout=90) for p in (first, *others)]
    took = time.monotonic() - started
    assert [p.returncode for p in (first, *others)] == [0, 0, 0], outs
    assert {out.strip() for out, _ in outs} == {str(tmp_path / "a.bin")}
    assert len(server.requests("/a.bin")) == 2 and server.bytes_served("/a.bin") == len(DATA)  # one fetch
    for _, err in outs[1:]:
        assert "waiting for another process's download" in err and "gave up" not in err, err
        assert f"fetched by another process: {tmp_path / 'a.bin'}" in err and "took over" not in err, err
    assert "attempt 1 of 4 failed" not in outs[0][1], outs[0][1]  # the 503: only with --verbose
    assert took > 2 * 3.0


def _fetch_failing(url: str, root: str) -> dict[str, Any]:
    start = time.monotonic()
    try:
        download_url(url, root, retries=3, progress=False)
        return {"outcome": "ok"}
    except DownloadError as exc:
        return {"outcome": type(exc).__name__, "message": str(exc), "s": time.monotonic() - start}


@pytest.mark.distributed
def test_waiters_of_a_failed_fetch_share_its_failure_instead_of_retrying(
    world: World, server: TestHTTPServer, tmp_path: Path
) -> None:
    url = server.add("/a.bin", DATA)
    server.fault("/a.bin", status=503)
    # Backoff 0.4 s: the first fetch takes ~3 s over 4 attempts, long enough for every other process to wait on it.
    seen = world(_fetch_failing, url, str(tmp_path), nprocs=6, backend=None, env={BACKOFF_ENV: "0.4"}, deadline=90)
    assert [s["outcome"] for s in seen] == ["DownloadError"] * 6
    assert all("HTTP 503" in s["message"] for s in seen)
    shared = [s for s in seen if "failed" in s["message"] and "s ago" in s["message"]]
    assert len(shared) == 5, [s["message"] for s in seen]
    assert len(server.requests("/a.bin")) == 4  # one retry schedule, not six
    # A later call did not wait for anyone: it tries again, and succeeds once the server is well.
    server.clear_fault("/a.bin")
    assert download_url(url, tmp_path, progress=False).read_bytes() == DATA
    assert not list(tmp_path.glob(".a.bin.failed.json"))


def test_two_urls_with_one_basename_warn_that_they_share_a_target(
    server: TestHTTPServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    v1 = server.add("/v1/w.pt", DATA)
    v2 = server.add("/v2/w.pt", DATA[::-1])
    download_url(v1, tmp_path, progress=False)
    with caplog.at_level(logging.WARNING, logger="ignite_ext.data.download"):
        assert download_url(v2, tmp_path, progress=False).read_bytes() == DATA  # no checksum: returned as is
        download_url(v2, tmp_path, progress=False)
    warnings = [r.getMessage() for r in caplog.records if "was downloaded from" in r.getMessage()]
    assert len(warnings) == 1 and v1 in warnings[0] and v2 in warnings[0] and "filename=" in warnings[0]
    out = download_url(v2, tmp_path, filename="w-v2.pt", progress=False)
    assert out.read_bytes() == DATA[::-1]


@pytest.mark.distributed
def test_cli_prologues_say_whom_they_wait_for_unless_quiet(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA)
    server.fault("/a.bin", trickle_bps=100_000, times=1)  # the first fetch takes ~2 s
    cmd = [sys.executable, "-m", "ignite_ext", "download", url, "--root", str(tmp_path), "--sha256", SHA]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    first = _holding(cmd, env, tmp_path / ".a.bin.lock")
    others = [
        subprocess.Popen([*cmd, *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for flags in ([], ["--quiet"])
    ]
    outs = [p.communicate(timeout=60) for p in (first, *others)]
    assert [p.returncode for p in (first, *others)] == [0, 0, 0], outs
    assert {out.strip() for out, _ in outs} == {str(tmp_path / "a.bin")}
    loud, quiet = outs[1][1], outs[2][1]
    assert f"waiting for another process's download of {tmp_path / 'a.bin'} (held by " in loud, loud
    assert f" pid {first.pid})" in loud and f"fetched by another process: {tmp_path / 'a.bin'}\n" in loud, loud
    assert "took over" not in loud and "fetching it" not in loud, loud
    assert quiet == "" and "Traceback" not in loud


def test_cli_says_a_urls_first_failed_attempt_and_the_next_ones_only_with_verbose(
    server: TestHTTPServer, tmp_path: Path
) -> None:
    url = server.add("/a.bin", DATA)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), BACKOFF_ENV: "0.01"}
    errs = {}
    for flags in ([], ["--verbose"], ["--quiet"]):
        server.fault("/a.bin", status=503, times=2)
        root = tmp_path / (flags[0].strip("-") if flags else "default")
        cmd = [sys.executable, "-m", "ignite_ext", "download", url, "--root", str(root), "--sha256", SHA, *flags]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0 and done.stdout.strip() == str(root / "a.bin"), done
        errs[tuple(flags)] = done.stderr
    first = f"{url}: HTTP 503 Service Unavailable; retrying it 3 more time(s), with backoff"
    for flags in ((), ("--quiet",), ("--verbose",)):  # a warning: shown with --quiet too
        assert errs[flags].count(first) == 1, (flags, errs[flags])
    assert "attempt 2 of 4 failed" not in errs[()] and "attempt 2 of 4 failed" not in errs[("--quiet",)], errs
    assert "attempt 2 of 4 failed" in errs[("--verbose",)] and "HTTP 503" in errs[("--verbose",)], errs
