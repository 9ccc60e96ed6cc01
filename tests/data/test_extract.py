"""extract_archive: every supported format, every kind of malicious member, atomicity, concurrency."""

from __future__ import annotations

import io
import logging
import os
import stat
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.http_server import TestHTTPServer
from ignite_ext._fs import host
from ignite_ext.data import ArchiveError, download_url, extract_archive
from ignite_ext.data.download import _members
from ignite_ext.data.download import extract as ex
from tests._world import World

Member = tuple[tarfile.TarInfo, bytes | None]


def regular(name: str, data: bytes = b"data", mode: int = 0o644) -> Member:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    return info, data


def special(name: str, kind: bytes, linkname: str = "") -> Member:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    return info, None


def directory(name: str) -> Member:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, 0o755
    return info, None


def make_tar(path: Path, *members: Member) -> Path:
    compression = {".gz": "gz", ".tgz": "gz", ".bz2": "bz2", ".xz": "xz"}.get(path.suffix, "")
    with tarfile.open(path, f"w:{compression}") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def make_zip(path: Path, *entries: tuple[str, bytes] | zipfile.ZipInfo) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for entry in entries:
            if isinstance(entry, zipfile.ZipInfo):
                zf.writestr(entry, b"target")
            else:
                zf.writestr(*entry)
    return path


def tree(root: Path) -> dict[str, str]:
    """Relative path -> content, ``-> target`` for links, ``/`` for directories (the completion record left out)."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if rel == ex._RECORD:
            continue
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_dir():
            out[rel] = "/"
        else:
            out[rel] = path.read_text()
    return out


def siblings(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}.") and "lock" not in p.name)


GOOD: list[Member] = [
    directory("top"),
    regular("top/a.txt", b"alpha"),
    regular("./top/sub/b.txt", b"beta"),
    special("top/link", tarfile.SYMTYPE, "sub/b.txt"),
    special("top/sub/up", tarfile.SYMTYPE, "../a.txt"),
    special("top/hard", tarfile.LNKTYPE, "top/a.txt"),
]
GOOD_TREE = {
    "top": "/",
    "top/a.txt": "alpha",
    "top/hard": "alpha",
    "top/link": "-> sub/b.txt",
    "top/sub": "/",
    "top/sub/b.txt": "beta",
    "top/sub/up": "-> ../a.txt",
}


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz"])
def test_tar_formats(tmp_path: Path, suffix: str) -> None:
    archive = make_tar(tmp_path / f"data{suffix}", *GOOD)
    dest = extract_archive(archive, tmp_path / "out")
    assert dest == tmp_path / "out"
    assert tree(dest) == GOOD_TREE
    assert siblings(dest) == []


def test_zip(tmp_path: Path) -> None:
    archive = make_zip(tmp_path / "data.zip", ("top/a.txt", b"alpha"), ("top/sub/", b""), ("top/sub/b.txt", b"beta"))
    assert tree(extract_archive(archive, tmp_path / "out")) == {
        "top": "/",
        "top/a.txt": "alpha",
        "top/sub": "/",
        "top/sub/b.txt": "beta",
    }


def test_archive_stem_and_unsupported_suffix(tmp_path: Path) -> None:
    assert ex.archive_stem("a.b.TAR.GZ") == "a.b" and ex.archive_stem("x.tar") == "x"
    for name in ("data.rar", ".tar.gz", "data.gz"):
        with pytest.raises(ArchiveError, match="not a supported archive"):
            ex.archive_stem(name)


def test_data_filter_strips_setuid(tmp_path: Path) -> None:
    archive = make_tar(tmp_path / "a.tar", regular("tool", b"#!", mode=0o4777))
    mode = stat.S_IMODE((extract_archive(archive, tmp_path / "out") / "tool").stat().st_mode)
    assert not mode & (stat.S_ISUID | stat.S_IWOTH)


@pytest.mark.parametrize(
    ("members", "reason"),
    [
        ([regular("/etc/evil")], "absolute"),
        ([regular("top/../../evil")], r"'\.\.'"),
        ([special("link", tarfile.SYMTYPE, "/etc/passwd")], "outside"),
        ([special("link", tarfile.SYMTYPE, "../outside")], "outside"),
        ([special("link", tarfile.SYMTYPE, "sub/../../outside")], "outside"),
        # Each link stays inside on its own; followed through p/q/b (-> r), a leaves the target.
        (
            [
                directory("p/q"),
                special("p/q/b", tarfile.SYMTYPE, "../../r"),
                special("p/q/a", tarfile.SYMTYPE, "b/../../.."),
            ],
            "outside",
        ),
        ([special("loop", tarfile.SYMTYPE, "loop/x")], "loops"),
        ([special("dir", tarfile.SYMTYPE, "."), regular("dir/through.txt")], "inside a link"),
        ([regular("a.txt"), special("hard", tarfile.LNKTYPE, "../../etc/passwd")], r"'\.\.'"),
        ([special("hard", tarfile.LNKTYPE, "/etc/passwd")], "absolute"),
        ([special("hard", tarfile.LNKTYPE, "not-in-archive")], "not a file of the archive"),
        ([special("tty", tarfile.CHRTYPE)], "device"),
        ([special("disk", tarfile.BLKTYPE)], "device"),
        ([special("pipe", tarfile.FIFOTYPE)], "fifo"),
        ([regular("a", b"x" * 600), regular("b", b"x" * 600)], "more than 1000 bytes"),
    ],
)
def test_malicious_tar_is_refused(tmp_path: Path, members: list[Member], reason: str) -> None:
    archive = make_tar(tmp_path / "evil.tar.gz", *members)
    dest = tmp_path / "deep" / "out"
    with pytest.raises(ArchiveError, match=reason):
        extract_archive(archive, dest, max_total_bytes=1000)
    assert not dest.exists() and siblings(dest) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deep", "evil.tar.gz"]


def _zip_link() -> zipfile.ZipInfo:
    info = zipfile.ZipInfo("link")
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    return info


def _zip_fifo() -> zipfile.ZipInfo:
    info = zipfile.ZipInfo("pipe")
    info.external_attr = (stat.S_IFIFO | 0o644) << 16
    return info


@pytest.mark.parametrize(
    ("entries", "reason"),
    [
        ([("../evil", b"x")], r"'\.\.'"),
        ([("/abs/evil", b"x")], "absolute"),
        ([("C:/evil", b"x")], "absolute"),
        ([_zip_link()], "links"),
        ([_zip_fifo()], "fifo"),
        ([("a", b"x" * 600), ("b", b"x" * 600)], "more than 1000 bytes"),
    ],
)
def test_malicious_zip_is_refused(tmp_path: Path, entries: list[tuple[str, bytes]], reason: str) -> None:
    archive = make_zip(tmp_path / "evil.zip", *entries)
    dest = tmp_path / "out"
    with pytest.raises(ArchiveError, match=reason):
        extract_archive(archive, dest, max_total_bytes=1000)
    assert not dest.exists() and siblings(dest) == []


def test_second_call_is_a_no_op_and_a_new_archive_replaces(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    archive = make_tar(tmp_path / "a.tar", regular("f", b"one"))
    with caplog.at_level(logging.INFO, logger="ignite_ext.data.extract"):
        extract_archive(archive, tmp_path / "out")
        extract_archive(archive, tmp_path / "out")
        assert sum("extracting" in r.getMessage() for r in caplog.records) == 1
        make_tar(archive, regular("g", b"two"))
        extract_archive(archive, tmp_path / "out")
    assert tree(tmp_path / "out") == {"g": "two"}
    assert siblings(tmp_path / "out") == []


def test_foreign_directory_is_not_touched(tmp_path: Path) -> None:
    archive = make_tar(tmp_path / "a.tar", regular("f", b"one"))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("keep")
    with pytest.raises(FileExistsError):
        extract_archive(archive, tmp_path / "mine")
    assert tree(tmp_path / "mine") == {"keep.txt": "keep"}
    (tmp_path / "empty").mkdir()
    assert tree(extract_archive(archive, tmp_path / "empty")) == {"f": "one"}


def test_failure_midway_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    archive = make_tar(tmp_path / "a.tar", regular("f", b"one"))

    def crash(root: Path) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(ex, "check_links", crash)
    with pytest.raises(OSError, match="disk full"):
        extract_archive(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists() and siblings(tmp_path / "out") == []


def test_orphans_of_dead_extractors_are_removed(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    orphan = tmp_path / f".out.{host()}.{proc.pid}.0123abcd.extracting"
    (orphan / "half").mkdir(parents=True)
    archive = make_tar(tmp_path / "a.tar", regular("f", b"one"))
    extract_archive(archive, tmp_path / "out")
    assert not orphan.exists()


def test_download_and_extract(tmp_path: Path) -> None:
    archive = make_tar(tmp_path / "src.tar.gz", *GOOD)
    with TestHTTPServer() as server:
        url = server.add("/data.tar.gz", archive.read_bytes())
        root = tmp_path / "root"
        dest = download_url(url, root, extract=True, progress=False)
        assert dest == root / "data" and tree(dest) == GOOD_TREE
        assert download_url(url, root, extract=True, progress=False) == dest
        assert len(server.requests("/data.tar.gz")) == 1


def extract_counting(archive: str, dest: str) -> int:
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("ignite_ext.data.extract")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    extract_archive(archive, dest)
    return sum("extracting" in r.getMessage() for r in records)


class _NoLock:
    def __init__(self, path: str) -> None:
        pass

    def acquire(self, blocking: bool = True) -> bool:
        return True

    def release(self) -> None:
        pass


def extract_without_lock(archive: str, dest: str) -> int:
    from ignite_ext import _locks

    _locks.lock_factory = _NoLock
    return extract_counting(archive, dest)


@pytest.mark.distributed
@pytest.mark.parametrize("lock", [True, False])
def test_concurrent_extractors(world: World, tmp_path: Path, lock: bool) -> None:
    members = [regular(f"d{i}/f{j}.txt", os.urandom(20_000)) for i in range(10) for j in range(10)]
    archive = make_tar(tmp_path / "big.tar.gz", *members)
    target = extract_counting if lock else extract_without_lock
    results = world(target, str(archive), str(tmp_path / "out"), backend=None)
    if lock:
        assert sum(results) == 1  # the others waited and found it done
    else:
        assert sum(results) >= 1  # several may extract; the first rename wins, the others discard theirs
    assert len(list((tmp_path / "out").rglob("*.txt"))) == 100
    assert siblings(tmp_path / "out") == []


@pytest.fixture(autouse=True)
def _no_leaks(tmp_path: Path) -> Iterator[None]:
    yield
    leaked = [p for p in tmp_path.rglob(".*") if p.name.endswith((".extracting", ".old", ".tmp"))]
    assert leaked == []


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz", ".tar.bz2", ".tar.xz", ".zip"])
def test_truncated_archive_is_an_archive_error(tmp_path: Path, suffix: str) -> None:
    payload = os.urandom(200_000)
    archive = tmp_path / f"data{suffix}"
    if suffix == ".zip":
        make_zip(archive, ("big.bin", payload))
    else:
        make_tar(archive, regular("big.bin", payload))
    data = archive.read_bytes()
    archive.write_bytes(data[: len(data) // 2])
    with pytest.raises(ArchiveError, match="unreadable archive"):
        extract_archive(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_data_filter_stands_behind_the_member_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_members, "check_tar_members", lambda members, max_total_bytes: None)
    archive = make_tar(tmp_path / "evil.tar", special("link", tarfile.SYMTYPE, "../../outside"))
    with pytest.raises(ArchiveError, match="refused by tarfile's data filter"):
        extract_archive(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists()
