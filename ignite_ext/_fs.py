"""File helpers that downloads, extraction and the cache share: locks, durable renames, atomic JSON, orphans.

Standard library only, and nothing platform-specific, so the download path imports on every platform. The lock
downloads and extraction take is in :mod:`ignite_ext._locks`.

Who made a file is part of its name: ``<host>.<pid>.<random>`` (:func:`owner_tag`). A later scan
(:func:`orphans`) tells from that name whether its writer is gone: a pid of this host that no longer runs, or, for
another host (whose pids cannot be checked), a file left untouched for a given age.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import socket
import stat
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "OWNER",
    "fsync_dir",
    "host",
    "idle",
    "listdir",
    "orphans",
    "own_regular_file",
    "owner_gone",
    "owner_tag",
    "pid_alive",
    "process_identity",
    "read_json",
    "sidecar_stem",
    "unlink",
    "write_json",
]

#: ``host.pid.random`` in a file name: whoever made it, so that a scan can tell whether that writer still lives.
OWNER = r"(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.(?P<rand>[0-9a-f]{8})"


def process_identity(pid: int) -> str | None:
    """What tells process ``pid`` from any other, on any host: boot id, pid namespace, pid, start time.

    None when there is no such process. Two identities name the same live process only if equal: a pid reused
    after a death has another start time, a pid of another host another boot id (or pid namespace).

    Examples:
        >>> import os
        >>> from ignite_ext._fs import process_identity
        >>> process_identity(os.getpid()) == process_identity(os.getpid()), process_identity(2**22 + 7)
        (True, None)

    .. versionadded:: 0.3.0
    .. versionchanged:: 0.4.0
       Moved here from :mod:`ignite_ext.distributed.liveness.keeper` (which still exports it), for the cache.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # the command name may hold spaces and parentheses
    if fields[0] in (b"Z", b"X"):
        return None
    return f"{boot}|{namespace}|{pid}|{int(fields[19])}"


def pid_alive(pid: int) -> bool:
    """Return whether ``pid`` runs on this host; a zombie (killed, not yet reaped) counts as dead.

    Args:
        pid: a process id of this host.

    Returns:
        False when no such process runs (or it is a zombie), True otherwise (also for another user's process).

    Examples:
        >>> import os
        >>> from ignite_ext._fs import pid_alive
        >>> pid_alive(os.getpid())
        True

    .. versionadded:: 0.2.0
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    try:  # a killed child that its parent has not reaped yet is a zombie: it will never write again
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def host() -> str:
    """This host's name, reduced to the characters :data:`OWNER` allows.

    Examples:
        >>> import re
        >>> from ignite_ext._fs import host
        >>> bool(re.fullmatch(r"[A-Za-z0-9-]+", host()))
        True

    .. versionadded:: 0.2.0
    """
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "localhost"


def owner_tag() -> str:
    """``host.pid.random``: unique to this writer, and tells a later scan whether the writer still lives.

    Examples:
        >>> import re
        >>> from ignite_ext._fs import OWNER, owner_tag
        >>> bool(re.fullmatch(OWNER, owner_tag()))
        True

    .. versionadded:: 0.2.0
    """
    return f"{host()}.{os.getpid()}.{secrets.token_hex(4)}"


#: Names longer than this (in UTF-8 bytes) are shortened in the names of the files kept beside them.
SIDECAR_NAME_MAX = 120


def sidecar_stem(name: str) -> str:
    """``name`` as it appears in the names of the files kept beside it (locks, records, temp files).

    Those names add up to ~70 bytes to it, so a long name is cut and made unique with a hash: every sidecar name
    stays under the 255 bytes filesystems allow.

    Examples:
        >>> from ignite_ext._fs import sidecar_stem
        >>> sidecar_stem("data.tar.gz")
        'data.tar.gz'
        >>> stem = sidecar_stem("x" * 240 + ".bin")
        >>> len(stem.encode()), stem.startswith("x" * 60), stem == sidecar_stem("x" * 240 + ".bin")
        (77, True, True)

    .. versionadded:: 0.2.0
    """
    raw = name.encode("utf-8", "surrogateescape")
    if len(raw) <= SIDECAR_NAME_MAX:
        return name
    head = raw[:60].decode("utf-8", "ignore")
    return f"{head}~{hashlib.sha256(raw).hexdigest()[:16]}"


def own_regular_file(path: Path) -> bool:
    """Whether ``path`` itself (not what a link points to) is a regular file owned by this process's user.

    What another user of a shared folder plants (a symlink, a fifo, a file of theirs) is never taken over.

    Examples:
        >>> import os, tempfile
        >>> from pathlib import Path
        >>> from ignite_ext._fs import own_regular_file
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     mine = Path(tmp, "mine")
        ...     _ = mine.write_text("x")
        ...     os.symlink(mine, Path(tmp, "link"))
        ...     own_regular_file(mine), own_regular_file(Path(tmp, "link")), own_regular_file(Path(tmp, "none"))
        (True, False, False)

    .. versionadded:: 0.2.0
    """
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and (not hasattr(os, "geteuid") or st.st_uid == os.geteuid())


def idle(path: Path, max_age_s: float) -> bool:
    """Whether ``path`` exists and was untouched for ``max_age_s``: the only sign of death for another host's writer.

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from ignite_ext._fs import idle
        >>> with tempfile.NamedTemporaryFile() as f:
        ...     idle(Path(f.name), 3600.0), idle(Path(f.name), -1.0)
        (False, True)

    .. versionadded:: 0.2.0
    """
    try:
        return time.time() - path.stat().st_mtime > max_age_s
    except FileNotFoundError:
        return False


def owner_gone(match: re.Match[str], path: Path, max_age_s: float) -> bool:
    """Whether the writer named in ``match`` (of :data:`OWNER`) can no longer touch ``path``.

    Examples:
        >>> import re, tempfile
        >>> from pathlib import Path
        >>> from ignite_ext._fs import OWNER, owner_gone, owner_tag
        >>> with tempfile.NamedTemporaryFile() as f:
        ...     owner_gone(re.fullmatch(OWNER, owner_tag()), Path(f.name), 3600.0)  # this very process
        False

    .. versionadded:: 0.2.0
    """
    # On Windows os.kill(pid, 0) would send CTRL_C_EVENT, so only the idle-age rule applies there.
    if match["host"] == host() and os.name != "nt":
        return not pid_alive(int(match["pid"]))
    return idle(path, max_age_s)


def listdir(directory: Path) -> list[str]:
    """The names in ``directory``, or none when it cannot be listed.

    Examples:
        >>> from pathlib import Path
        >>> from ignite_ext._fs import listdir
        >>> listdir(Path("/nonexistent"))
        []

    .. versionadded:: 0.2.0
    """
    try:
        return os.listdir(directory)
    except OSError:
        return []


def orphans(directory: Path, pattern: re.Pattern[str], max_age_s: float) -> Iterator[tuple[Path, re.Match[str]]]:
    r"""Entries of ``directory`` named like ``pattern`` (which holds :data:`OWNER`) whose writer is gone.

    Examples:
        >>> import re, tempfile
        >>> from pathlib import Path
        >>> from ignite_ext._fs import OWNER, host, orphans
        >>> with tempfile.TemporaryDirectory() as tmp:  # a temp file of a pid that does not run on this host
        ...     _ = Path(tmp, f"x.{host()}.999999999.0123abcd.tmp").write_text("")
        ...     [p.name.split(".")[2] for p, _ in orphans(Path(tmp), re.compile(rf"x\.{OWNER}\.tmp"), 3600.0)]
        ['999999999']

    .. versionadded:: 0.2.0
    """
    for name in listdir(directory):
        match = pattern.fullmatch(name)
        if match is not None and owner_gone(match, directory / name, max_age_s):
            yield directory / name, match


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op where directories cannot be opened, e.g. Windows).

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from ignite_ext._fs import fsync_dir
        >>> fsync_dir(Path(tempfile.gettempdir()))

    .. versionadded:: 0.2.0
    """
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def unlink(*paths: Path) -> None:
    """Delete ``paths``; those already gone are fine.

    Examples:
        >>> from pathlib import Path
        >>> from ignite_ext._fs import unlink
        >>> unlink(Path("/nonexistent/a"), Path("/nonexistent/b"))

    .. versionadded:: 0.2.0
    """
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when it is missing, unreadable or not an object.

    Examples:
        >>> from pathlib import Path
        >>> from ignite_ext._fs import read_json
        >>> read_json(Path("/nonexistent.json")) is None
        True

    .. versionadded:: 0.2.0
    """
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_json(path: Path, value: Mapping[str, Any]) -> None:
    """Replace ``path`` atomically with ``value`` as JSON (readers see the old or the new record, never a torn one).

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from ignite_ext._fs import read_json, write_json
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     write_json(Path(tmp, "r.json"), {"a": 1})
        ...     read_json(Path(tmp, "r.json"))
        {'a': 1}

    .. versionadded:: 0.2.0
    """
    temp = path.with_name(f"{path.name}.{owner_tag()}.tmp")
    try:
        temp.write_text(json.dumps(value, sort_keys=True), encoding="utf-8")
        os.replace(temp, path)
    finally:
        unlink(temp)
