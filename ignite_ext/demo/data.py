"""The demo's data: a small image-classification set made on the spot, and a loopback server for it.

The set is ten classes of 3x16x16 images (a class is a colour and a stripe direction, plus noise), one
``torch.save`` file per sample in an ImageFolder-like layout, packed as ``shapes.tar.gz``: reading a sample
means opening and decoding a file, which is what the cache saves after the first epoch.

.. versionadded:: 0.2.0
"""

from __future__ import annotations

import hashlib
import http.server
import tarfile
import threading
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

__all__ = ["CountingServer", "ShapesDataset", "make_archive", "random_flip", "sha256_of"]

NUM_CLASSES = 10
IMAGE_SIZE = 16


def _image(label: int, generator: torch.Generator) -> torch.Tensor:
    colour = torch.tensor([(label * 37) % 256, (label * 91) % 256, (label * 151) % 256], dtype=torch.float32)
    phase = torch.arange(IMAGE_SIZE, dtype=torch.float32)
    stripes = torch.sin(phase * (1 + label % 5) * 0.6)
    pattern = stripes.view(1, -1) if label < 5 else stripes.view(-1, 1)
    img = colour.view(3, 1, 1) * (0.6 + 0.4 * pattern.expand(IMAGE_SIZE, IMAGE_SIZE))
    img = img + 40 * torch.randn(3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    return img.clamp(0, 255).to(torch.uint8)


def make_archive(directory: Path, train: int = 2400, val: int = 600, seed: int = 0) -> Path:
    """Write ``shapes/{train,val}/<class>/<i>.pt`` and pack it as ``directory/shapes.tar.gz``.

    Args:
        directory: where the archive goes (created if missing).
        train: number of training samples.
        val: number of validation samples.
        seed: seed of the images.

    Returns:
        The archive's path.

    Examples:
        >>> import tempfile, pathlib
        >>> from ignite_ext.demo.data import make_archive
        >>> with tempfile.TemporaryDirectory() as d:
        ...     make_archive(pathlib.Path(d), train=20, val=10).name
        'shapes.tar.gz'

    .. versionadded:: 0.1.0
    """
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "shapes"
    generator = torch.Generator().manual_seed(seed)
    for split, count in (("train", train), ("val", val)):
        for i in range(count):
            label = i % NUM_CLASSES
            folder = source / split / f"{label:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(_image(label, generator), folder / f"{i:05d}.pt")
    archive = directory / "shapes.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(source, arcname="shapes")
    return archive


def sha256_of(path: Path) -> str:
    """Return the hex SHA-256 of a file."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class ShapesDataset(Dataset[tuple[torch.Tensor, int]]):
    """Map-style dataset over an extracted archive: ``root/<split>/<class>/<i>.pt``; one file read per sample.

    Args:
        root: the extracted directory (the one holding ``train`` and ``val``, or its parent).
        split: ``"train"`` or ``"val"``.

    .. versionadded:: 0.1.0
    """

    def __init__(self, root: Path, split: str) -> None:
        base = root / split if (root / split).is_dir() else root / "shapes" / split
        classes = sorted(p.name for p in base.iterdir() if p.is_dir())
        self.files = [(f, c) for c, name in enumerate(classes) for f in sorted((base / name).glob("*.pt"))]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.files[index]
        image = torch.load(path, weights_only=True).float().div_(255.0)
        return image, label


def random_flip(sample: tuple[torch.Tensor, int]) -> tuple[torch.Tensor, int]:
    """Flip the image left to right, with probability 1/2: the demo's augmentation, applied after the cache.

    Examples:
        >>> import torch
        >>> from ignite_ext.demo.data import random_flip
        >>> image = torch.arange(3.0).view(1, 1, 3)
        >>> sorted({tuple(random_flip((image, 4))[0].flatten().tolist()) for _ in range(64)})
        [(0.0, 1.0, 2.0), (2.0, 1.0, 0.0)]

    .. versionadded:: 0.2.0
    """
    image, label = sample
    return (image.flip(-1) if torch.rand(()) < 0.5 else image), label


class _CountingHandler(http.server.SimpleHTTPRequestHandler):
    server: CountingServer

    def copyfile(self, source: Any, outputfile: Any) -> None:
        while chunk := source.read(1 << 16):
            outputfile.write(chunk)
            with self.server.lock:
                self.server.bytes_served += len(chunk)

    def log_message(self, format: str, *args: Any) -> None:
        with self.server.lock:
            self.server.requests += 1


class CountingServer(http.server.ThreadingHTTPServer):
    """A static file server on 127.0.0.1 that counts the body bytes it serves.

    Args:
        directory: the folder to serve.

    Examples:
        >>> import tempfile, pathlib, urllib.request
        >>> from ignite_ext.demo.data import CountingServer
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = (pathlib.Path(d) / "f").write_bytes(b"12345")
        ...     with CountingServer(pathlib.Path(d)) as server:
        ...         body = urllib.request.urlopen(f"{server.url}/f").read()
        ...     print(body, server.bytes_served)
        b'12345' 5

    .. versionadded:: 0.1.0
    """

    daemon_threads = True

    def __init__(self, directory: Path) -> None:
        self.lock = threading.Lock()
        self.bytes_served = 0
        self.requests = 0
        root = str(directory)

        class Handler(_CountingHandler):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, directory=root, **kwargs)

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> CountingServer:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()
