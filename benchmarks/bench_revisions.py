"""The cache's hit path at two revisions of the package, side by side: what a redesign cost, if anything.

The revision under test is this working tree; the baseline, :data:`BASELINE` (the cache before its redesign of
0.5.0: tiers behind one protocol, the arena in rooms), is taken from the repository's history (``git archive``).
Each revision runs in processes of its own with its ``ignite_ext`` on the path, the two taking turns, the order
alternating by round. Each process measures:

* a hit in one process, the mean over every sample of a warm cache read 20 times (``ds[i]``: lookup, decode, count),
  for 1,024 samples of 64 KiB and 64 samples of 1 MiB;
* a cached epoch through a DataLoader (4 fork workers, persistent, batches of 16, shuffled, 4,096 samples of 64 KiB)
  against the same samples in memory (whose workers freeze their inherited heap, as the cache's do), taking turns
  epoch by epoch: the median over 4 epochs of the in-memory time
  over the cached one (``epoch_vs_memory``) and of the CPU time of the main process and the workers, cached over
  in-memory (``cpu_vs_memory``: the steadier measure on a loaded machine).

Reported: each measure's median over the rounds per revision, and the tree's over the baseline's.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

NAME = "revisions"
ROOT = Path(__file__).resolve().parents[1]
#: The revision compared with: the last commit before the cache's redesign (tiers, the arena in rooms).
BASELINE = "42fc6f7"
ROUNDS = {"full": 15, "quick": 2}
MEASURES = ("hit_us_64k", "hit_us_1m", "epoch_vs_memory", "cpu_vs_memory")

_PROBE = r"""
import gc, json, os, sys, time
import torch
from torch.utils.data import DataLoader
from ignite_ext.data import CachedDataset

out = {}
for size, n, key in ((64 << 10, 1024, "hit_us_64k"), (1 << 20, 64, "hit_us_1m")):
    ds = CachedDataset([torch.full((size // 4,), float(i)) for i in range(n)], capacity_bytes=2 * size * n)
    for i in range(n):
        ds[i]
    start = time.perf_counter()
    for _ in range(20):
        for i in range(n):
            ds[i]
    out[key] = (time.perf_counter() - start) / (20 * n) * 1e6
    ds.close()

data = [torch.full((16 << 10,), float(i)) for i in range(4096)]
cached = CachedDataset(data, capacity_bytes=2 * (64 << 10) * len(data))
# The in-memory workers freeze the heap they inherit, as the cache's do: else whether a full collection copies it
# within the epochs measured depends on where the collector's counts stood at the fork.
loaders = {
    name: DataLoader(ds, batch_size=16, shuffle=True, num_workers=4, persistent_workers=True, worker_init_fn=init)
    for name, ds, init in (("cached", cached, None), ("memory", data, lambda _: gc.freeze()))
}


def cpu(loader):
    total = sum(os.times()[:2])
    for worker in loader._iterator._workers:
        with open(f"/proc/{worker.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


for loader in loaders.values():  # epoch 0: the cache filled, the workers started
    for _ in loader:
        pass
rates, cpus = [], []
for _ in range(4):
    took = {}
    for name, loader in loaders.items():
        c, t = cpu(loader), time.perf_counter()
        for _ in loader:
            pass
        took[name] = (time.perf_counter() - t, cpu(loader) - c)
    rates.append(took["memory"][0] / took["cached"][0])
    cpus.append(took["cached"][1] / took["memory"][1])
out["epoch_vs_memory"] = sorted(rates)[len(rates) // 2]
out["cpu_vs_memory"] = sorted(cpus)[len(cpus) // 2]
cached.close()
print(json.dumps(out))
"""


def _baseline(directory: str) -> str:
    """The baseline's ``ignite_ext`` extracted into ``directory``; the directory to put on the path."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", BASELINE, "ignite_ext"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", directory], input=archive, check=True)
    return directory


def _probe(path: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=600, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def run(quick: bool = False) -> dict[str, Any]:
    """:data:`ROUNDS` rounds of both revisions, alternating which goes first."""
    seen: dict[str, list[dict[str, float]]] = {"tree": [], "baseline": []}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"tree": str(ROOT), "baseline": _baseline(tmp)}
        for r in range(ROUNDS["quick" if quick else "full"]):
            for revision in ("tree", "baseline") if r % 2 == 0 else ("baseline", "tree"):
                seen[revision].append(_probe(paths[revision]))
    medians = {rev: {m: statistics.median(p[m] for p in probes) for m in MEASURES} for rev, probes in seen.items()}
    rows = [{"revision": rev, **{m: round(v, 3) for m, v in values.items()}} for rev, values in medians.items()]
    over = {m: medians["tree"][m] / medians["baseline"][m] for m in MEASURES}
    rows.append({"revision": "tree / baseline", **{m: round(v, 3) for m, v in over.items()}})
    rounds = len(seen["tree"])
    summary = (
        f"This tree against {BASELINE} (the cache before its redesign), {rounds} alternating rounds, medians: a hit "
        f"{medians['tree']['hit_us_64k']:.2f} us against {medians['baseline']['hit_us_64k']:.2f} at 64 KiB, "
        f"{medians['tree']['hit_us_1m']:.2f} against {medians['baseline']['hit_us_1m']:.2f} at 1 MiB; a cached epoch "
        f"{medians['tree']['epoch_vs_memory']:.3f} of the in-memory rate against "
        f"{medians['baseline']['epoch_vs_memory']:.3f}, for {medians['tree']['cpu_vs_memory']:.3f} of its CPU "
        f"against {medians['baseline']['cpu_vs_memory']:.3f}."
    )
    machine = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    return {
        "title": "The cache's hit path, this tree against the cache before its redesign",
        "machine": machine,
        "rows": rows,
        "summary": summary,
    }


if __name__ == "__main__":
    from benchmarks._report import print_result

    print_result(run(quick="--quick" in sys.argv[1:]))
