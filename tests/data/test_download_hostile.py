"""download_url against lying servers, hostile neighbours in a shared folder, full disks and odd names.

Without a checksum, the one promise is that the published file is one version of the URL, never a splice of two,
never bytes the server transformed, and never something another user planted.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import threading
import time
from pathlib import Path

import pytest

from benchmarks.http_server import TestHTTPServer
from ignite_ext import _fs
from ignite_ext.__main__ import main
from ignite_ext.data import DownloadError, download_url
from ignite_ext.data.download import _partial
from ignite_ext.data.download._http import BACKOFF_ENV

DATA = random.Random(1).randbytes(300_000)
OTHER = random.Random(2).randbytes(300_000)
SHA = hashlib.sha256(DATA).hexdigest()


def park_half(server: TestHTTPServer, url: str, root: Path, path: str = "/a.bin") -> Path:
    """A first call that stops after 120 kB and parks the bytes, as a killed or failed run leaves them."""
    server.fault(path, drop_after=120_000, times=1)
    with pytest.raises(DownloadError):
        download_url(url, root, retries=0, progress=False)
    (parked,) = root.glob(f".{path.lstrip('/')}.*.part")
    return parked


# --- lying servers: every case would publish a splice or transformed bytes without the checks ------------------


@pytest.mark.parametrize(
    "lie",
    [
        {"range_etag": '"another-version"'},  # a 206 of another version than the If-Range asked for
        {"range_total": 600_000},  # a 206 for a file of another size than the first response's
        {"range_status": 416},  # "you have it all" for a partial, with no checksum to confirm it
    ],
    ids=["etag", "total", "416"],
)
def test_range_replies_that_do_not_continue_the_bytes_are_not_appended(
    lie: dict[str, object], server: TestHTTPServer, tmp_path: Path
) -> None:
    url = server.add("/a.bin", DATA)
    park_half(server, url, tmp_path)
    server.add("/a.bin", DATA)  # same bytes and validators: only the range answers lie
    server.fault("/a.bin", **lie, times=1)
    # Another total under the same ETag is one ETag given two lengths: only a checksum lets the bytes be published.
    checksum = {"sha256": SHA} if "range_total" in lie else {}
    assert download_url(url, tmp_path, progress=False, **checksum).read_bytes() == DATA
    requests = server.requests("/a.bin")
    assert requests[-1].range is None and requests[-1].status == 200  # fetched whole after the lie


def test_a_206_with_an_unknown_total_and_a_short_body_is_not_published(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA)
    park_half(server, url, tmp_path)
    server.fault("/a.bin", star_total=True, drop_after=50_000, times=1)
    assert download_url(url, tmp_path, progress=False).read_bytes() == DATA


@pytest.mark.parametrize("star", [False, True], ids=["of-102400", "of-star"])
def test_a_206_that_ends_before_the_file_does_is_never_published(
    star: bool, server: TestHTTPServer, tmp_path: Path
) -> None:
    # "bytes 50000-69999/102400" (or ".../*") to "bytes=50000-": the range asked for runs to the end of the file, the
    # answer stops at 70,000 bytes. Without a checksum nothing but the announced sizes can tell.
    data = DATA[:102_400]
    url = server.add("/a.bin", data)
    server.fault("/a.bin", drop_after=50_000, times=1)
    with pytest.raises(DownloadError):
        download_url(url, tmp_path, retries=0, progress=False)
    server.fault("/a.bin", range_end=70_000, star_total=star, times=1)
    assert download_url(url, tmp_path, progress=False).read_bytes() == data
    requests = [(r.range, r.status, r.sent) for r in server.requests("/a.bin")]
    assert requests == [(None, 200, 50_000), ("bytes=50000-", 206, 20_000), (None, 200, 102_400)]


@pytest.mark.parametrize("checksum", [False, True], ids=["no-checksum", "checksum"])
def test_one_strong_etag_given_two_lengths_publishes_nothing(
    checksum: bool, server: TestHTTPServer, tmp_path: Path
) -> None:
    # A 200 of 102,400 bytes with ETag E, cut short; then every answer, the resume's and the plain GET's after it,
    # is "206 bytes N-69999/70000" with the same E. One strong ETag names one sequence of bytes, so one of the two
    # lengths is a lie and nothing tells which: without a checksum nothing is published (and nothing kept to
    # resume from); with one, the checksum judges the bytes as for any other server.
    data = DATA[:102_400]
    url = server.add("/a.bin", data)
    server.fault("/a.bin", drop_after=50_000, times=1)
    with pytest.raises(DownloadError):
        download_url(url, tmp_path, retries=0, progress=False)
    server.fault("/a.bin", range_end=70_000, range_total=70_000, always_206=True)
    digest = {"sha256": hashlib.sha256(data).hexdigest()} if checksum else {}
    with pytest.raises(DownloadError, match="mismatch" if checksum else "102400 bytes and .* 70000"):
        download_url(url, tmp_path, progress=False, **digest)  # type: ignore[arg-type]
    assert not (tmp_path / "a.bin").exists()
    if not checksum:
        assert list(tmp_path.glob(".a.bin.*.part")) == []
        # A lie is the URL's answer, not a transient failure: not retried.
        assert [r.status for r in server.requests("/a.bin")] == [200, 206]


def test_a_weak_last_modified_is_no_validator(server: TestHTTPServer, tmp_path: Path) -> None:
    # Last-Modified not a second before Date (here: after it) can stand for two versions of the file.
    url = server.add("/a.bin", DATA, etag=False, last_modified=time.time() + 5)
    server.fault("/a.bin", drop_after=120_000, times=1)
    with pytest.raises(DownloadError):
        download_url(url, tmp_path, retries=0, progress=False)
    assert list(tmp_path.glob(".a.bin.*.part")) == []  # nothing resumable was kept
    server.add("/a.bin", OTHER, etag=False, last_modified=time.time() + 5)
    assert download_url(url, tmp_path, progress=False).read_bytes() == OTHER
    assert server.requests("/a.bin")[-1].range is None


def test_an_encoded_body_is_never_published(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA)
    server.fault("/a.bin", encoding="gzip")
    with pytest.raises(DownloadError, match="Content-Encoding 'gzip'"):
        download_url(url, tmp_path, progress=False)
    assert not (tmp_path / "a.bin").exists()
    assert len(server.requests("/a.bin")) == 1  # not retried: the server would do it again


def test_a_redirect_to_ftp_is_refused_like_ftp_itself(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA)
    server.fault("/a.bin", redirect="ftp://127.0.0.1:1/a.bin")
    with pytest.raises(DownloadError, match="redirected to 'ftp://"):
        download_url(url, tmp_path, progress=False)
    with pytest.raises(ValueError, match="unsupported URL scheme 'ftp'"):
        download_url("ftp://127.0.0.1:1/a.bin", tmp_path, progress=False)


def test_wrong_range_replies_do_not_wedge_the_url(server: TestHTTPServer, tmp_path: Path) -> None:
    # Every range answer is wrong (another total), plain GETs are right: the URL must stay downloadable, not be
    # re-requested with the same Range on every call.
    url = server.add("/a.bin", DATA)
    park_half(server, url, tmp_path)
    server.fault("/a.bin", range_total=600_000)
    assert download_url(url, tmp_path, sha256=SHA, progress=False).read_bytes() == DATA
    assert [(r.range is None, r.status) for r in server.requests("/a.bin")][-1] == (True, 200)
    # With a checksum and wrong bytes in the range answers: one refetch in one piece.
    server.clear_fault("/a.bin")
    park_half(server, url, tmp_path / "again")
    server.fault("/a.bin", range_wrong_bytes=True)
    assert download_url(url, tmp_path / "again", sha256=SHA, progress=False).read_bytes() == DATA


def test_a_trickling_server_is_bounded_by_the_deadline(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA)
    server.fault("/a.bin", trickle_bps=20_000)  # every read returns within timeout=1, the body takes 15 s
    start = time.monotonic()
    with pytest.raises(DownloadError, match="deadline"):
        download_url(url, tmp_path, timeout=1, deadline=1.5, progress=False)
    assert time.monotonic() - start < 10
    with pytest.raises(ValueError, match="deadline"):
        download_url(url, tmp_path, deadline=0, progress=False)


def test_a_trickling_server_is_abandoned_below_the_low_speed_floor_and_resumed(
    server: TestHTTPServer, tmp_path: Path
) -> None:
    url = server.add("/a.bin", DATA)
    # 1 byte every 0.8 s: every read returns well within timeout (2 s, so that a loaded host cannot make one time out).
    server.fault("/a.bin", trickle_bps=1.25, trickle_bytes=1)
    timeout, floor_s, retries = 2.0, 1.0, 1
    outcome: list[BaseException | Path] = []

    def fetch() -> None:
        try:
            outcome.append(
                download_url(
                    url,
                    tmp_path,
                    timeout=timeout,
                    retries=retries,
                    low_speed_limit=100,
                    low_speed_time=floor_s,
                    progress=False,
                )
            )
        except BaseException as exc:  # whatever it is, the assertions below show it
            outcome.append(exc)

    # An attempt is abandoned by the first read that ends floor_s seconds below the floor, and reads come at most
    # timeout apart: each attempt ends within floor_s + timeout of its start. Three times that per attempt covers
    # the connections and a loaded host; without the floor the call would take 300,000 * 0.8 s.
    bound = 3 * (retries + 1) * (floor_s + timeout)
    thread = threading.Thread(target=fetch, daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(bound)
    assert not thread.is_alive(), f"still fetching after {bound} s"
    assert time.monotonic() - start < bound
    (error,) = outcome
    assert isinstance(error, DownloadError), error
    assert "gave up after 2 attempts" in str(error) and "below 100 B/s for 1 s" in str(error)
    first, second = server.requests("/a.bin")
    resumed = re.fullmatch(r"bytes=(\d+)-", second.range or "")
    assert first.range is None and resumed is not None, (first, second)
    held = int(resumed.group(1))  # the retry resumed from the bytes the abandoned attempt held
    assert 1 <= held <= first.sent
    (parked,) = tmp_path.glob(".a.bin.*.part")  # and the next call may resume them too
    assert parked.stat().st_size > held


def test_the_cli_passes_the_low_speed_floor(
    server: TestHTTPServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = server.add("/a.bin", DATA)
    server.fault("/a.bin", trickle_bps=1.25, trickle_bytes=1)
    args = ["download", url, "--root", str(tmp_path), "--timeout", "2", "--retries", "0", "--no-progress"]
    assert main([*args, "--low-speed-limit", "100", "--low-speed-time", "1"]) == 1
    assert "below 100 B/s for 1 s" in capsys.readouterr().err
    with pytest.raises(ValueError, match="low_speed_limit"):
        download_url(url, tmp_path, low_speed_limit=-1, progress=False)
    with pytest.raises(ValueError, match="low_speed_time"):
        download_url(url, tmp_path, low_speed_time=0, progress=False)


# --- full disks -------------------------------------------------------------------------------------------------


def test_a_disk_without_room_fails_up_front_naming_url_and_path(
    server: TestHTTPServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = server.add("/a.bin", DATA)
    usage = os.statvfs(tmp_path)
    monkeypatch.setattr("shutil.disk_usage", lambda path: type("U", (), {"free": 1000, "total": usage.f_blocks})())
    with pytest.raises(DownloadError, match=r"has 1000 bytes free, but the file needs 300000 more") as info:
        download_url(url, tmp_path, progress=False)
    assert url in str(info.value) and str(tmp_path) in str(info.value)
    assert not (tmp_path / "a.bin").exists() and list(tmp_path.glob(".a.bin.*.part")) == []


def test_a_disk_that_fills_up_is_an_error_naming_url_and_path_and_keeps_nothing(
    server: TestHTTPServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = server.add("/a.bin", DATA)
    real_append = _partial.Partial.append

    def full(self: _partial.Partial, data: bytes) -> None:
        if self.size + len(data) > 100_000:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_append(self, data)

    monkeypatch.setattr(_partial.Partial, "append", full)
    with pytest.raises(DownloadError, match="no space left") as info:
        download_url(url, tmp_path, progress=False)
    assert url in str(info.value) and str(tmp_path) in str(info.value)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith((".part", ".tmp"))] == []
    monkeypatch.undo()
    monkeypatch.setenv(BACKOFF_ENV, "0.01")
    assert download_url(url, tmp_path, progress=False).read_bytes() == DATA  # the next call starts clean
    assert server.requests("/a.bin")[-1].range is None


# --- hostile neighbours in a shared folder -----------------------------------------------------------------------


def test_a_planted_symlink_under_the_parked_name_is_never_adopted(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA)
    parked = park_half(server, url, tmp_path)
    record = json.loads(Path(str(parked) + ".json").read_text())
    # Another user replaces the parked bytes by a link to a file of the victim's, with a record pointing at it.
    precious = tmp_path / "home" / "thesis.tex"
    precious.parent.mkdir()
    precious.write_bytes(b"years of work" * 1000)
    parked.unlink()
    os.symlink(precious, parked)
    record["inode"] = precious.stat().st_ino
    Path(str(parked) + ".json").write_text(json.dumps(record))
    out = download_url(url, tmp_path, progress=False)
    assert precious.read_bytes() == b"years of work" * 1000  # untouched
    assert not out.is_symlink() and out.read_bytes() == DATA
    assert server.requests("/a.bin")[-1].range is None  # nothing was resumed from the planted file


def test_a_planted_symlink_named_like_a_dead_writers_temp_file_is_never_adopted(
    server: TestHTTPServer, tmp_path: Path
) -> None:
    url = server.add("/a.bin", DATA)
    precious = tmp_path / "precious.bin"
    precious.write_bytes(b"mine" * 1000)
    temp = tmp_path / f".a.bin.{_fs.host()}.999999999.0123abcd.tmp"  # a pid that does not run
    os.symlink(precious, temp)
    st = precious.stat()
    record = {"url": url, "etag": None, "last_modified": "Mon, 01 Jan 2024 00:00:00 GMT", "inode": st.st_ino}
    Path(str(temp) + ".json").write_text(json.dumps(record))
    out = download_url(url, tmp_path, progress=False)
    assert precious.read_bytes() == b"mine" * 1000
    assert not out.is_symlink() and out.read_bytes() == DATA


# --- names --------------------------------------------------------------------------------------------------------


def test_a_240_character_filename_gets_short_sidecar_names(server: TestHTTPServer, tmp_path: Path) -> None:
    name = "n" * 236 + ".bin"
    url = server.add("/" + name, DATA)
    server.fault("/" + name, drop_after=120_000, times=1)
    with pytest.raises(DownloadError):
        download_url(url, tmp_path, retries=0, progress=False)
    assert download_url(url, tmp_path, sha256=SHA, progress=False).read_bytes() == DATA
    assert server.requests("/" + name)[-1].range == "bytes=120000-"  # the parked bytes were found and resumed
    assert all(len(p.name.encode()) <= 255 for p in tmp_path.iterdir())


def test_a_non_ascii_url_is_encoded_not_an_error(server: TestHTTPServer, tmp_path: Path) -> None:
    server.add("/donn%C3%A9es/%C3%A4%20b.bin", DATA)
    url = server.url("/données/ä b.bin")
    out = download_url(url, tmp_path, progress=False)
    assert out.name == "ä b.bin" and out.read_bytes() == DATA


def test_a_target_named_like_bookkeeping_files_is_refused(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/.a.bin.verified.json", b"{}")
    with pytest.raises(ValueError, match="bookkeeping"):
        download_url(url, tmp_path, progress=False)
    assert download_url(url, tmp_path, filename="record.json", progress=False).read_bytes() == b"{}"
