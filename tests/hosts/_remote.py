"""A network filesystem between simulated hosts, with attribute caching: sshfs over the bed's network.

This machine's kernel has no NFS client, so the share that crosses the network is SFTP: OpenSSH's ``sftp-server``
(no sshd: ``python -m tests.hosts._remote IP PORT`` hands every TCP connection to one) exports a directory of
host 0, and every host, host 0 included, mounts it with ``sshfs -o directport`` and caching on: FUSE attribute,
entry and negative caching (``attr_timeout``, ``entry_timeout``, ``negative_timeout``, as NFS's ``actimeo``) and
sshfs's own directory cache. The mounts live in the hosts' mount namespaces and end with them.

What differs from NFS: locks (``flock`` and POSIX) on a FUSE mount are kept by each host's kernel, never sent to
the server (as on NFS mounted ``nolock``), SFTP reports no link counts, and sshfs makes up its own inode numbers.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests._hosts import HostBed

__all__ = ["SFTP_SERVER", "mount_remote", "remote_unavailable"]

SFTP_SERVER = Path("/usr/lib/openssh/sftp-server")
_PORT = 2222


def remote_unavailable() -> str | None:
    """Why the network filesystem cannot be mounted here (None when it can)."""
    found = {"sshfs": shutil.which("sshfs") is not None, str(SFTP_SERVER): SFTP_SERVER.exists()}
    missing = [what for what, there in found.items() if not there]
    if missing:
        return f"{' and '.join(missing)} missing (apt-get install --no-install-recommends sshfs openssh-sftp-server)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse: FUSE mounts are not possible here"
    return None


def mount_remote(bed: HostBed, export: Path, at: str = "/tmp/remote", cache_s: float = 3.0) -> None:
    """Export ``export`` (a directory of host 0) and mount it at ``at`` on every host, cached for ``cache_s``."""
    server = bed.hosts[0]
    relay = bed.start(
        server, [sys.executable, "-m", "tests.hosts._remote", server.ip, str(_PORT)], bed.env(), "sftp.log"
    )
    end = time.monotonic() + 30
    while "listening" not in (bed.logs / "sftp.log").read_text():
        if relay.poll() is not None or time.monotonic() > end:
            raise RuntimeError(f"the SFTP relay did not start: {(bed.logs / 'sftp.log').read_text()}")
        time.sleep(0.05)
    cache = f"attr_timeout={cache_s},entry_timeout={cache_s},negative_timeout={cache_s},dcache_timeout={cache_s:.0f}"
    for host in bed.hosts:
        host.run(["mkdir", "-p", at])
        host.run(["sshfs", "-o", f"directport={_PORT},{cache}", f"{server.ip}:{export}", at])


def _relay(ip: str, port: int) -> None:
    listener = socket.create_server((ip, port))
    print("listening", flush=True)
    while True:
        conn, _ = listener.accept()
        subprocess.Popen([str(SFTP_SERVER), "-e", "-l", "ERROR"], stdin=conn.fileno(), stdout=conn.fileno())
        conn.close()


if __name__ == "__main__":
    _relay(sys.argv[1], int(sys.argv[2]))
