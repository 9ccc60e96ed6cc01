"""Archives built to escape the target, checked in extraction order, with and without Python's data filter.

Python 3.11.0-3.11.3 (which the package allows) have no ``tarfile.data_filter``: every test runs once as this Python
is and once with the filter removed, so the package's own checks must stop each attack alone.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import signal
import stat
import subprocess
import tarfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.http_server import TestHTTPServer
from ignite_ext.__main__ import main
from ignite_ext.data import ArchiveError, DownloadError, download_url, extract_archive
from ignite_ext.data.download._members import MAX_DEPTH
from ignite_ext.errors import IgniteExtError


def member(name: str, kind: bytes = tarfile.REGTYPE, *, link: str = "", data: bytes = b"", mode: int = 0o644) -> Any:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.mode = mode
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    return info, data


def make_tar(path: Path, *members: Any) -> Path:
    with tarfile.open(path, "w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return path


@pytest.fixture(params=["data_filter", "no_data_filter"])
def python(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "no_data_filter":
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    yield str(request.param)


def _files(*folders: Path) -> dict[str, tuple[int, bytes]]:
    # Every file but the lock the extraction takes next to its target.
    return {
        str(p): (p.stat().st_mode, p.read_bytes())
        for f in folders
        for p in f.iterdir()
        if p.is_file() and not p.name.endswith(".extract.lock")
    }


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    # The archive is extracted into tmp_path/work/out (through a private sibling of it): victims wait next to it.
    (tmp_path / "work").mkdir()
    for where in (tmp_path, tmp_path / "work"):
        (where / "victim").write_bytes(b"precious")
        (where / "victim").chmod(0o644)
    return tmp_path


ATTACKS = {
    # A link to ".", a link "a/l" that looks inside but is created as "l" -> "..", a member written through "l",
    # then "a" again as a directory: checked against the last definitions, every member looks safe.
    "redefined_symlink": [
        member("a", tarfile.SYMTYPE, link="."),
        member("a/l", tarfile.SYMTYPE, link=".."),
        member("l/victim", data=b"pwned"),
        member("a", tarfile.DIRTYPE, mode=0o755),
    ],
    # The same trick through a hard link: its mode (setuid, world-writable) would land on the outside file.
    "redefined_hardlink": [
        member("a", tarfile.SYMTYPE, link="."),
        member("a/l", tarfile.SYMTYPE, link=".."),
        member("l/victim", data=b"pwned"),
        member("h", tarfile.LNKTYPE, link="l/victim", mode=0o4777),
        member("a", tarfile.DIRTYPE, mode=0o755),
    ],
    # "b" -> "a/.." is inside while "a" is last defined as "c/d", but outside while "a" -> "." is on disk: the hard
    # link through "b" then names the file next to the target, and its mode and owner are applied to it.
    "link_through_a_redefined_link": [
        member("a", tarfile.SYMTYPE, link="."),
        member("b", tarfile.SYMTYPE, link="a/.."),
        member("c/victim", data=b"decoy"),
        member("h", tarfile.LNKTYPE, link="b/victim", mode=0o4777),
        member("a", tarfile.SYMTYPE, link="c/d"),
    ],
    # A file, then a link of the same name, then the file again: the second write would follow the link.
    "file_then_link": [
        member("x", data=b"1"),
        member("x", tarfile.SYMTYPE, link="../victim"),
        member("x", data=b"pwned"),
    ],
    # A link whose own name is then a regular file: the write follows the link.
    "link_then_file": [
        member("l", tarfile.SYMTYPE, link="../victim"),
        member("l", data=b"pwned"),
    ],
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_attacks_through_redefined_links_are_refused(attack: str, python: str, outside: Path) -> None:
    before = _files(outside, outside / "work")
    archive = make_tar(outside / "work" / "evil.tar", *ATTACKS[attack])
    with pytest.raises(ArchiveError):
        extract_archive(archive, outside / "work" / "out")
    assert _files(outside, outside / "work") == {**before, str(archive): (archive.stat().st_mode, archive.read_bytes())}
    assert not (outside / "work" / "out").exists()
    assert sorted(p.name for p in (outside / "work").iterdir()) == [".out.extract.lock", "evil.tar", "victim"]


def test_privileged_mode_bits_and_foreign_owners_are_dropped(python: str, tmp_path: Path) -> None:
    info, data = member("tool", data=b"#!/bin/sh\n", mode=0o6777)
    info.uid, info.gid, info.uname, info.gname = 4321, 4321, "nobody-else", "nobody-else"
    folder, _ = member("shared", tarfile.DIRTYPE, mode=0o1777)
    archive = make_tar(tmp_path / "a.tar", (info, data), (folder, b""))
    out = extract_archive(archive, tmp_path / "out")
    for name in ("tool", "shared"):
        st = (out / name).lstat()
        assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX | stat.S_IWGRP | stat.S_IWOTH), oct(
            st.st_mode
        )
        assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid())


def test_deep_paths_are_refused_at_once_not_in_quadratic_time(python: str, tmp_path: Path) -> None:
    deep = "/".join(["d"] * 20000) + "/f"
    archive = make_tar(tmp_path / "deep.tar", member(deep, data=b"x"))
    start = time.monotonic()
    with pytest.raises(ArchiveError, match=r"deeper than|longer than"):
        extract_archive(archive, tmp_path / "out")
    assert time.monotonic() - start < 10  # a bound on runaway cost (25 s before), not a speed measurement
    ok = make_tar(tmp_path / "ok.tar", member("/".join(["d"] * (MAX_DEPTH - 1)) + "/f", data=b"x"))
    assert (extract_archive(ok, tmp_path / "ok").joinpath(*(["d"] * (MAX_DEPTH - 1)), "f")).read_bytes() == b"x"


@pytest.mark.parametrize(
    ("members", "match"),
    [
        ([member("x", data=b"1"), member("x/y", data=b"2")], "inside the file"),
        ([member("x", tarfile.DIRTYPE), member("x", data=b"2")], "earlier member made it a dir"),
        ([member("x", data=b"1"), member("x", tarfile.DIRTYPE)], "earlier member made it a file"),
    ],
)
def test_dir_file_conflicts_are_archive_errors_naming_the_member(
    members: list[Any], match: str, tmp_path: Path
) -> None:
    archive = make_tar(tmp_path / "c.tar", *members)
    with pytest.raises(ArchiveError, match=match) as info:
        extract_archive(archive, tmp_path / "out")
    assert ".extracting" not in str(info.value)


def test_zip_member_naming_the_target_itself_and_encrypted_zips_are_archive_errors(tmp_path: Path) -> None:
    dot = tmp_path / "dot.zip"
    with zipfile.ZipFile(dot, "w") as zf:
        zf.writestr(".", b"x")
    with pytest.raises(ArchiveError, match="target itself"):
        extract_archive(dot, tmp_path / "dot")
    encrypted = tmp_path / "enc.zip"
    with zipfile.ZipFile(encrypted, "w") as zf:
        zf.writestr("a.txt", b"secret")
    raw = bytearray(encrypted.read_bytes())
    for offset in (6, raw.rindex(b"PK\x01\x02") + 8):  # the flag bits of the local and the central header
        raw[offset] |= 0x1
    encrypted.write_bytes(bytes(raw))
    with pytest.raises(ArchiveError, match="encrypted"):
        extract_archive(encrypted, tmp_path / "enc")


def test_cli_prints_one_line_not_a_traceback_for_a_refused_archive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "src").mkdir()
    archive = make_tar(tmp_path / "src" / "evil.tar", *ATTACKS["redefined_symlink"])
    status = main(["download", archive.as_uri(), "--root", str(tmp_path / "data"), "--extract", "--no-progress"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert status == 1 and "Traceback" not in err and len(errors) == 1, err
    assert errors[0].startswith("error: ArchiveError:") and err.endswith(errors[0] + "\n")


def test_the_archive_size_cap_reaches_extraction_from_download_url_and_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "src").mkdir()
    archive = make_tar(tmp_path / "src" / "big.tar", member("big.bin", data=b"x" * 10_000))
    with pytest.raises(ArchiveError, match="more than 5000 bytes"):
        download_url(archive.as_uri(), tmp_path / "a", extract=True, max_total_bytes=5000, progress=False)
    args = ["download", archive.as_uri(), "--root", str(tmp_path / "b"), "--extract", "--max-total-bytes", "5000"]
    assert main([*args, "--quiet"]) == 1
    assert "more than 5000 bytes" in capsys.readouterr().err
    assert (
        download_url(archive.as_uri(), tmp_path / "c", extract=True, progress=False) / "big.bin"
    ).stat().st_size == 10_000


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs in a mount namespace of the test's own, held by a sleeping process, as this process reaches it.

    Nothing is mounted where anything else runs, and the filesystem goes with the namespace when the holder is killed,
    whatever becomes of the test.
    """
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("mounting a small filesystem needs root and unshare")
    mountpoint = tmp_path / "small"
    mountpoint.mkdir()
    holder = subprocess.Popen(
        [
            *("unshare", "--mount", "--propagation", "private", "--", "sh", "-c"),
            'mount -t tmpfs -o size=1m tmpfs "$0" && echo ready && exec sleep 600',
            str(mountpoint),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != "ready":  # "" once the shell exits: the mount failed
            pytest.skip(f"cannot mount a small filesystem in a mount namespace: {holder.communicate()[1].strip()}")
        yield Path(f"/proc/{holder.pid}/root") / mountpoint.relative_to("/")
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
        holder.communicate(timeout=30)


def _bomb(path: Path, size: int) -> bytes:
    """An archive of ``size`` zero bytes in one member, a few KiB compressed."""
    if path.suffix == ".zip":
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
            zf.writestr("zeros.bin", bytes(size))
    else:
        with tarfile.open(path, "w:gz") as tar:
            info = tarfile.TarInfo("zeros.bin")
            info.size = size
            tar.addfile(info, io.BytesIO(bytes(size)))
    return path.read_bytes()


@pytest.mark.parametrize("name", ["bomb.zip", "bomb.tar.gz"])
def test_a_bomb_that_fills_the_disk_is_the_packages_error_and_gives_the_space_back(
    name: str, small_disk: Path, server: TestHTTPServer, tmp_path: Path
) -> None:
    url = server.add("/" + name, _bomb(tmp_path / name, 8 << 20))  # 8 MiB for a 1 MiB filesystem
    with pytest.raises(DownloadError, match="No space left on device") as info:
        download_url(url, small_disk, extract=True, progress=False)
    error = info.value
    assert isinstance(error, IgniteExtError) and isinstance(error, OSError) and error.errno == errno.ENOSPC
    assert ".extracting" not in str(error) and name in str(error)  # names the archive, not the private directory
    assert sorted(p.name for p in small_disk.iterdir() if not p.name.endswith((".lock", ".verified.json"))) == [name]
    assert shutil.disk_usage(small_disk).used < 128 << 10  # the archive and the records: the 1 MiB is given back
