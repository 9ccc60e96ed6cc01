"""A cache in a process alone never imports ignite; one in a distributed context asks ignite.distributed.

Importing ignite.distributed costs ~60 MB and ~85 000 objects, and the DataLoader workers forked from a process
that imported it pay part of that again (copy-on-read); a process alone has no use for it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._world import free_port

ROOT = Path(__file__).resolve().parents[2]

_LOADED = "sorted(m for m in sys.modules if m.split('.')[0] == 'ignite' or m.startswith('ignite_ext.distributed'))"


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    return out.stdout.decode().strip()


@pytest.mark.distributed  # a helper process
def test_a_cache_alone_imports_neither_ignite_nor_the_scheduler() -> None:
    code = f"""
        import sys, torch
        from torch.utils.data import DataLoader
        from ignite_ext.data import CachedDataset
        ds = CachedDataset([torch.full((2,), float(i)) for i in range(8)], capacity_bytes=1 << 20)
        batches = list(DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork"))
        assert [b[0, 0].item() for b in batches] == [0.0, 4.0], batches
        assert ds[1][0] == 1.0
        assert ds.stats().hits == 1 and ds.stats(reduce="world").misses == 8
        print({_LOADED})
        ds.close()
        """
    assert _run(code) == "[]"


@pytest.mark.distributed  # a helper process with a one-rank gloo group
def test_a_cache_in_a_process_group_asks_ignite() -> None:
    code = f"""
        import sys, torch, torch.distributed as dist
        from ignite_ext.data import CachedDataset
        from ignite_ext.data.cache._world import ignite_world
        assert ignite_world() is None
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        ds = CachedDataset([torch.zeros(2)] * 4, capacity_bytes=1 << 20, scope="node")
        ds[0], ds[0]
        assert ds.stats(reduce="node").hits == 1
        assert ignite_world().get_world_size() == 1
        print("ignite.distributed" in {_LOADED})
        ds.close()
        dist.destroy_process_group()
        """
    assert _run(code) == "True"
