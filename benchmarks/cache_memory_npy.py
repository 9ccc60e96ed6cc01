"""The memory of a cached epoch as a user's ``top`` sees it, in the setup of a reported 1.34x: ``.npy`` files.

8,192 float32 samples of 64 KiB (512 MiB), each in a ``.npy`` file read with ``numpy.load``; one rank, 4 fork
workers (persistent), batches of 16, shuffled; three epochs. The PSS of the main process and of each worker is
read from ``/proc/PID/smaps`` at 1/4, 1/2 and 3/4 of the third epoch (cached), and the peak is reported with each
process's largest mappings. Three variants, each in a process of its own:

* ``in-memory``: one tensor filled in place from the files (no per-sample object left on the heap);
* ``in-memory-stacked``: ``torch.stack`` over a list of the loaded samples (the heap those leave behind is touched,
  and so copied, by every forked worker);
* ``CachedDataset``: ``CachedDataset(source)`` with its defaults.

Run: ``python -m benchmarks.cache_memory_npy [--samples N]`` (any interpreter with torch and numpy: the numbers in
``docs/benchmarks.rst`` come from torch 2.14.1's CUDA build on the CPU). Writes
``benchmarks/results/cache_memory_npy.json``. Not part of ``run_all``: it answers one question, and the cache
peers benchmark measures the same peak in its own setup on every run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("in-memory", "in-memory-stacked", "CachedDataset")
_MiB = 1 << 20


def _mappings(pid: int) -> dict[str, int]:
    """Bytes of PSS per mapping name (anonymous mappings as ``[anon]``)."""
    from benchmarks._node_memory import smaps

    found: dict[str, int] = {}
    for name, field, size in smaps(pid):
        if field == "Pss":
            key = Path(name).name if name.startswith("/") else name
            found[key] = found.get(key, 0) + size
    return found


def _variant(kind: str, root: str, n: int) -> dict[str, Any]:
    """One variant, in this process: the peak PSS of the cached epoch, per process."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader, Dataset, TensorDataset

    from benchmarks._node_memory import descendants, pss

    class Npy(Dataset[tuple[torch.Tensor, int]]):
        def __init__(self) -> None:
            self.paths = [f"{root}/{i}.npy" for i in range(n)]

        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            return torch.from_numpy(np.load(self.paths[i])), i

    source = Npy()
    dataset: Dataset[Any]
    if kind == "in-memory":
        data = torch.empty(n, *source[0][0].shape)
        for i in range(n):
            data[i] = source[i][0]
        dataset = TensorDataset(data, torch.arange(n))
    elif kind == "in-memory-stacked":
        dataset = TensorDataset(torch.stack([source[i][0] for i in range(n)]), torch.arange(n))
    else:
        from ignite_ext.data import CachedDataset

        dataset = CachedDataset(source)
    loader = DataLoader(
        dataset, batch_size=16, shuffle=True, num_workers=4, persistent_workers=True, multiprocessing_context="fork"
    )
    batches, me = len(loader), os.getpid()
    peak: dict[str, Any] = {"total": 0}
    for epoch in range(3):
        for b, _ in enumerate(loader):
            if epoch == 2 and b in (batches // 4, batches // 2, 3 * batches // 4):
                pids = [me, *descendants(me)]
                each = [pss(p) for p in pids]
                if sum(each) > peak["total"]:
                    top = [sorted(_mappings(p).items(), key=lambda kv: -kv[1])[:4] for p in pids]
                    peak = {"total": sum(each), "processes": each, "largest_mappings": top}
    return {
        "variant": kind,
        "peak_PSS_MiB": round(peak["total"] / _MiB),
        "main_MiB": round(peak["processes"][0] / _MiB),
        "workers_MiB": [round(p / _MiB) for p in peak["processes"][1:]],
        "largest_mappings_MiB": [[(name, round(b / _MiB)) for name, b in top] for top in peak["largest_mappings"]],
    }


def _write(root: str, n: int) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    for i in range(n):
        np.save(f"{root}/{i}.npy", rng.random(16384, dtype=np.float32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one variant, in a child
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(_variant(args.variant, args.root, args.samples)), flush=True)
        return
    with tempfile.TemporaryDirectory() as root:
        _write(root, args.samples)
        rows = []
        for kind in VARIANTS:
            argv = [sys.executable, "-m", "benchmarks.cache_memory_npy", "--variant", kind, "--root", root]
            argv += ["--samples", str(args.samples)]
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
            done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    import torch

    base = rows[0]["peak_PSS_MiB"]
    for row in rows:
        row["peak_PSS_vs_in_memory"] = round(row["peak_PSS_MiB"] / base, 2)
    result = {"torch": torch.__version__, "samples": args.samples, "sample_KiB": 64, "rows": rows}
    out = ROOT / "benchmarks" / "results" / "cache_memory_npy.json"
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
