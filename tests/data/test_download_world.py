"""download_url from many real processes at once, with and without a process group, with a lock that does
nothing, inside ``idist.one_rank_first``, and killed with SIGKILL mid-body then run again."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.http_server import TestHTTPServer
from ignite_ext.data.download._http import BACKOFF_ENV
from tests._world import World

pytestmark = pytest.mark.distributed

DATA = random.Random(1).randbytes(1 << 20)
SHA = hashlib.sha256(DATA).hexdigest()
ENV = {BACKOFF_ENV: "0.01"}


@pytest.fixture
def server() -> Iterator[TestHTTPServer]:
    # 1 MiB at 2 MiB/s: a fetch lasts long enough for the other processes to arrive while it runs.
    with TestHTTPServer(throttle_bps=2 << 20) as s:
        yield s


class _NoLock:
    """A lock that never excludes anyone, as flock behaves on some NFS, Lustre and GPFS mounts."""

    def __init__(self, path: str) -> None:
        self.path = path

    def acquire(self, blocking: bool = True) -> bool:
        return True

    def release(self) -> None:
        pass


class _Waits(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "waiting for another process's download" in record.getMessage()


def fetch(url: str, root: str, sha256: str | None, no_lock: bool = False) -> dict[str, Any]:
    from ignite_ext import _locks
    from ignite_ext.data import download as dl

    if no_lock:
        _locks.lock_factory = _NoLock
    waits = _Waits()
    log = logging.getLogger("ignite_ext.data.download")
    log.addHandler(waits)
    log.setLevel(logging.INFO)
    path = dl.download_url(url, root, sha256=sha256, progress=False)
    return {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "waits": waits.count}


def fetch_scheduled(url: str, root: str, sha256: str, policy: str) -> dict[str, Any]:
    import ignite_ext.distributed as idist

    scheduled = idist.one_rank_first() if policy == "one_rank_first" else idist.rank_scheduler(idist.SharedPath(root))
    with scheduled as turn:
        result = fetch(url, root, sha256)
    result["first"] = bool(turn)
    return result


def leftovers(root: Path) -> list[str]:
    return sorted(
        p.name for p in root.iterdir() if p.name.startswith(".") and not p.name.endswith((".lock", ".verified.json"))
    )


def check_all_got_the_file(results: list[dict[str, Any]], root: Path) -> None:
    assert {r["path"] for r in results} == {str(root / "a.bin")}
    assert {r["sha256"] for r in results} == {SHA}
    assert hashlib.sha256((root / "a.bin").read_bytes()).hexdigest() == SHA
    assert leftovers(root) == []


@pytest.mark.parametrize("backend", [None, "gloo"])
def test_eight_processes_fetch_once(world: World, server: TestHTTPServer, tmp_path: Path, backend: str | None) -> None:
    url = server.add("/a.bin", DATA)
    results = world(fetch, url, str(tmp_path), SHA, nprocs=8, backend=backend, env=ENV, deadline=60)
    check_all_got_the_file(results, tmp_path)
    assert len(server.requests("/a.bin")) == 1
    assert server.bytes_served("/a.bin") == len(DATA)
    assert all(r["waits"] <= 1 for r in results)


def test_lock_that_does_nothing_never_corrupts(world: World, server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA)
    # A partial left by an earlier, interrupted fetch: every process may try to claim it at once.
    parked = tmp_path / f".a.bin.{hashlib.sha256(url.encode()).hexdigest()[:16]}.part"
    parked.write_bytes(DATA[:300_000])
    record = {"url": url, "etag": f'"{SHA[:16]}"', "last_modified": None, "inode": parked.stat().st_ino}
    parked.with_name(parked.name + ".json").write_text(json.dumps(record))
    # No checksum: a spliced or truncated file would be published as is, so this checks the files themselves.
    results = world(fetch, url, str(tmp_path), None, True, nprocs=8, backend=None, env=ENV, deadline=90)
    check_all_got_the_file(results, tmp_path)
    requests = server.requests("/a.bin")
    assert sum(r.range is not None for r in requests) <= 1  # the parked bytes were claimed at most once
    assert server.bytes_served("/a.bin") >= len(DATA) - 300_000


@pytest.mark.parametrize("policy", ["one_rank_first", "SharedPath"])
def test_inside_the_rank_scheduler(world: World, server: TestHTTPServer, tmp_path: Path, policy: str) -> None:
    url = server.add("/a.bin", DATA)
    results = world(fetch_scheduled, url, str(tmp_path), SHA, policy, env=ENV, deadline=60)
    check_all_got_the_file(results, tmp_path)
    assert server.bytes_served("/a.bin") == len(DATA) and len(server.requests("/a.bin")) == 1
    assert [r["first"] for r in results].count(True) == 1
    # The others ran after the first rank had published: none of them had to wait on the file lock.
    assert [r["waits"] for r in results] == [0, 0, 0, 0]


def test_sigkill_mid_body_then_resume(tmp_path: Path) -> None:
    from ignite_ext.data import download_url

    half = 400_000
    with TestHTTPServer() as server:
        url = server.add("/a.bin", DATA)
        server.fault("/a.bin", stall_after=half, stall_s=60, times=1)
        command = [sys.executable, "-m", "ignite_ext", "download", url, "--root", str(tmp_path), "--sha256", SHA]
        proc = subprocess.Popen([*command, "--no-progress"], env={**os.environ, **ENV}, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 60
            while not any(p.name.endswith(".tmp") and p.stat().st_size >= half for p in tmp_path.iterdir()):
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                assert time.monotonic() < deadline, "the download never reached the stall"
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        assert proc.returncode == -signal.SIGKILL
        assert not (tmp_path / "a.bin").exists()
        start = time.monotonic()
        assert download_url(url, tmp_path, sha256=SHA, progress=False, timeout=10).read_bytes() == DATA
        assert time.monotonic() - start < 10  # no lock left behind to wait on
        first, second = server.requests("/a.bin")
        assert (second.range, second.status, second.sent) == (f"bytes={half}-", 206, len(DATA) - half)
        assert first.sent == half
        assert leftovers(tmp_path) == []
