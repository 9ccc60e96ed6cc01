"""download_url in one process against a real HTTP server: verification, faults, resume, cleanup, modes, CLI."""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from benchmarks.http_server import TestHTTPServer
from ignite_ext import _fs, _locks
from ignite_ext.__main__ import main
from ignite_ext.data import ChecksumError, DownloadError, download_url
from ignite_ext.data.download import _partial, _verify
from tests._world import free_port

DATA = random.Random(0).randbytes(300_000)
SHA = hashlib.sha256(DATA).hexdigest()
MD5 = hashlib.md5(DATA).hexdigest()


def leftovers(root: Path) -> list[str]:
    """Hidden files other than the lock and the records (digests, last failure): temp and partial files."""
    records = (".lock", ".verified.json", ".failed.json")
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".") and not p.name.endswith(records))


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_downloads_verifies_and_cleans_up(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA)
    path = download_url(url, tmp_path, sha256=SHA, md5=MD5, progress=False)
    assert path == tmp_path / "a.bin"
    assert path.read_bytes() == DATA
    assert [r.status for r in server.requests("/a.bin")] == [200]
    assert leftovers(tmp_path) == []


def test_filename_and_url_checks(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/dir/a.bin", DATA)
    assert download_url(url, tmp_path, "renamed.bin", progress=False).read_bytes() == DATA
    for bad in ("ftp://example.org/a.bin", "s3://bucket/a.bin", "a.bin"):
        with pytest.raises(ValueError, match="scheme"):
            download_url(bad, tmp_path, progress=False)
    with pytest.raises(ValueError, match="scheme"):
        download_url(url, tmp_path, mirrors=["gopher://x/a.bin"], progress=False)
    with pytest.raises(ValueError, match="no host"):
        download_url("http:///a.bin", tmp_path, progress=False)
    with pytest.raises(ValueError, match="file name"):
        download_url(url, tmp_path, "../escape.bin", progress=False)
    with pytest.raises(ValueError, match="sha256"):
        download_url(url, tmp_path, sha256="abc", progress=False)
    assert len(server.requests("/dir/a.bin")) == 1


def test_verified_file_is_not_hashed_again(
    server: TestHTTPServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = server.add("/a.bin", DATA)
    download_url(url, tmp_path, sha256=SHA, progress=False)
    hashed: list[Path] = []
    real_hash = _verify.hash_file
    monkeypatch.setattr(_verify, "hash_file", lambda path, algos: hashed.append(path) or real_hash(path, algos))
    download_url(url, tmp_path, sha256=SHA, progress=False)
    assert hashed == []  # the record of size, mtime_ns and digest answered
    assert len(server.requests("/a.bin")) == 1
    # Same size, other bytes, other mtime: the record no longer describes the file, so it is hashed and refetched.
    (tmp_path / "a.bin").write_bytes(bytes(len(DATA)))
    assert download_url(url, tmp_path, sha256=SHA, progress=False).read_bytes() == DATA
    assert hashed == [tmp_path / "a.bin"]
    assert len(server.requests("/a.bin")) == 2


def test_md5_alone_is_checked_on_an_existing_file(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA)
    (tmp_path / "a.bin").write_bytes(b"stale")
    assert download_url(url, tmp_path, progress=False).read_bytes() == b"stale"  # no checksum: kept, like torchvision
    assert download_url(url, tmp_path, md5=MD5, progress=False).read_bytes() == DATA
    assert len(server.requests("/a.bin")) == 1


def test_checksum_mismatch_publishes_nothing(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA)
    server.fault("/a.bin", wrong_bytes=True)
    with pytest.raises(ChecksumError) as info:
        download_url(url, tmp_path, sha256=SHA, progress=False)
    bad = hashlib.sha256(DATA.translate(bytes(range(256))[::-1])).hexdigest()
    assert SHA in str(info.value) and bad in str(info.value)
    assert (info.value.expected, info.value.actual) == (SHA, bad)
    assert isinstance(info.value, DownloadError) and isinstance(info.value, OSError)
    assert not (tmp_path / "a.bin").exists()
    assert leftovers(tmp_path) == []
    assert len(server.requests("/a.bin")) == 1  # same bytes again would not help: no retry on this URL


def test_wrong_bytes_then_good_mirror(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA)
    mirror = server.add("/mirror/a.bin", DATA)
    server.fault("/a.bin", wrong_bytes=True)
    assert download_url(url, tmp_path, sha256=SHA, mirrors=[mirror], progress=False).read_bytes() == DATA


def test_404_fails_fast(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.url("/missing.bin")
    with pytest.raises(DownloadError, match=r"404") as info:
        download_url(url, tmp_path, retries=5, progress=False)
    assert url in str(info.value) and info.value.status == 404
    assert len(server.requests("/missing.bin")) == 1
    assert list(tmp_path.glob("missing.bin")) == []


def test_404_then_mirror(server: TestHTTPServer, tmp_path: Path) -> None:
    mirror = server.add("/mirror/a.bin", DATA)
    path = download_url(server.url("/a.bin"), tmp_path, sha256=SHA, mirrors=[mirror], progress=False)
    assert path == tmp_path / "a.bin" and path.read_bytes() == DATA


def test_all_mirrors_fail_names_each(server: TestHTTPServer, tmp_path: Path) -> None:
    with pytest.raises(DownloadError, match=r"all 2 URLs failed.*missing.*other") as info:
        download_url(server.url("/missing.bin"), tmp_path, mirrors=[server.url("/other.bin")], progress=False)
    assert not isinstance(info.value, ChecksumError)


def test_5xx_is_retried_then_succeeds(server: TestHTTPServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url = server.add("/a.bin", DATA)
    server.fault("/a.bin", status=500, times=2)
    with caplog.at_level(logging.DEBUG, logger="ignite_ext.data.download"):
        assert download_url(url, tmp_path, sha256=SHA, retries=3, progress=False).read_bytes() == DATA
    assert [r.status for r in server.requests("/a.bin")] == [500, 500, 200]
    # Said once, at the level a user sees by default, naming the URL, why and what follows; the rest at DEBUG.
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "500" in r.getMessage()]
    assert said == [
        (logging.WARNING, f"{url}: HTTP 500 Internal Server Error; retrying it 3 more time(s), with backoff"),
        (logging.DEBUG, f"attempt 2 of 4 failed: {url}: HTTP 500 Internal Server Error"),
    ], said


def recorded_sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """This thread's ``time.sleep`` calls, recorded instead of slept; other threads sleep as usual.

    The package's group watcher (started by earlier tests in this process) sleeps a second at a time: its calls
    must neither be counted as the download's backoff nor return at once.
    """
    delays: list[float] = []
    real, me = time.sleep, threading.get_ident()

    def sleep(seconds: float) -> None:
        if threading.get_ident() == me:
            delays.append(seconds)
        else:
            real(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    return delays


def test_5xx_exhausts_retries(server: TestHTTPServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    delays = recorded_sleeps(monkeypatch)
    url = server.add("/a.bin", DATA)
    server.fault("/a.bin", status=503)
    with pytest.raises(DownloadError, match=r"gave up after 3 attempts.*503"):
        download_url(url, tmp_path, retries=2, progress=False)
    assert len(server.requests("/a.bin")) == 3
    # Exponential backoff with jitter: base 0.01 s, then 0.02 s, each plus up to 0.01 s.
    assert 0.01 <= delays[0] <= 0.02 and 0.02 <= delays[1] <= 0.03


def test_429_honours_a_small_retry_after(
    server: TestHTTPServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    delays = recorded_sleeps(monkeypatch)
    url = server.add("/a.bin", DATA)
    server.fault("/a.bin", status=429, retry_after="2", times=1)
    assert download_url(url, tmp_path, progress=False).read_bytes() == DATA
    assert delays == [2.0]
    server.fault("/a.bin", status=429, retry_after="3600", times=1)
    download_url(url, tmp_path, "b.bin", progress=False)
    assert delays[1] < 1  # a long Retry-After is not waited for: the backoff applies


def test_connection_refused_is_retried(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/a.bin"
    with pytest.raises(DownloadError, match=r"gave up after 2 attempts.*refused"):
        download_url(url, tmp_path, retries=1, progress=False)
    assert leftovers(tmp_path) == []


def test_dropped_connection_resumes_with_range(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA)
    server.fault("/a.bin", drop_after=100_000, times=1)
    assert download_url(url, tmp_path, sha256=SHA, progress=False).read_bytes() == DATA
    first, second = server.requests("/a.bin")
    assert (first.status, first.sent) == (200, 100_000)
    assert (second.status, second.range, second.if_range) == (206, "bytes=100000-", f'"{SHA[:16]}"')
    assert server.bytes_served("/a.bin") == len(DATA)


def test_stall_times_out_and_resumes(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA)
    server.fault("/a.bin", stall_after=65_536, stall_s=10, times=1)
    start = time.monotonic()
    assert download_url(url, tmp_path, sha256=SHA, timeout=0.5, progress=False).read_bytes() == DATA
    assert time.monotonic() - start < 5
    assert [r.range for r in server.requests("/a.bin")] == [None, "bytes=65536-"]
    assert server.bytes_served("/a.bin") == len(DATA)


def test_server_ignoring_range_restarts_cleanly(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA)
    server.fault("/a.bin", drop_after=100_000, ignore_range=True, times=2)
    assert download_url(url, tmp_path, sha256=SHA, progress=False).read_bytes() == DATA
    statuses = [(r.range, r.status, r.sent) for r in server.requests("/a.bin")]
    # The 200 to a range request restarts the file from byte 0 (and is itself cut at 100000 bytes);
    # the next request resumes from there.
    assert statuses == [(None, 200, 100_000), ("bytes=100000-", 200, 100_000), ("bytes=100000-", 206, 200_000)]


def test_resume_across_calls_and_across_file_versions(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA)
    server.fault("/a.bin", drop_after=120_000, times=1)
    with pytest.raises(DownloadError):
        download_url(url, tmp_path, retries=0, progress=False)
    assert not (tmp_path / "a.bin").exists()
    parked = [n for n in leftovers(tmp_path) if n.endswith(".part")]
    assert len(parked) == 1 and (tmp_path / parked[0]).stat().st_size == 120_000
    assert download_url(url, tmp_path, sha256=SHA, progress=False).read_bytes() == DATA
    assert [(r.range, r.status) for r in server.requests("/a.bin")] == [(None, 200), ("bytes=120000-", 206)]
    assert server.bytes_served("/a.bin") == len(DATA)
    assert leftovers(tmp_path) == []

    # The file changes upstream between two calls: If-Range no longer matches, the server sends it whole.
    server.fault("/b.bin", drop_after=120_000, times=1)
    server.add("/b.bin", DATA)
    with pytest.raises(DownloadError):
        download_url(server.url("/b.bin"), tmp_path, retries=0, progress=False)
    new = DATA[::-1]
    server.add("/b.bin", new)
    path = download_url(server.url("/b.bin"), tmp_path, sha256=hashlib.sha256(new).hexdigest(), progress=False)
    assert path.read_bytes() == new
    last = server.requests("/b.bin")[-1]
    assert (last.range, last.status, last.sent) == ("bytes=120000-", 200, len(new))


def test_no_validator_means_no_resume(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA, validators=False)
    server.fault("/a.bin", drop_after=100_000, times=1)
    assert download_url(url, tmp_path, sha256=SHA, progress=False).read_bytes() == DATA
    assert [r.range for r in server.requests("/a.bin")] == [None, None]


def test_published_files_follow_the_umask(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA)
    for umask, mode in ((0o022, 0o644), (0o002, 0o664), (0o077, 0o600)):
        old = os.umask(umask)
        try:
            path = download_url(url, tmp_path / oct(umask), progress=False)
        finally:
            os.umask(old)
        assert stat.S_IMODE(path.stat().st_mode) == mode


def test_orphans_of_gone_writers_are_removed(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA)
    me = _fs.host()
    dead = tmp_path / f".a.bin.{me}.{dead_pid()}.0123abcd.tmp"
    alive = tmp_path / f".a.bin.{me}.{os.getpid()}.0123abcd.tmp"
    far_old = tmp_path / ".a.bin.otherhost.12.0123abcd.tmp"
    far_new = tmp_path / ".a.bin.otherhost.13.0123abcd.tmp"
    for path in (dead, alive, far_old, far_new):
        path.write_bytes(b"x" * 10)
    old = time.time() - _partial.ORPHAN_MAX_AGE_S - 60
    os.utime(far_old, (old, old))
    download_url(url, tmp_path, sha256=SHA, progress=False)
    assert not dead.exists() and not far_old.exists()
    assert alive.exists() and far_new.exists()  # their writers may still be writing
    assert [r.range for r in server.requests("/a.bin")] == [None]  # no record, nothing to resume


def test_waiting_caller_logs_once_and_gets_the_same_file(
    server: TestHTTPServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = server.add("/a.bin", DATA)
    server.fault("/a.bin", stall_after=65_536, stall_s=1.0, times=1)
    results: list[Path] = []
    first = threading.Thread(target=lambda: results.append(download_url(url, tmp_path, sha256=SHA, progress=False)))
    with caplog.at_level(logging.INFO, logger="ignite_ext.data.download"):
        first.start()
        while not server.requests("/a.bin"):
            time.sleep(0.01)
        results.append(download_url(url, tmp_path, sha256=SHA, progress=False))
        first.join(10)
    waits = [r for r in caplog.records if "waiting for another process's download" in r.getMessage()]
    assert len(waits) == 1
    assert results == [tmp_path / "a.bin"] * 2
    assert server.bytes_served("/a.bin") == len(DATA) and len(server.requests("/a.bin")) == 1


def test_progress_bar_only_when_asked_and_only_on_a_terminal(
    server: TestHTTPServer, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = server.add("/a.bin", DATA)
    download_url(url, tmp_path / "quiet", progress=False)
    assert capsys.readouterr().err == ""
    download_url(url, tmp_path / "log", progress=True)  # stderr is a pipe or a job log: no carriage returns there
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    download_url(url, tmp_path / "loud", progress=True)
    assert "a.bin" in capsys.readouterr().err


def test_lock_that_cannot_be_taken_does_not_fail(
    server: TestHTTPServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Broken:
        def acquire(self, blocking: bool = True) -> bool:
            raise OSError(38, "locks not supported")

        def release(self) -> None:
            raise AssertionError("never held")

    monkeypatch.setattr(_locks, "lock_factory", lambda path: Broken())
    url = server.add("/a.bin", DATA)
    assert download_url(url, tmp_path, sha256=SHA, progress=False).read_bytes() == DATA


def test_file_urls(tmp_path: Path) -> None:
    source = tmp_path / "src" / "a.bin"
    source.parent.mkdir()
    source.write_bytes(DATA)
    assert download_url(source.as_uri(), tmp_path / "out", sha256=SHA, progress=False).read_bytes() == DATA


def test_cli_prints_the_path_or_one_error_line(
    server: TestHTTPServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = server.add("/a.bin", DATA)
    assert main(["download", url, "--root", str(tmp_path), "--sha256", SHA, "--no-progress"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "a.bin")
    assert main(["download", server.url("/nope.bin"), "--root", str(tmp_path), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: DownloadError: .*404.*\n", err)
    assert (
        main(["download", url, "--root", str(tmp_path), "--md5", "0" * 32, "--filename", "b.bin", "--no-progress"]) == 3
    )
    assert capsys.readouterr().err.startswith("error: ChecksumError: ")
    assert main(["download", url, "--root", str(tmp_path), "--sha256", "xyz", "--no-progress"]) == 2  # bad argument
    assert capsys.readouterr().err.startswith("error: ValueError: sha256 must be 64 hex digits")


def test_file_fsynced_before_publish_and_directory_after(
    server: TestHTTPServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        events.append(("replace", os.fspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    url = server.add("/a.bin", DATA)
    target = download_url(url, tmp_path, sha256=SHA, progress=False)
    publish = events.index(("replace", str(target)))
    kind, path = events[publish - 1]
    assert kind == "fsync" and re.fullmatch(rf"{tmp_path}/\.a\.bin\.[\w-]+\.\d+\.[0-9a-f]{{8}}\.tmp", path)
    assert events[publish + 1] == ("fsync", str(tmp_path))


def test_ctrl_c_parks_the_bytes_for_the_next_call(
    server: TestHTTPServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = server.add("/a.bin", DATA)
    real_append = _partial.Partial.append

    def interrupted(self: _partial.Partial, data: bytes) -> None:
        real_append(self, data)
        raise KeyboardInterrupt

    monkeypatch.setattr(_partial.Partial, "append", interrupted)
    with pytest.raises(KeyboardInterrupt):
        download_url(url, tmp_path, sha256=SHA, progress=False)
    monkeypatch.undo()
    held = sum(p.stat().st_size for p in tmp_path.glob(".a.bin.*.part"))
    assert 0 < held < len(DATA) and not (tmp_path / "a.bin").exists()
    assert download_url(url, tmp_path, sha256=SHA, progress=False).read_bytes() == DATA
    assert server.requests("/a.bin")[-1].range == f"bytes={held}-"


def test_partial_that_is_already_whole_is_published_without_a_body(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA)
    server.fault("/a.bin", drop_after=len(DATA) - 1, times=1)
    with pytest.raises(DownloadError):
        download_url(url, tmp_path, retries=0, progress=False)
    (parked,) = tmp_path.glob(".a.bin.*.part")
    with open(parked, "ab") as f:  # the last byte arrived just before the process stopped
        f.write(DATA[-1:])
    assert download_url(url, tmp_path, sha256=SHA, progress=False).read_bytes() == DATA
    last = server.requests("/a.bin")[-1]
    assert (last.range, last.status, last.sent) == (f"bytes={len(DATA)}-", 416, 0)


def test_corrupt_partial_is_fetched_again_whole(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA)
    server.fault("/a.bin", drop_after=100_000, times=1)
    with pytest.raises(DownloadError):
        download_url(url, tmp_path, retries=0, progress=False)
    (parked,) = tmp_path.glob(".a.bin.*.part")
    with open(parked, "r+b") as f:  # what a power cut can leave: the size grew, the bytes never arrived
        f.write(bytes(1000))
    assert download_url(url, tmp_path, sha256=SHA, retries=0, progress=False).read_bytes() == DATA
    assert [(r.range, r.status) for r in server.requests("/a.bin")][1:] == [("bytes=100000-", 206), (None, 200)]


def test_a_missing_local_file_fails_at_once_and_the_next_mirror_is_tried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A file:// source that is not there is a 404, not a network fault: no retries with backoff (3 of them took
    # about 10 s before the error), and the next mirror is asked at once.
    missing = (tmp_path / "missing.bin").as_uri()
    with caplog.at_level(logging.DEBUG, logger="ignite_ext"), pytest.raises(DownloadError) as raised:
        download_url(missing, tmp_path / "root", retries=3, progress=False)
    assert "FileNotFoundError" in str(raised.value) and "retrying" not in caplog.text, caplog.text
    mirror = tmp_path / "mirror.bin"
    mirror.write_bytes(b"found")
    got = download_url(missing, tmp_path / "root2", filename="data.bin", mirrors=[mirror.as_uri()], retries=3)
    assert got.read_bytes() == b"found" and "retrying" not in caplog.text, caplog.text
