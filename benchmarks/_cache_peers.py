"""One variant of the cache-peers benchmark in one rank process, driven line by line by ``bench_cache_peers``.

Run as ``python -m benchmarks._cache_peers VARIANT SOURCE N NUMEL WORKDIR REPLY_FD`` in the cache peers'
environment (``scripts/cache_peers_env.sh``) with the working tree on ``PYTHONPATH``; with two ranks, under
torchrun's environment variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), which is also what LitData and Mosaic streaming read. Commands come on stdin,
one JSON line each, and every reply is one JSON line on ``REPLY_FD`` (stdout is left to the libraries' prints):

* ``setup``: build the variant from the source dataset; replies the seconds it took;
* ``epoch``: one epoch through the variant's loader; replies the seconds, the samples seen by this rank and the sum
  of their labels (every sample's label is its index, so a complete epoch is recognised);
* ``pids``: this process, its DataLoader workers and the files that hold the variant's data, for the RAM measure,
  and how many objects this process froze (``gc.get_freeze_count()``);
* ``inplace``: what writing into a sample read from the dataset does (rank 0 only);
* ``quit``.

The variants:

* ``in-memory``: every sample loaded (through a 4-worker DataLoader) into one tensor, then a ``TensorDataset``;
* ``CachedDataset``: ``CachedDataset(source)`` with its defaults; ``scope="node"`` on two ranks;
* ``LitData``: ``litdata.optimize`` (4 workers, 64 MB chunks, no compression) on rank 0, then
  ``StreamingDataset(shuffle=True)`` through a ``StreamingDataLoader``;
* ``Mosaic``: an ``MDSWriter`` (64 MiB shards, no compression, a fixed-shape ``ndarray`` column) fed by a
  4-worker DataLoader on rank 0, then ``StreamingDataset(local=..., shuffle=True, batch_size=16)`` through a
  ``StreamingDataLoader``.

The warm-restart variants (``bench_warm``) keep what they build in ``BENCH_WARM_STORE`` (the environment), so that
the next job, a new group of processes, finds it as the peers' users' next runs do:

* ``CachedDataset-persist``: ``CachedDataset(source, disk_dir=<store>/disk, persist=True)``;
* ``LitData-remote``: ``optimize`` once into ``<store>/lit_remote``, read as a remote (``local:`` prefix: LitData
  copies each chunk into its ``cache_dir``, ``<store>/lit_cache``, as from object storage);
* ``Mosaic-remote``: the shards written once into ``<store>/mds_remote``, read with ``remote=`` that directory and
  ``local=<store>/mds_local`` (Mosaic copies each shard it needs there).

With ``BENCH_WARM_STORE`` set, the source counts its loads (one byte appended to ``<store>/loads`` per sample).

Every loader: batches of 16, 4 workers (fork), persistent. In-memory and CachedDataset shuffle with a
``RandomSampler`` (one rank) or a ``DistributedSampler`` (two ranks); the peers shuffle and split the ranks
themselves.
"""

from __future__ import annotations

import functools
import gc
import glob
import json
import os
import select
import signal
import sys
import time
import warnings
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

WORKERS = 4
BATCH = 16
DECODE_S = 0.002  # what decoding a compressed sample of this size would take
CHUNK_BYTES = 64 << 20  # LitData's chunks and Mosaic's shards


class SourceDataset(Dataset[tuple[torch.Tensor, int]]):
    """The dataset every variant is built from: one raw float32 file per sample, plus a fixed decode time.

    Sample ``i`` is ``(tensor, i)``.
    """

    def __init__(self, root: str, n: int) -> None:
        self.root, self.n = root, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = np.fromfile(os.path.join(self.root, f"{i}.f32"), dtype=np.float32)
        time.sleep(DECODE_S)
        store = os.environ.get("BENCH_WARM_STORE")
        if store:  # one byte per load: what the warm-restart benchmark counts as storage reads
            fd = os.open(os.path.join(store, "loads"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.write(fd, b".")
            os.close(fd)
        return torch.from_numpy(x), i


def write_source(root: str, n: int, numel: int, seed: int = 0) -> None:
    """Write the source dataset: ``n`` samples of ``numel`` random float32 values."""
    os.makedirs(root, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for i in range(n):
        torch.randn(numel, generator=gen).numpy().tofile(os.path.join(root, f"{i}.f32"))


def import_streaming() -> Any:
    """``import streaming`` (Mosaic) without its vision datasets, which need a torchvision that loads beside torch.

    PyPI's torchvision is built for the CUDA build of torch; beside the CPU build it fails to import, and
    ``streaming/__init__.py`` imports ``streaming.vision``, which imports torchvision. Nothing here uses those
    datasets: an empty module stands in for ``streaming.vision`` (a user with a working torchvision also pays for
    importing it).
    """
    import types

    sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    import streaming

    return streaming


def _lit_sample(source: SourceDataset, i: int) -> tuple[torch.Tensor, int]:
    return source[i]


def _first(batch: Any) -> tuple[Any, Any]:
    """The data and labels of a batch: a ``(x, y)`` pair or Mosaic's ``{"x": ..., "y": ...}``."""
    return (batch["x"], batch["y"]) if isinstance(batch, dict) else (batch[0], batch[1])


class Variant:
    """One way of serving the source dataset to a training loop, in this rank."""

    def __init__(self, name: str, source: SourceDataset, numel: int, workdir: str) -> None:
        self.name, self.source, self.numel, self.workdir = name, source, numel, workdir
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.dataset: Any = None
        self.loader: Any = None
        self.sampler: DistributedSampler[Any] | None = None
        self.files: list[str] = []
        self.epoch = 0

    def _barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def _plain_loader(self, dataset: Dataset[Any]) -> DataLoader[Any]:
        if self.world > 1:
            self.sampler = DistributedSampler(dataset, shuffle=True, seed=0)
        return DataLoader(
            dataset,
            batch_size=BATCH,
            shuffle=self.sampler is None,
            sampler=self.sampler,
            num_workers=WORKERS,
            multiprocessing_context="fork",
            persistent_workers=True,
        )

    def setup(self) -> float:
        self._barrier()
        start = time.perf_counter()
        getattr(self, "_setup_" + self.name.lower().replace("-", "_"))()
        self._barrier()
        return time.perf_counter() - start

    def _setup_in_memory(self) -> None:
        loader = DataLoader(self.source, batch_size=64, num_workers=WORKERS, multiprocessing_context="fork")
        xs, ys = zip(*loader, strict=True)
        self.dataset = TensorDataset(torch.cat(xs), torch.cat(ys))
        self.loader = self._plain_loader(self.dataset)

    def _setup_cacheddataset(self) -> None:
        from ignite_ext.data import CachedDataset

        self.dataset = CachedDataset(self.source, scope="node" if self.world > 1 else "rank")
        self.files = [self.dataset.segment]
        self.loader = self._plain_loader(self.dataset)

    def _optimize(self, out: str) -> None:
        """LitData's ``optimize`` of the source into ``out`` (4 workers, 64 MB chunks, no compression)."""
        import litdata

        litdata.optimize(
            fn=functools.partial(_lit_sample, self.source),
            inputs=list(range(len(self.source))),
            output_dir=out,
            chunk_bytes=CHUNK_BYTES,
            num_workers=WORKERS,
            verbose=False,
        )

    def _setup_litdata(self) -> None:
        import litdata

        out = os.path.join(self.workdir, "litdata")
        if self.rank == 0:
            self._optimize(out)
        self._barrier()
        self.dataset = litdata.StreamingDataset(out, shuffle=True, cache_dir=os.path.join(self.workdir, "lit_cache"))
        self.loader = litdata.StreamingDataLoader(
            self.dataset, batch_size=BATCH, num_workers=WORKERS, persistent_workers=True
        )
        self.files = sorted(glob.glob(os.path.join(self.workdir, "lit*", "**", "*"), recursive=True))

    def _setup_cacheddataset_persist(self) -> None:
        from ignite_ext.data import CachedDataset

        disk = os.path.join(os.environ["BENCH_WARM_STORE"], "disk")
        os.makedirs(disk, exist_ok=True)
        self.dataset = CachedDataset(
            self.source, scope="node" if self.world > 1 else "rank", disk_dir=disk, persist=True
        )
        self.files = [self.dataset.segment, self.dataset.disk_segment]
        self.loader = self._plain_loader(self.dataset)

    def _setup_litdata_remote(self) -> None:
        import litdata

        store = os.environ["BENCH_WARM_STORE"]
        remote = os.path.join(store, "lit_remote")
        if self.rank == 0 and not os.path.exists(os.path.join(remote, "index.json")):
            self._optimize(remote)
        self._barrier()
        cache = os.path.join(store, "lit_cache")
        self.dataset = litdata.StreamingDataset("local:" + remote, shuffle=True, cache_dir=cache)
        self.loader = litdata.StreamingDataLoader(
            self.dataset, batch_size=BATCH, num_workers=WORKERS, persistent_workers=True
        )
        self.files = sorted(glob.glob(os.path.join(cache, "**", "*"), recursive=True))

    def _setup_mosaic_remote(self) -> None:
        streaming = import_streaming()
        store = os.environ["BENCH_WARM_STORE"]
        remote, local = os.path.join(store, "mds_remote"), os.path.join(store, "mds_local")
        if self.rank == 0 and not os.path.exists(os.path.join(remote, "index.json")):
            self._write_mds(streaming, remote)
        self._barrier()
        self.dataset = streaming.StreamingDataset(remote=remote, local=local, shuffle=True, batch_size=BATCH)
        self.loader = streaming.StreamingDataLoader(
            self.dataset, batch_size=BATCH, num_workers=WORKERS, persistent_workers=True
        )
        self.files = sorted(glob.glob(os.path.join(local, "**", "*"), recursive=True))

    def _write_mds(self, streaming: Any, out: str) -> None:
        columns = {"x": f"ndarray:float32:{self.numel}", "y": "int"}
        feed = DataLoader(self.source, batch_size=None, num_workers=WORKERS, multiprocessing_context="fork")
        with streaming.MDSWriter(out=out, columns=columns, compression=None, size_limit=CHUNK_BYTES) as writer:
            for x, y in feed:
                writer.write({"x": x.numpy(), "y": int(y)})

    def _setup_mosaic(self) -> None:
        streaming = import_streaming()
        StreamingDataLoader, StreamingDataset = streaming.StreamingDataLoader, streaming.StreamingDataset
        out = os.path.join(self.workdir, "mds")
        if self.rank == 0:
            self._write_mds(streaming, out)
        self._barrier()
        self.dataset = StreamingDataset(local=out, shuffle=True, batch_size=BATCH)
        self.loader = StreamingDataLoader(self.dataset, batch_size=BATCH, num_workers=WORKERS, persistent_workers=True)
        self.files = sorted(glob.glob(os.path.join(out, "**", "*"), recursive=True))

    def run_epoch(self) -> dict[str, Any]:
        if self.sampler is not None:
            self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        self._barrier()
        start = time.perf_counter()
        count = label_sum = 0
        for batch in self.loader:
            x, y = _first(batch)
            count += len(x)
            label_sum += int(torch.as_tensor(y).sum())
        self._barrier()
        return {"s": time.perf_counter() - start, "count": count, "label_sum": label_sum}

    def pids(self) -> dict[str, Any]:
        iterator = getattr(self.loader, "_iterator", None)
        workers = [w.pid for w in getattr(iterator, "_workers", [])]
        files = [f for f in self.files if os.path.isfile(f)]
        # Objects this rank froze (gc.freeze): none unless the package froze them (a CachedDataset was made here).
        return {"pids": [os.getpid(), *workers], "files": files, "frozen": gc.get_freeze_count()}

    def _read(self, i: int) -> Any:
        sample = self.dataset[i]
        return sample["x"] if isinstance(sample, dict) else sample[0]

    def inplace(self) -> str:
        """Write into sample 3 as read from the dataset, then read it again: what happened, in words.

        In a forked child, since a write may kill the process (LitData lends read-only mappings of its chunks).
        """
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, then leave without running the parent's exit handlers
            os.close(read_fd)
            try:
                os.write(write_fd, self._inplace().encode())
            finally:
                os._exit(0)
        os.close(write_fd)
        with os.fdopen(read_fd, "rb") as said:
            ready, _, _ = select.select([said], [], [], 60)
            outcome = said.read().decode() if ready else ""
        if not ready:
            os.kill(pid, signal.SIGKILL)
        status = os.waitpid(pid, 0)[1]
        if os.WIFSIGNALED(status):
            return f"kills the process ({signal.Signals(os.WTERMSIG(status)).name})"
        return outcome or "hangs"

    def _inplace(self) -> str:
        expected = self.source[3][0].numpy()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            x = self._read(3)
            try:
                x[:8] = -1.0
            except Exception as exc:  # what a read-only buffer raises: part of the answer
                outcome = f"raises {type(exc).__name__}"
            else:
                outcome = "written"
            del x
            again = np.asarray(self._read(3))
        if outcome == "written":
            changed = not np.array_equal(again, expected)
            outcome = "later reads see the write" if changed else "later reads unchanged"
        elif not np.array_equal(again, expected):
            outcome += "; later reads differ"
        said = sorted({type(w.message).__name__ + ": " + str(w.message).split(".")[0] for w in caught})
        return outcome + (f" (warns {'; '.join(said)})" if said else "")


def main() -> None:
    name, source_dir, n, numel, workdir, reply_fd = sys.argv[1:7]
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # 4 workers on fewer cores
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        torch.distributed.init_process_group("gloo")
    variant = Variant(name, SourceDataset(source_dir, int(n)), int(numel), workdir)
    with os.fdopen(int(reply_fd), "w", buffering=1) as reply:
        for line in sys.stdin:
            command = json.loads(line)["cmd"]
            if command == "quit":
                break
            answer: Any
            if command == "setup":
                import ignite_ext

                answer = {"s": variant.setup(), "ignite_ext": ignite_ext.__file__}
            elif command == "epoch":
                answer = variant.run_epoch()
            elif command == "pids":
                answer = variant.pids()
            elif command == "inplace":
                answer = {"outcome": variant.inplace()}
            else:
                raise ValueError(f"unknown command {command!r}")
            reply.write(json.dumps(answer) + "\n")
    if variant.world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
