"""A root that cannot be written: one DownloadError naming it, before any lock or temp file, alone or in a job.

The root is read-only for real: as root (whom permission bits do not stop), a read-only bind mount of a temporary
directory in a mount namespace of the test's own (``unshare``; it goes with the processes), else a directory of
mode 0555. The downloads run as real processes in it, a job's ranks joined in a real gloo process group.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.http_server import TestHTTPServer
from ignite_ext.data import download_url
from ignite_ext.data.download._http import BACKOFF_ENV
from tests._world import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
STEP_TIMEOUT_S = 120.0
# Each rank: download (alone, or for a job of WORLD_SIZE ranks) into argv[2]; say what it raised in one JSON line
# (one write: the ranks share the pipe).
_DOWNLOAD = textwrap.dedent(
    """
    import json, logging, os, sys
    logging.basicConfig(level=logging.WARNING)
    url, root = sys.argv[1], sys.argv[2]
    try:
        if os.environ.get("WORLD_SIZE"):
            import ignite_ext.distributed as idist
            from ignite_ext.data import download_for_job
            idist.initialize("gloo")
            try:
                download_for_job(url, root, progress=False)
            finally:
                idist.finalize()
        else:
            from ignite_ext.data import download_url
            download_url(url, root, progress=False)
        seen = {"type": None}
    except Exception as exc:
        cause = exc.__cause__
        seen = {"type": type(exc).__name__, "message": str(exc), "errno": getattr(exc, "errno", None),
                "cause": None if cause is None else type(cause).__name__}
    os.write(1, (json.dumps(seen) + "\\n").encode())
    """
)
# As root: runs "$@" with $1 (the directory) read-only, in this process's new mount namespace.
_READ_ONLY = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'
# Starts RANKS processes of the command, each with its rank, and waits for them all.
_RANKS = 'for r in $(seq 0 $((RANKS - 1))); do RANK=$r LOCAL_RANK=$r "$@" & done; wait'


@contextlib.contextmanager
def _read_only(directory: Path) -> Iterator[list[str]]:
    """Yield the command prefix under which ``directory`` cannot be written by the process it starts."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            yield []
        finally:
            directory.chmod(0o755)
        return
    if shutil.which("unshare") is None:
        pytest.skip("not installed: unshare")
    prefix = ["unshare", "--mount", "--propagation", "private", "sh", "-c", _READ_ONLY, "sh", str(directory)]
    probe = subprocess.run([*prefix, "touch", str(directory / "probe")], capture_output=True, text=True, timeout=30)
    if "Read-only" not in probe.stderr:
        pytest.skip(f"cannot make a read-only bind mount here: {probe.stderr.strip()}")
    yield prefix


def _run(prefix: list[str], url: str, root: Path, ranks: int) -> tuple[list[dict[str, Any]], str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), BACKOFF_ENV: "0.01", "IGNITE_EXT_HEARTBEAT_TIMEOUT": "3"}
    command = [sys.executable, "-c", _DOWNLOAD, url, str(root)]
    if ranks > 1:
        env |= {"RANKS": str(ranks), "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1"}
        env["MASTER_PORT"] = str(free_port())
        command = ["sh", "-c", _RANKS, "sh", *command]
    proc = subprocess.Popen(
        [*prefix, *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=STEP_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(results) == ranks, (out, err)
    return results, err


def test_a_read_only_root_is_a_download_error_naming_it(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", b"x" * 1000)
    root = tmp_path / "root"
    root.mkdir()
    with _read_only(root) as prefix:
        [seen], err = _run(prefix, url, root, 1)
    assert seen["type"] == "DownloadError", seen
    assert seen["message"].startswith(f"{url}: cannot write into {root}: "), seen
    assert seen["errno"] is not None and seen["cause"] in ("PermissionError", "OSError"), seen
    assert "going on without" not in err and "cannot lock" not in err, err  # the lock was not the problem
    assert server.requests("/a.bin") == [] and list(root.iterdir()) == []


def test_a_verified_file_in_a_read_only_root_is_returned(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", b"x" * 1000)
    root = tmp_path / "root"
    download_url(url, root, sha256=hashlib.sha256(b"x" * 1000).hexdigest(), progress=False)
    with _read_only(root) as prefix:
        [seen], _ = _run(prefix, url, root, 1)
    assert seen["type"] is None, seen
    assert len(server.requests("/a.bin")) == 1


def test_download_for_job_on_a_read_only_root_says_so_on_every_rank(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", b"x" * 1000)
    root = tmp_path / "root"
    root.mkdir()
    with _read_only(root) as prefix:
        seen, err = _run(prefix, url, root, 2)
    assert [s["type"] for s in seen] == ["DownloadError"] * 2, (seen, err)
    for each in seen:
        assert f"{url}: cannot write into {root}: " in each["message"], each
        assert "census" not in each["message"] and "SharedPath" not in each["message"], each
    assert server.requests("/a.bin") == []
