"""The end-to-end demo behind ``python -m ignite_ext demo`` (the README's first command).

Offline by default: it makes a small image-classification archive, serves it on 127.0.0.1, and launches the
ranks as simulated nodes with ``idist.Parallel`` (one launcher process per node, each with its own node-local
data directory). The ranks fetch the archive once for the whole job (``download_for_job``: one rank per node
directory makes its copy, the server sending it once and the copies relayed node to node), train a
small CNN with ignite's ``Engine`` on ``ShardedDistributedSampler`` + ``CachedDataset`` (decoded images cached, a
random flip applied after the cache), print per-rank summaries one at a time (``Ordered``: samples read by the rank,
how many from the cache and how many from storage), and the demo ends with a table of bytes fetched, cache hit
rates and epoch times. Download progress bars appear only on a terminal.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ignite_ext demo",
        description="The end-to-end demo: a generated dataset served on 127.0.0.1, fetched once per node directory, "
        "trained on gloo ranks of simulated nodes with a sharded sampler and a shared cache (offline).",
    )
    p.add_argument("--nnodes", type=int, default=2, help="simulated nodes (default 2)")
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks per node (default 2)")
    p.add_argument("--epochs", type=int, default=3, help="training epochs (default 3)")
    p.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank (default 1)")
    p.add_argument("--samples", type=int, default=2400, help="training samples of the generated set")
    p.add_argument("--url", help="a dataset archive in the demo's layout (shapes/{train,val}/<class>/*.pt)")
    p.add_argument("--sha256", help="expected SHA-256 of --url")
    p.add_argument("--root", help="where the node directories go (default: a temporary directory)")
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    p.add_argument("--no-progress", action="store_true", help="no download progress bar")
    p.add_argument("--node-rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--master-port", type=int, help=argparse.SUPPRESS)
    return p


def _run_node(args: argparse.Namespace) -> int:
    import ignite_ext.distributed as idist
    from ignite_ext.demo._train import DemoConfig, training

    raw = json.loads(Path(args.config).read_text())
    cfg = DemoConfig(**{**raw, "node_roots": tuple(raw["node_roots"])})
    logging.getLogger("ignite.distributed.launcher.Parallel").setLevel(logging.WARNING)
    with idist.Parallel(
        backend="gloo",
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr="127.0.0.1",
        master_port=args.master_port,
    ) as parallel:
        parallel.run(training, cfg)
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(args: argparse.Namespace, config: Path) -> None:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    common = ["--nnodes", str(args.nnodes), "--nproc-per-node", str(args.nproc_per_node)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ignite_ext",
                "demo",
                *common,
                "--node-rank",
                str(node),
                "--config",
                str(config),
                "--master-port",
                str(port),
            ],
            env=env,
            start_new_session=True,  # one process group per node launcher, so a timeout can kill everything
        )
        for node in range(args.nnodes)
    ]
    deadline = time.monotonic() + args.timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"the demo did not finish within {args.timeout:.0f} s") from exc
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    failed = [n for n, p in enumerate(procs) if p.returncode]
    if failed:
        raise RuntimeError(f"node launcher(s) {failed} failed (exit codes {[procs[n].returncode for n in failed]})")


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def _report(args: argparse.Namespace, result: dict[str, Any], archive_bytes: int, served: int | None) -> None:
    world = result["world_size"]
    print(f"\n== ignite_ext demo: {world} ranks on {result['nnodes']} nodes, {len(result['history'])} epochs ==")
    if served is not None:
        print(
            f"download : archive {_mb(archive_bytes)}, server sent {_mb(served)}: {served / archive_bytes:.2f} "
            f"archive for {result['nnodes']} nodes (download_for_job: one fetch per job, the node directories' "
            "copies relayed node to node)"
        )
        print(
            f"           per-rank downloads would send {_mb(world * archive_bytes)} ({world} archives), one per "
            f"node {_mb(result['nnodes'] * archive_bytes)}"
        )
    print("epoch | seconds | cache hit rate | storage reads | loss")
    for h in result["history"]:
        print(
            f"{h['epoch']:5d} | {h['seconds']:7.2f} | {h['hit_rate']:14.0%} | {int(h['storage_reads']):13d} | "
            f"{h['loss']:.3f}"
        )
    print(f"training samples: {result['train_samples']} (each read from storage once, by the node whose shard has it)")
    print(f"validation accuracy: {result['accuracy']:.3f}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo (see the module docstring); ``argv`` are its options, ``--help`` lists them.

    Returns:
        The exit status: 0 when every rank finished.

    .. versionadded:: 0.1.0
    """
    args = _parser().parse_args(argv)
    if args.node_rank is not None:
        return _run_node(args)
    from ignite_ext.demo._train import DemoConfig
    from ignite_ext.demo.data import CountingServer, make_archive, sha256_of

    with tempfile.TemporaryDirectory(prefix="ignite_ext_demo_") as tmp:
        root = Path(args.root) if args.root else Path(tmp)
        served_dir = Path(tmp) / "served"
        node_roots = tuple(str(root / f"node{k}" / "data") for k in range(args.nnodes))
        out = Path(tmp) / "result.json"
        if args.url:
            url, sha256, archive_bytes, server = args.url, args.sha256, 0, None
        else:
            print(f"[demo] generating the dataset ({args.samples} training images) ...", flush=True)
            archive = make_archive(served_dir, train=args.samples, val=max(args.samples // 4, 10))
            archive_bytes, sha256 = archive.stat().st_size, sha256_of(archive)
            server = CountingServer(served_dir).__enter__()
            url = f"{server.url}/{archive.name}"
        cfg = DemoConfig(
            url, sha256, node_roots, str(out), args.epochs, workers=args.workers, progress=not args.no_progress
        )
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps({**asdict(cfg), "node_roots": list(node_roots)}))
        print(f"[demo] {args.nnodes} nodes x {args.nproc_per_node} ranks, data from {url}", flush=True)
        print(
            f"[demo] starting {args.nnodes} node launchers (idist.Parallel): each spawns its ranks, which import "
            "torch and form the process group (several seconds)",
            flush=True,
        )
        try:
            _launch(args, config)
        finally:
            if server is not None:
                server.__exit__()
        _report(args, json.loads(out.read_text()), archive_bytes, None if server is None else server.bytes_served)
    return 0
