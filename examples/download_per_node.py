"""One copy per node directory, one fetch per job: ``SharedPath`` finds which ranks share a directory.

Every rank runs ``download_url(..., extract=True, relay=True)`` inside
``idist.rank_scheduler(order=idist.SharedPath(root))``:
the ranks that see the same directory on the filesystem form a group, its lowest rank (the leader) makes the
directory's copy and extracts it first, and the others then find the verified, extracted copy. The yielded ``Turn``
says which group a rank is in and who leads it. Here two simulated nodes of 2 ranks each get a directory each; the
leaders chain up inside the block (``relay=True``: each leader's relay listens on a port while the block runs),
so the server sends the archive once for the job: one leader fetches it, the other receives it from that leader
while it downloads. Without ``relay=True`` (or with ``IGNITE_EXT_RELAY=0``) it would send it twice, once per
directory, and open no port. ``download_for_job`` is this block in one call.

Offline: the script makes a small archive of text files and serves it on 127.0.0.1.

Run it::

    python examples/download_per_node.py
"""

from __future__ import annotations

import argparse
import hashlib
import http.server
import io
import logging
import os
import tarfile
import tempfile
import threading
from pathlib import Path
from typing import Any

import ignite_ext.distributed as idist
from ignite_ext.data import download_url

RANKS_PER_NODE = 2


class CountingServer(http.server.HTTPServer):
    """Serves ``folder`` on 127.0.0.1 from a thread, and counts the bytes it sends."""

    def __init__(self, folder: Path) -> None:
        self.bytes_served = 0
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, directory=str(folder), **kwargs)

            def copyfile(self, source: Any, outputfile: Any) -> None:
                body = source.read()
                outputfile.write(body)
                server.bytes_served += len(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # no access log on the terminal

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self) -> None:
        """Stop serving and close the socket."""
        self.shutdown()
        self.server_close()


def make_archive(folder: Path) -> Path:
    """Write ``folder/data.tar.gz``: a ``data/`` folder of 50 small text files."""
    folder.mkdir(parents=True)
    archive = folder / "data.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for i in range(50):
            body = f"sample {i}\n".encode() * 100
            info = tarfile.TarInfo(f"data/{i:02d}.txt")
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return archive


def fetch(local_rank: int, base: str, url: str, sha256: str) -> None:
    rank = idist.get_rank()
    # On a real cluster every rank would pass the same path (say /tmp/data), node-local by itself. All ranks run
    # on one machine here, so each simulated node gets a directory of its own: ranks 0-1 node0/, ranks 2-3 node1/.
    root = Path(base) / f"node{rank // RANKS_PER_NODE}"
    with idist.rank_scheduler(order=idist.SharedPath(root)) as turn:
        data = download_url(url, root, sha256=sha256, extract=True, progress=False, relay=True)
    files = sum(1 for p in data.rglob("*") if p.is_file())
    with idist.rank_scheduler(order=idist.Ordered()):
        print(
            f"rank {rank}: {root.name}/ group {list(turn.group)} leader {turn.leader} first={bool(turn)}; "
            f"{files} files in {data.name}/",
            flush=True,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4, help="number of ranks (default 4, 2 per directory)")
    parser.add_argument("--start-method", default="spawn", choices=["spawn", "fork"], help="fork: faster, CPU only")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("ignite.distributed.launcher.Parallel").setLevel(logging.WARNING)

    with tempfile.TemporaryDirectory() as tmp:
        archive = make_archive(Path(tmp, "served"))
        sha256 = hashlib.sha256(archive.read_bytes()).hexdigest()
        server = CountingServer(archive.parent)
        with idist.Parallel(backend="gloo", nproc_per_node=args.nproc, start_method=args.start_method) as parallel:
            parallel.run(fetch, str(Path(tmp, "nodes")), f"{server.url}/{archive.name}", sha256)
        server.close()
        size = archive.stat().st_size
        print(f"server sent {server.bytes_served} bytes: {server.bytes_served / size:.2f} archives of {size} bytes")
