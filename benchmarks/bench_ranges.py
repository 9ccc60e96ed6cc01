"""One process fetches one file from a loopback server that limits every connection: parallel ranges vs one stream.

Methods: ``ignite_ext xK`` is ``download_url(..., connections=K)``; ``torch.hub`` is
``torch.hub.download_url_to_file``; ``torchvision`` is ``torchvision.datasets.utils.download_url``; ``pooch`` is
``pooch.retrieve``.

Servers and CDNs often cap each flow (per-connection rate limits, TCP windows over long links), so one stream
cannot use the bandwidth there is. The server here paces every connection to :data:`CONN_MBPS` on its own. In one
run and against the same server: ``ignite_ext.data.download_url`` with 1, 4 and 8 connections, and the peers'
single-stream downloaders: ``torch.hub.download_url_to_file``, ``torchvision.datasets.utils.download_url`` and
``pooch.retrieve`` (torchvision and pooch from their own environment, ``scripts/peers_env.sh``; left out, and said
so, when it cannot be made). Every download is verified by SHA-256 (MD5 for torchvision). Wall times are the median
of :data:`REPEATS` runs, each into a fresh directory, measured inside the downloading process after its imports;
speed-ups are ratios to ours with one connection in the same run.
"""

from __future__ import annotations

import hashlib
import json
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from benchmarks._report import print_result
from benchmarks.http_server import TestHTTPServer

NAME = "ranges"
REPEATS = 3
CONN_MBPS = 8
#: File size in MB for the full run and ``quick=True``.
SIZES_MB = {"full": 96, "quick": 32}
_MB = 1_000_000
ROOT = Path(__file__).resolve().parents[1]

_PEER = textwrap.dedent(
    """
    import json, sys, time
    kind, url, root, sha256, md5 = sys.argv[1:6]
    if kind == "torch.hub":
        import torch.hub
        start = time.perf_counter()
        torch.hub.download_url_to_file(url, root + "/f.bin", hash_prefix=sha256[:12], progress=False)
    elif kind == "torchvision":
        from torchvision.datasets.utils import download_url
        start = time.perf_counter()
        download_url(url, root, "f.bin", md5)
    elif kind == "pooch":
        import pooch
        start = time.perf_counter()
        pooch.retrieve(url, known_hash="sha256:" + sha256, fname="f.bin", path=root, progressbar=False)
    else:
        from ignite_ext.data import download_url
        start = time.perf_counter()
        download_url(url, root, "f.bin", sha256=sha256, connections=int(kind), progress=False)
    print(json.dumps({"s": time.perf_counter() - start}))
    """
)


def _peers_python() -> tuple[str | None, str]:
    """The peers' interpreter (torchvision, pooch), or None and why not."""
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "peers_env.sh")], capture_output=True, text=True, timeout=1800
    )
    if done.returncode != 0:
        return None, (done.stderr.strip().splitlines() or ["scripts/peers_env.sh failed"])[-1]
    return done.stdout.strip().splitlines()[-1], ""


def _fetch(python: str, kind: str, url: str, sha256: str, md5: str) -> float:
    with tempfile.TemporaryDirectory() as root:
        env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
        done = subprocess.run(
            [python, "-c", _PEER, kind, url, root, sha256, md5], capture_output=True, text=True, env=env, timeout=600
        )
        if done.returncode != 0:
            raise RuntimeError(f"{kind} failed: {done.stderr[-2000:]}")
        data = Path(root, "f.bin").read_bytes()
        assert hashlib.sha256(data).hexdigest() == sha256, f"{kind} published wrong bytes"
        return float(json.loads(done.stdout.strip().splitlines()[-1])["s"])


def run(quick: bool = False) -> dict[str, Any]:
    size = SIZES_MB["quick" if quick else "full"] * _MB
    data = random.Random(0).randbytes(size)
    sha256, md5 = hashlib.sha256(data).hexdigest(), hashlib.md5(data).hexdigest()
    peers_python, why_not = _peers_python()
    methods: list[tuple[str, str, str]] = [
        ("ignite_ext x1", sys.executable, "1"),
        ("ignite_ext x4", sys.executable, "4"),
        ("ignite_ext x8", sys.executable, "8"),
        ("torch.hub", sys.executable, "torch.hub"),
    ]
    if peers_python is not None:
        methods += [
            ("torchvision", peers_python, "torchvision"),
            ("pooch", peers_python, "pooch"),
        ]
    times: dict[str, list[float]] = {label: [] for label, _, _ in methods}
    with TestHTTPServer(conn_bps=CONN_MBPS * _MB) as server:
        url = server.add("/f.bin", data)
        for _ in range(REPEATS):  # methods take turns, so that a noisy moment does not hit one method only
            for label, python, kind in methods:
                times[label].append(_fetch(python, kind, url, sha256, md5))
    base = statistics.median(times[methods[0][0]])
    rows = [
        {
            "method": label,
            "wall_s (median)": round(statistics.median(times[label]), 2),
            "speed-up vs 1 connection": round(base / statistics.median(times[label]), 2),
            "MB/s": round(size / _MB / statistics.median(times[label]), 1),
        }
        for label, _, _ in methods
    ]
    by = {r["method"]: r["speed-up vs 1 connection"] for r in rows}
    four, eight = by["ignite_ext x4"], by["ignite_ext x8"]
    peers = "; ".join(f"{r['method']} {r['speed-up vs 1 connection']}x" for r in rows[3:])
    summary = (
        f"One {size // _MB} MB file from a loopback server pacing each connection to {CONN_MBPS} MB/s. "
        f"Speed-up over one connection: 4 connections {four}x (goal >= 3.5x), 8 connections {eight}x; "
        f"single-stream peers: {peers}." + ("" if peers_python else f" torchvision and pooch left out: {why_not}.")
    )
    return {
        "name": NAME,
        "title": "Parallel ranges: one process, one file, a per-connection limited server",
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "rows": rows,
        "summary": summary,
        "plot": {"x": "method", "y": ["speed-up vs 1 connection"], "kind": "bar"},
    }


if __name__ == "__main__":
    print_result(run(quick="--quick" in sys.argv[1:]))
