"""Download on the first rank with the ``download`` flag, as torchvision datasets take it.

``MyDataset(root, download=False)`` fetches its file with ``download_url`` when ``download`` is true and otherwise
expects it to be there. Under ``idist.one_rank_first()`` rank 0 gets ``download=True`` and fetches, while the other
ranks wait and then open the file rank 0 fetched::

    with idist.one_rank_first() as download:
        ds = MyDataset(root, download=download)

Offline by default: the script writes a small CSV file and serves it on 127.0.0.1 (``--url``/``--sha256`` fetch
any text file instead, one sample per line). ``--fail`` makes rank 0's download fail (the URL answers 404): the
other ranks then raise ``RankFailedError`` naming rank 0 instead of waiting forever.

Run it::

    python examples/download_first_rank.py
    python examples/download_first_rank.py --fail
"""

from __future__ import annotations

import argparse
import hashlib
import http.server
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from torch.utils.data import Dataset

import ignite_ext.distributed as idist
from ignite_ext.data import download_url


class CountingServer(http.server.HTTPServer):
    """Serves ``folder`` on 127.0.0.1 from a thread, and counts the requests and the bytes it sends."""

    def __init__(self, folder: Path) -> None:
        self.requests = self.bytes_served = 0
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, directory=str(folder), **kwargs)

            def copyfile(self, source: Any, outputfile: Any) -> None:
                body = source.read()
                outputfile.write(body)
                server.bytes_served += len(body)

            def log_request(self, code: Any = "-", size: Any = "-") -> None:
                server.requests += 1

            def log_message(self, format: str, *args: Any) -> None:
                pass  # no access log on the terminal

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self) -> None:
        """Stop serving and close the socket."""
        self.shutdown()
        self.server_close()


class MyDataset(Dataset[str]):
    """A text file with one sample per line, fetched from ``url`` into ``root`` when ``download`` is true."""

    def __init__(self, root: str | Path, download: bool = False, *, url: str, sha256: str | None = None) -> None:
        self.path = Path(root) / Path(urlparse(url).path).name
        if download:
            download_url(url, root, sha256=sha256)
        if not self.path.is_file():
            raise RuntimeError(f"{self.path} not found, use download=True to fetch it")
        self.samples = self.path.read_text().splitlines()

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> str:
        return self.samples[index]


def training(local_rank: int, root: str, url: str, sha256: str | None) -> None:
    rank, first, downloaded = idist.get_rank(), False, False
    try:
        with idist.one_rank_first() as download:  # truthy on rank 0 only
            first = bool(download)
            ds = MyDataset(root, download=first, url=url, sha256=sha256)
            downloaded = first
        outcome = f"{len(ds)} samples, first {ds[0]!r}"
    except idist.RankFailedError as exc:  # the first rank failed: this rank did not run the block
        outcome = f"RankFailedError: {exc}"
    except Exception as exc:  # this rank's own block failed (with --fail, rank 0's download)
        outcome = f"{type(exc).__name__}: {exc}"
    # Gathered before the ordered block, so that a block, not a gloo collective, comes last before the group is
    # destroyed: torch before its fix of June 2025 (pytorch/pytorch#56297) can deadlock at exit when the group is
    # destroyed while gloo's thread still frees the last collective's tensors.
    flags = idist.all_gather(torch.tensor([int(downloaded)]))
    with idist.rank_scheduler(order=idist.Ordered()):
        print(f"rank {rank}: download={first}; {outcome}", flush=True)
    if rank == 0:
        print(f"downloaded by ranks {[r for r, f in enumerate(flags.tolist()) if f]}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4, help="number of ranks (default 4)")
    parser.add_argument("--url", help="a text file to fetch (default: a generated file served on 127.0.0.1)")
    parser.add_argument("--sha256", help="expected SHA-256 of --url")
    parser.add_argument("--root", help="download directory (default: a temporary directory)")
    parser.add_argument("--fail", action="store_true", help="make rank 0's download fail (404)")
    parser.add_argument("--start-method", default="spawn", choices=["spawn", "fork"], help="fork: faster, CPU only")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("ignite.distributed.launcher.Parallel").setLevel(logging.WARNING)

    with tempfile.TemporaryDirectory() as tmp:
        root = args.root or str(Path(tmp, "data"))
        server: CountingServer | None = None
        url, sha256, data = args.url, args.sha256, b""
        if url is None:
            data = "".join(f"{i},{i * i}\n" for i in range(1000)).encode()
            Path(tmp, "served").mkdir()
            Path(tmp, "served", "squares.csv").write_bytes(data)
            server = CountingServer(Path(tmp, "served"))
            url, sha256 = f"{server.url}/squares.csv", hashlib.sha256(data).hexdigest()
        if args.fail:
            url = url + ".missing"
        with idist.Parallel(backend="gloo", nproc_per_node=args.nproc, start_method=args.start_method) as parallel:
            parallel.run(training, root, url, sha256)
        if server is not None:
            server.close()
            copies = server.bytes_served / len(data)
            print(f"server: {server.requests} request(s), sent {server.bytes_served} bytes ({copies:.2f} copies)")
