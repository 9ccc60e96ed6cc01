"""Eight processes fetch one file at once from a bandwidth-limited loopback server: bytes served and wall time.

Peers, in one run and against the same server: ``ignite_ext.data.download_url``; what torchvision's
``download_url`` does (plain ``urllib`` streamed straight to the final path, then an MD5 check; a minimal
equivalent is written here so that torchvision is not needed); and ``torch.hub.download_url_to_file`` (a private
``.partial`` file moved into place, SHA-256 prefix check). The server's throttle is one shared link, so every
duplicate download slows all of them. Bytes are reported as a multiple of the file size, wall time as a ratio to
one process of the same method downloading alone (and to a plain ``urllib`` download alone); processes are
started and their imports done before the clock starts. Scenarios that cost one download's time run
:data:`REPEATS` times and report the median, to damp the noise of a shared machine.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import platform
import queue
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._report import print_result
from benchmarks.http_server import TestHTTPServer

NAME = "download"

PROCS = 8
#: Runs of each cheap scenario (one download's worth of time); the median wall time is reported.
REPEATS = 3
_MB = 1_000_000
#: File size and link bandwidth in MB and MB/s, for the full run and ``quick=True``.
SIZES_MB = {"full": (200, 100), "quick": (20, 20)}
_CTX = mp.get_context("forkserver")


def _ours(url: str, root: str, sha256: str, md5: str) -> None:
    from ignite_ext.data import download_url

    download_url(url, root, sha256=sha256, progress=False)


def _torchvision_like(url: str, root: str, sha256: str, md5: str) -> None:
    # torchvision.datasets.utils.download_url: skip when the file exists with the right MD5, else stream the
    # response into the final path and check the MD5 afterwards.
    path = os.path.join(root, os.path.basename(url))
    os.makedirs(root, exist_ok=True)
    if _md5_ok(path, md5):
        return
    request = urllib.request.Request(url, headers={"User-Agent": "torchvision-like"})
    with urllib.request.urlopen(request) as response, open(path, "wb") as out:
        while chunk := response.read(32 * 1024):
            out.write(chunk)
    if not _md5_ok(path, md5):
        raise RuntimeError("File not found or corrupted.")


def _torch_hub(url: str, root: str, sha256: str, md5: str) -> None:
    from torch.hub import download_url_to_file

    os.makedirs(root, exist_ok=True)
    download_url_to_file(url, os.path.join(root, os.path.basename(url)), hash_prefix=sha256, progress=False)


def _prepare(method: str) -> None:
    """Do each method's imports before the clock starts."""
    if method == "ours":
        import ignite_ext.data  # noqa: F401
    elif method == "torch.hub":
        import torch.hub  # noqa: F401


_METHODS: dict[str, Callable[[str, str, str, str], None]] = {
    "ours": _ours,
    "torchvision-like": _torchvision_like,
    "torch.hub": _torch_hub,
}
_LABELS = {
    "ours": "ignite_ext download_url",
    "torchvision-like": "torchvision download_url (equivalent)",
    "torch.hub": "torch.hub download_url_to_file",
}


def _md5_ok(path: str, md5: str) -> bool:
    if not os.path.isfile(path):
        return False
    digest = hashlib.md5()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest() == md5


def _worker(method: str, url: str, root: str, sha256: str, md5: str, ready: Any, start: Any, results: Any) -> None:
    _prepare(method)
    ready.put(os.getpid())
    start.wait()
    try:
        _METHODS[method](url, root, sha256, md5)
        error = ""
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    results.put((time.monotonic(), error))


def _scenario(
    server: TestHTTPServer, payload: bytes, method: str, procs: int, workdir: Path, repeat: int
) -> dict[str, Any]:
    path = f"/{method.replace('.', '-')}-{procs}-{repeat}/data.bin"
    url = server.add(path, payload)
    root = workdir / f"{method}-{procs}-{repeat}"
    sha256 = hashlib.sha256(payload).hexdigest()
    md5 = hashlib.md5(payload).hexdigest()
    ready, results, start = _CTX.Queue(), _CTX.Queue(), _CTX.Event()
    args = (method, url, str(root), sha256, md5, ready, start, results)
    workers = [_CTX.Process(target=_worker, args=args, daemon=True) for _ in range(procs)]
    for worker in workers:
        worker.start()
    try:
        for _ in workers:
            ready.get(timeout=120)
        t0 = time.monotonic()
        start.set()
        outcomes = [results.get(timeout=600) for _ in workers]
    except queue.Empty as exc:
        raise RuntimeError(f"{method} x{procs}: workers did not report in time") from exc
    finally:
        for worker in workers:
            worker.join(30)
            if worker.is_alive():
                worker.kill()
    final = root / "data.bin"
    return {
        "wall_s": max(end for end, _ in outcomes) - t0,
        "bytes_x": server.bytes_served(path) / len(payload),
        "failed": sum(bool(error) for _, error in outcomes),
        "final_ok": final.is_file() and hashlib.sha256(final.read_bytes()).hexdigest() == sha256,
    }


def _measure(server: TestHTTPServer, payload: bytes, method: str, procs: int, workdir: Path) -> dict[str, Any]:
    """Median wall time over :data:`REPEATS` runs (one when that costs 8 downloads); the worst of the rest."""
    repeats = 1 if procs > 1 and method != "ours" else REPEATS
    runs = [_scenario(server, payload, method, procs, workdir, r) for r in range(repeats)]
    return {
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "bytes_x": max(r["bytes_x"] for r in runs),
        "failed": sum(r["failed"] for r in runs),
        "final_ok": all(r["final_ok"] for r in runs),
    }


def run(quick: bool = False) -> dict[str, Any]:
    size, bandwidth = (mb * _MB for mb in SIZES_MB["quick" if quick else "full"])
    # Workers fork from a server that has the peers' modules imported already, so starting 8 of them is quick.
    _CTX.set_forkserver_preload(["torch.hub", "ignite_ext.data", "benchmarks.bench_download"])
    payload = random.Random(0).randbytes(size)
    rows = []
    with TestHTTPServer(throttle_bps=bandwidth) as server, tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        runs = {
            m: (_measure(server, payload, m, 1, workdir), _measure(server, payload, m, PROCS, workdir))
            for m in _METHODS
        }
        plain_single = runs["torchvision-like"][0]["wall_s"]
        for method, (single, many) in runs.items():
            rows.append(
                {
                    "method": _LABELS[method],
                    "bytes_served_x": round(many["bytes_x"], 2),
                    "wall_s": round(many["wall_s"], 2),
                    "single_wall_s": round(single["wall_s"], 2),
                    "wall_vs_single": round(many["wall_s"] / single["wall_s"], 2),
                    "wall_vs_plain_single": round(many["wall_s"] / plain_single, 2),
                    "failed_processes": many["failed"],
                    "final_file_ok": many["final_ok"],
                }
            )
    ours = rows[0]
    summary = (
        f"{PROCS} processes fetch one {size // _MB} MB file over a shared {bandwidth // _MB} MB/s loopback link. "
        + "; ".join(
            f"{r['method']}: {r['bytes_served_x']:.2f}x the file served, wall {r['wall_vs_single']:.2f}x "
            f"one process alone, {r['failed_processes']} failed"
            for r in rows
        )
        + f". Targets for ours: 1.00x bytes (got {ours['bytes_served_x']:.2f}x), wall <= 1.1x single "
        f"(got {ours['wall_vs_single']:.2f}x; {ours['wall_vs_plain_single']:.2f}x a plain urllib download alone)."
    )
    machine = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    return {
        "title": f"{PROCS} concurrent downloads of one file: bytes served and wall time",
        "machine": machine,
        "rows": rows,
        "summary": summary,
        "plot": {"x": "method", "y": ["bytes_served_x", "wall_vs_single"], "kind": "bar"},
    }


if __name__ == "__main__":
    print_result(run(quick="--quick" in sys.argv[1:]))
