"""CachedDataset side by side with LitData and Mosaic streaming: cached throughput, first-epoch cost, node RAM.

The same samples (float32 tensors of 64 KiB or 1 MiB with their index as label, read from one raw file each
plus a 2 ms decode: :class:`benchmarks._cache_peers.SourceDataset`) reach a training loop four ways:

* ``in-memory``: everything loaded into one tensor first (``TensorDataset``): the limit;
* ``CachedDataset``: ``CachedDataset(source)`` with its defaults (``scope="node"`` on two ranks);
* ``LitData``: ``litdata.optimize`` into 64 MB chunks, then ``StreamingDataset`` / ``StreamingDataLoader``;
* ``Mosaic``: Mosaic streaming's ``MDSWriter`` into 64 MiB shards, then ``StreamingDataset`` /
  ``StreamingDataLoader``.

Every variant: 4 workers (fork), persistent, batches of 16, shuffled, no compression (random floats do not
compress), the peers' other settings at their defaults (see :mod:`benchmarks._cache_peers`). One rank, and two
ranks of one node (gloo, torchrun's environment variables). Each variant runs in processes of its own, in the
cache peers' environment (``scripts/cache_peers_env.sh``: LitData and Mosaic from PyPI, the project's CPU torch).

Measures, per sample size and number of ranks:

* **throughput**: the variants' processes stay up side by side and take turns, one epoch each per round, in a
  rotating order; from epoch 1 on (every cache warm, the peers' files written), a variant's samples/s is the
  median over rounds, and ``vs_in_memory`` the median of its rate over in-memory's in the same round;
  ``cpu_vs_in_memory``: the CPU time of all its processes per sample over those rounds, over in-memory's (a
  steadier measure of the cost on a loaded machine);
* **first epoch**: seconds from the source dataset to the end of epoch 0: loading everything (in-memory),
  ``optimize`` or the ``MDSWriter`` pass (the peers, on rank 0, the other rank waiting), plus epoch 0;
* **RAM**: each variant alone, after 4 epochs (the workers fill the cache in the first), workers alive: the PSS
  of all its processes (every rank and worker) plus the page cache of its data files that no process maps
  (:mod:`benchmarks._node_memory`); ``workers_MiB`` is the part of the PSS in the DataLoader workers;
  ``main_private_dirty_MiB`` and ``worker_private_dirty_MiB`` what the largest main process and the largest worker
  hold alone (``Private_Dirty`` of their anonymous memory and heap); ``peak_PSS_MiB``: the peak of the PSS of
  the ranks and their workers together during the cached epochs, sampled every 50 ms (what a user's ``top`` or
  ``smem`` shows), ``peak_ranks_MiB`` the ranks' part of it and ``ranks_PSS_MiB`` the ranks' PSS after the last
  epoch; ``rank_frozen_objects``: what a rank froze (``gc.get_freeze_count()``). The in-memory baseline freezes
  nothing, as a user's plain in-memory dataset does not (the run fails if it did);
* **in-place write**: what writing into a sample read from the dataset does to a later read of it.

Every epoch of every variant is checked to deliver each sample exactly once (count and sum of labels across the
ranks).
"""

from __future__ import annotations

import json
import os
import platform
import select
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._cache_peers import BATCH, WORKERS, write_source
from benchmarks._node_memory import PeakPss, group_memory, private_dirty, pss
from benchmarks._report import print_result

NAME = "cache_peers"
ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("in-memory", "CachedDataset", "LitData", "Mosaic")
#: (sample bytes, samples) for the full run and ``quick=True``: 512 MiB of samples per size in the full run.
SIZES: dict[str, tuple[tuple[int, int], ...]] = {
    "full": ((64 << 10, 8192), (1 << 20, 512)),
    "quick": ((64 << 10, 512), (1 << 20, 32)),
}
#: Epochs of the throughput phase (epoch 0, then the measured rounds).
EPOCHS = {"full": 11, "quick": 3}
RAM_EPOCHS = 4  # the workers fill the cache in the first, the memory is read in the last
RANKS = (1, 2)
_MiB = 1 << 20


def peers_python(create: bool = True) -> tuple[str | None, str]:
    """The cache peers' interpreter, or None and why not (``scripts/cache_peers_env.sh`` creates it once).

    ``create=False`` only looks for it (nothing is downloaded).
    """
    argv = ["bash", str(ROOT / "scripts" / "cache_peers_env.sh"), *([] if create else ["--check"])]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        return None, (done.stderr.strip().splitlines() or ["scripts/cache_peers_env.sh failed"])[-1]
    return done.stdout.strip().splitlines()[-1], ""


class Group:
    """The rank processes of one variant, driven by JSON lines; every answer is awaited with a deadline."""

    def __init__(
        self,
        python: str,
        variant: str,
        source: str,
        n: int,
        numel: int,
        ranks: int,
        tmp: str,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.variant, self.ranks = variant, ranks
        self.workdir = tempfile.mkdtemp(prefix=variant.lower().replace("-", "_") + "_", dir=tmp)
        port = _free_port()
        self.procs: list[subprocess.Popen[str]] = []
        self.replies: list[Any] = []
        self.logs: list[str] = []
        for rank in range(ranks):
            read_fd, write_fd = os.pipe()
            env = {
                "PATH": "/usr/bin:/bin",
                "HOME": os.environ.get("HOME", "/root"),
                "PYTHONPATH": str(ROOT),
                "OMP_NUM_THREADS": "1",
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(ranks),
                "LOCAL_WORLD_SIZE": str(ranks),
                "GROUP_RANK": "0",
                "NODE_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                # Mosaic's lock files go to the temporary directory under fixed names: this run's, removed with it.
                "TMPDIR": self.workdir,
                **(extra_env or {}),
            }
            log = os.path.join(self.workdir, f"rank{rank}.log")
            with open(log, "w") as out:
                argv = [python, "-m", "benchmarks._cache_peers", variant, source, str(n), str(numel)]
                proc = subprocess.Popen(
                    [*argv, self.workdir, str(write_fd)],
                    stdin=subprocess.PIPE,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env=env,
                    cwd=str(ROOT),
                    pass_fds=(write_fd,),
                )
            os.close(write_fd)
            self.procs.append(proc)
            self.replies.append(os.fdopen(read_fd))
            self.logs.append(log)

    def ask(
        self, command: str, timeout: float = 600.0, during: Callable[[], None] | None = None
    ) -> list[dict[str, Any]]:
        """Send ``command`` to every rank; their answers, in rank order. ``during`` is called every 50 ms meanwhile."""
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({"cmd": command}) + "\n")
            proc.stdin.flush()
        deadline = time.monotonic() + timeout
        answers = []
        if during is not None:
            during()  # at least once, however short the work
        for proc, reply, log in zip(self.procs, self.replies, self.logs, strict=True):
            while True:
                left = max(0.0, deadline - time.monotonic())
                ready, _, _ = select.select([reply], [], [], left if during is None else min(left, 0.05))
                if ready or during is None or left == 0.0:
                    break
                during()
            line = reply.readline() if ready else ""
            if not line:
                tail = Path(log).read_text()[-3000:]
                self.close()
                raise RuntimeError(f"{self.variant}: no answer to {command!r} (exit {proc.poll()}): {tail}")
            answers.append(json.loads(line))
        return answers

    def epoch(self, n: int, during: Callable[[], None] | None = None) -> float:
        """Seconds of one epoch over all ranks, checked to have delivered every sample once."""
        answers = self.ask("epoch", during=during)
        count = sum(a["count"] for a in answers)
        labels = sum(a["label_sum"] for a in answers)
        if (count, labels) != (n, n * (n - 1) // 2):
            raise RuntimeError(f"{self.variant}: an epoch delivered {count} samples, label sum {labels}, not all {n}")
        return float(max(a["s"] for a in answers))

    def memory(self) -> dict[str, int]:
        """RAM of every rank and worker and of the variant's files (:func:`~benchmarks._node_memory.group_memory`)."""
        answers = self.ask("pids")
        pids = [p for a in answers for p in a["pids"]]
        workers = [p for a in answers for p in a["pids"][1:]]
        files = sorted({f for a in answers for f in a["files"]})
        mains = [a["pids"][0] for a in answers]
        return {
            **group_memory(pids, files),
            "ranks": sum(pss(p) for p in mains),
            "workers": sum(pss(p) for p in workers),
            "frozen": max(a["frozen"] for a in answers),
            # What each process alone holds: the largest of the ranks' main processes and of their workers.
            "main_private": max(private_dirty(p) for p in mains),
            "worker_private": max((private_dirty(p) for p in workers), default=0),
        }

    def cpu_seconds(self) -> float:
        """CPU time used so far by every rank and its DataLoader workers (user and system)."""
        return sum(_cpu_seconds(p) for a in self.ask("pids") for p in a["pids"])

    def close(self) -> None:
        """Ask every rank to quit (killed after a minute), then remove the variant's files."""
        for proc in self.procs:
            if proc.poll() is None and proc.stdin is not None:
                try:
                    proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                    proc.stdin.close()
                except BrokenPipeError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for reply in self.replies:
            reply.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _cpu_seconds(pid: int) -> float:
    # The process's CPU clock (Linux's MAKE_PROCESS_CPUCLOCK) counts nanoseconds; /proc/<pid>/stat counts clock
    # ticks of 10 ms, too coarse for a short run, whose in-memory epochs can cost less than one tick.
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _throughput(python: str, source: str, n: int, numel: int, ranks: int, epochs: int, tmp: str) -> dict[str, Any]:
    """Interleaved epochs of all variants at once, from epoch 1 on: samples/s per round, CPU seconds per sample.

    ``rates``: each variant's samples/s in each round; ``cpu_per_sample``: the CPU time its processes (every
    rank and worker) used over those rounds, per sample.
    """
    groups = {v: Group(python, v, source, n, numel, ranks, tmp) for v in VARIANTS}
    try:
        for group in groups.values():  # one at a time: a setup never competes with another for the CPUs
            group.ask("setup")
            group.epoch(n)
        rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
        cpu = {v: -groups[v].cpu_seconds() for v in VARIANTS}
        for r in range(1, epochs):
            order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
            for v in order:
                rates[v].append(n / groups[v].epoch(n))
        for v in VARIANTS:
            cpu[v] += groups[v].cpu_seconds()
    finally:
        for group in groups.values():
            group.close()
    return {"rates": rates, "cpu_per_sample": {v: cpu[v] / (n * (epochs - 1)) for v in VARIANTS}}


def _alone(python: str, variant: str, source: str, n: int, numel: int, ranks: int, tmp: str) -> dict[str, Any]:
    """One variant by itself: its first-epoch cost, its RAM after :data:`RAM_EPOCHS`, what an in-place write does."""
    group = Group(python, variant, source, n, numel, ranks, tmp)
    try:
        setup = group.ask("setup")
        peak = PeakPss(proc.pid for proc in group.procs)  # sampled in the cached epochs before the RAM is read
        first = max(a["s"] for a in setup) + group.epoch(n, during=peak if RAM_EPOCHS == 1 else None)
        for _ in range(RAM_EPOCHS - 1):
            group.epoch(n, during=peak)  # every cached epoch, sampled
        memory = group.memory()
        if variant == "in-memory" and memory["frozen"]:
            # The baseline is a user's plain in-memory dataset: nothing of the package may freeze its heap.
            raise RuntimeError(f"the in-memory baseline froze {memory['frozen']} objects: it must freeze none")
        inplace = group.ask("inplace")[0]["outcome"] if ranks == 1 else ""
        owner = next((a["ignite_ext"] for a in setup if a.get("ignite_ext")), None)
        if owner is not None and not owner.startswith(str(ROOT)):
            raise RuntimeError(f"ignite_ext came from {owner}, not from the working tree {ROOT}")
    finally:
        group.close()
    return {"first_s": first, "memory": memory, "inplace": inplace, "peak": peak}


def _paired(rates: dict[str, list[float]], variant: str, peer: str) -> float:
    return statistics.median(a / b for a, b in zip(rates[variant], rates[peer], strict=True))


def _rows(
    sample_bytes: int, n: int, ranks: int, measured: dict[str, Any], alone: dict[str, Any]
) -> list[dict[str, Any]]:
    label = f"{sample_bytes >> 10} KiB" if sample_bytes < _MiB else f"{sample_bytes // _MiB} MiB"
    base = alone["in-memory"]
    rates, cpu = measured["rates"], measured["cpu_per_sample"]
    rows = []
    for v in VARIANTS:
        mine = alone[v]
        rows.append(
            {
                "label": f"{label} x{ranks} {v}",
                "sample": label,
                "ranks": ranks,
                "variant": v,
                "samples_per_s": round(statistics.median(rates[v]), 1),
                "vs_in_memory": round(_paired(rates, v, "in-memory"), 3),
                "vs_LitData": round(_paired(rates, v, "LitData"), 3),
                "cpu_us_per_sample": round(cpu[v] * 1e6, 1),
                "cpu_vs_in_memory": round(cpu[v] / cpu["in-memory"], 3),
                "first_epoch_s": round(mine["first_s"], 2),
                "first_epoch_vs_in_memory": round(mine["first_s"] / base["first_s"], 2),
                "RAM_MiB": round(mine["memory"]["total"] / _MiB),
                "RAM_vs_in_memory": round(mine["memory"]["total"] / base["memory"]["total"], 3),
                "PSS_MiB": round(mine["memory"]["pss"] / _MiB),
                "page_cache_MiB": round(mine["memory"]["page_cache"] / _MiB),
                "workers_MiB": round(mine["memory"]["workers"] / _MiB),
                # During a cached epoch, as a user's top sees it: the peak of the PSS of every rank and worker.
                "peak_PSS_MiB": round(mine["peak"].peak / _MiB),
                "peak_PSS_vs_in_memory": round(mine["peak"].peak / max(base["peak"].peak, 1), 3),
                "peak_workers_MiB": round(mine["peak"].children / _MiB),
                # The rank processes apart from their workers, at that peak: what a collection in a rank unshares.
                "peak_ranks_MiB": round(mine["peak"].main / _MiB),
                "peak_ranks_vs_in_memory": round(mine["peak"].main / max(base["peak"].main, 1), 3),
                "ranks_PSS_MiB": round(mine["memory"]["ranks"] / _MiB),
                "rank_frozen_objects": mine["memory"]["frozen"],
                "main_private_dirty_MiB": round(mine["memory"]["main_private"] / _MiB, 1),
                "worker_private_dirty_MiB": round(mine["memory"]["worker_private"] / _MiB, 1),
                # What the processes hold beyond one copy of the samples (one rank: every variant holds one).
                "beyond_data_MiB": round((mine["memory"]["total"] - n * sample_bytes) / _MiB) if ranks == 1 else "",
                "in_place_write": mine["inplace"],
            }
        )
    return rows


def _summary(rows: list[dict[str, Any]]) -> str:
    parts = []
    for (sample, ranks), group in _by_case(rows).items():
        ours, lit, mosaic = group["CachedDataset"], group["LitData"], group["Mosaic"]
        parts.append(
            f"{sample}, {ranks} rank{'s' if ranks > 1 else ''}: cached epochs vs in-memory CachedDataset "
            f"{ours['vs_in_memory']:.2f}, LitData {lit['vs_in_memory']:.2f}, Mosaic {mosaic['vs_in_memory']:.2f} "
            f"(CachedDataset {ours['vs_LitData']:.2f}x LitData); CPU per sample vs in-memory "
            f"{ours['cpu_vs_in_memory']:.2f} / {lit['cpu_vs_in_memory']:.2f} / {mosaic['cpu_vs_in_memory']:.2f}; "
            f"first epoch vs in-memory "
            f"{ours['first_epoch_vs_in_memory']:.2f} / {lit['first_epoch_vs_in_memory']:.2f} / "
            f"{mosaic['first_epoch_vs_in_memory']:.2f}; RAM vs in-memory ({group['in-memory']['RAM_MiB']} MiB) "
            f"{ours['RAM_vs_in_memory']:.2f} / {lit['RAM_vs_in_memory']:.2f} / {mosaic['RAM_vs_in_memory']:.2f}; "
            f"peak PSS of the ranks and their workers during the cached epochs vs in-memory "
            f"({group['in-memory']['peak_PSS_MiB']} MiB) {ours['peak_PSS_vs_in_memory']:.2f} / "
            f"{lit['peak_PSS_vs_in_memory']:.2f} / {mosaic['peak_PSS_vs_in_memory']:.2f}, the ranks alone "
            f"{ours['peak_ranks_MiB']} / {lit['peak_ranks_MiB']} / {mosaic['peak_ranks_MiB']} MiB "
            f"(in-memory {group['in-memory']['peak_ranks_MiB']} MiB)"
        )
    cases = _by_case(rows)
    ahead = all(g["CachedDataset"]["vs_LitData"] > 1.0 for g in cases.values())
    peak = all(g["CachedDataset"]["peak_PSS_vs_in_memory"] <= 1.05 for g in cases.values())
    rate = all(g["CachedDataset"]["vs_in_memory"] >= 0.95 for (sample, _), g in cases.items() if sample == "64 KiB")
    one_rank = [(sample, g) for (sample, ranks), g in cases.items() if ranks == 1]
    ram = all(g["CachedDataset"]["RAM_vs_in_memory"] <= 1.05 for _, g in one_rank)
    beyond = "; ".join(
        f"{sample}: CachedDataset {g['CachedDataset']['beyond_data_MiB']} MiB (workers "
        f"{g['CachedDataset']['workers_MiB']}), in-memory {g['in-memory']['beyond_data_MiB']} MiB (workers "
        f"{g['in-memory']['workers_MiB']}), LitData {g['LitData']['beyond_data_MiB']} MiB"
        for sample, g in one_rank
    )
    verdict = (
        f"Goals, on one rank and on two: peak PSS during the cached epochs <= 1.05x in-memory "
        f"{'met' if peak else 'NOT met'}; ahead of LitData {'met' if ahead else 'NOT met'}; cached epochs >= "
        f"0.95x in-memory's rate at 64 KiB {'met' if rate else 'NOT met'}; RAM <= 1.05x in-memory on one rank "
        f"{'met' if ram else 'NOT met'}. Beyond the data, on one rank: {beyond}"
    )
    return ". ".join([*parts, verdict]) + "."


def _by_case(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, dict[str, Any]]]:
    out: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for row in rows:
        out.setdefault((row["sample"], row["ranks"]), {})[row["variant"]] = row
    return out


def run(quick: bool = False, python: str | None = None) -> dict[str, Any]:
    """Both sample sizes on one and two ranks; ``quick`` uses 32 MiB per size and 3 epochs.

    ``python``: the cache peers' interpreter; by default the one ``scripts/cache_peers_env.sh`` makes (once).
    """
    why_not = ""
    if python is None:
        python, why_not = peers_python()
    if python is None:
        raise RuntimeError(f"the cache peers' environment cannot be made: {why_not}")
    kind = "quick" if quick else "full"
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_cache_peers_") as tmp:
        for sample_bytes, n in SIZES[kind]:
            source = os.path.join(tmp, f"source_{sample_bytes}")
            write_source(source, n, sample_bytes // 4)
            for ranks in RANKS:
                rates = _throughput(python, source, n, sample_bytes // 4, ranks, EPOCHS[kind], tmp)
                alone = {v: _alone(python, v, source, n, sample_bytes // 4, ranks, tmp) for v in VARIANTS}
                rows += _rows(sample_bytes, n, ranks, rates, alone)
            shutil.rmtree(source)
    versions = subprocess.run(
        [
            python,
            "-c",
            "import importlib.metadata as m, torch, platform; print(', '.join(["
            "f'litdata {m.version(\"litdata\")}', f'mosaicml-streaming {m.version(\"mosaicml-streaming\")}', "
            "f'torch {torch.__version__}', f'Python {platform.python_version()}']))",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.strip()
    return {
        "title": "CachedDataset vs LitData and Mosaic streaming: cached epochs, first epoch, node RAM",
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, {versions}, "
        f"{WORKERS} workers, batch {BATCH}",
        "rows": rows,
        "summary": _summary(rows),
        "plot": {"x": "label", "y": ["vs_in_memory", "cpu_vs_in_memory", "RAM_vs_in_memory"], "kind": "bar"},
    }


if __name__ == "__main__":
    print_result(run(quick="--quick" in sys.argv[1:]))
