"""download_url stands in for torchvision's: patched into torchvision, download_and_extract_archive works as before,
and a dataset whose first mirror fails goes on to the next, as with torchvision's own function.

torchvision does not load beside the CPU build of torch 2.13.0 the project uses, so this runs in the peers'
environment (``scripts/peers_env.sh``: torch 2.14.1, torchvision 0.29.1), with this checkout on its path; the
download helpers need nothing of the project's dependencies.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import struct
import subprocess
import tarfile
import textwrap
from pathlib import Path

import pytest

from benchmarks.http_server import TestHTTPServer

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torchvision.datasets.utils as tvu
    from ignite_ext.data import download_url

    url, root, md5 = sys.argv[1:4]
    tvu.download_url = download_url  # what a user does to make every torchvision dataset download race-free
    tvu.download_and_extract_archive(url, root, md5=md5)
    tvu.download_and_extract_archive(url, root, md5=md5)  # the verified file is found: no second fetch
    files = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)
    print(json.dumps(files))
    """
)


def _peers_python() -> str:
    failed = os.environ.get("IGNITE_EXT_PEERS_FAILED")
    if failed:
        pytest.skip(f"the peers' environment could not be made: {failed}")
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "peers_env.sh")], capture_output=True, text=True, timeout=1800
    )
    if done.returncode != 0:
        pytest.skip("scripts/peers_env.sh failed: " + (done.stderr.strip().splitlines() or ["no output"])[-1])
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.distributed  # a second interpreter, in another environment
@pytest.mark.timeout(1800)
def test_torchvision_download_and_extract_archive_with_ours_patched_in(server: TestHTTPServer, tmp_path: Path) -> None:
    python = _peers_python()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in (("mnist/train.bin", b"t" * 5000), ("mnist/test.bin", b"v" * 1000)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    archive = buf.getvalue()
    url = server.add("/mirror/mnist.tar.gz", archive)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    root = tmp_path / "data"
    done = subprocess.run(
        [python, "-c", _SCRIPT, url, str(root), hashlib.md5(archive).hexdigest()],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    files = json.loads(done.stdout.strip().splitlines()[-1])
    assert [f for f in files if not f.startswith(".")] == ["mnist.tar.gz", "mnist/test.bin", "mnist/train.bin"]
    assert (root / "mnist" / "train.bin").read_bytes() == b"t" * 5000
    assert len(server.requests("/mirror/mnist.tar.gz")) == 1


_MNIST_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import torchvision.datasets as tvd
    import torchvision.datasets.utils as tvu
    from ignite_ext.data import download_url

    mirrors, resources, root = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
    tvu.download_url = download_url  # as the downloads guide says
    tvd.MNIST.mirrors = mirrors
    tvd.MNIST.resources = [tuple(r) for r in resources]
    start = time.monotonic()
    train = tvd.MNIST(root, train=True, download=True)
    elapsed = time.monotonic() - start
    test = tvd.MNIST(root, train=False)
    print(json.dumps({"train": train.targets.tolist(), "test": test.targets.tolist(),
                      "pixels": int(train.data.sum()), "elapsed": elapsed}))
    """
)

_N_IMAGES = 10


def _idx_files() -> dict[str, bytes]:
    """Tiny valid MNIST files (gzip'd IDX): 10 images of 28x28 and their labels, for training and for test."""
    files = {}
    for split, offset in (("train", 0), ("t10k", 3)):
        labels = bytes((i + offset) % 10 for i in range(_N_IMAGES))
        images = bytes((i * 7 + offset) % 256 for i in range(_N_IMAGES * 28 * 28))
        files[f"{split}-images-idx3-ubyte.gz"] = gzip.compress(
            struct.pack(">IIII", 0x0803, _N_IMAGES, 28, 28) + images, mtime=0
        )
        files[f"{split}-labels-idx1-ubyte.gz"] = gzip.compress(struct.pack(">II", 0x0801, _N_IMAGES) + labels, mtime=0)
    return files


def _run_mnist(server: TestHTTPServer, tmp_path: Path, files: dict[str, bytes], **fault: object) -> dict[str, object]:
    """MNIST through the drop-in, from mirrors ``/first/`` (misbehaving as ``fault`` says) and ``/second/``."""
    python = _peers_python()
    for name, data in files.items():
        server.add(f"/first/{name}", data)
        server.fault(f"/first/{name}", **fault)
        server.add(f"/second/{name}", data)
    mirrors = [server.url("/first/"), server.url("/second/")]
    resources = [[name, hashlib.md5(data).hexdigest()] for name, data in files.items()]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}  # the default backoff
    done = subprocess.run(
        [python, "-c", _MNIST_SCRIPT, json.dumps(mirrors), json.dumps(resources), str(tmp_path / "data")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["train"] == [i % 10 for i in range(_N_IMAGES)]
    assert result["test"] == [(i + 3) % 10 for i in range(_N_IMAGES)]
    assert result["pixels"] == sum((i * 7) % 256 for i in range(_N_IMAGES * 28 * 28))
    for name in files:  # the second mirror served each file once
        assert [r.status for r in server.requests(f"/second/{name}")] == [200]
    result["stderr"] = done.stderr
    return result


@pytest.mark.distributed  # a second interpreter, in another environment
@pytest.mark.timeout(1800)
@pytest.mark.parametrize(
    ("fault", "first_statuses"),
    [
        # Retried by the default policy (3 retries) before torchvision goes on to the next mirror.
        ({"status": 500}, [500] * 4),
        # An md5 mismatch: the same bytes again would not help, so one request, then the next mirror.
        ({"wrong_bytes": True}, [200]),
    ],
    ids=["first-answers-500", "first-serves-wrong-md5"],
)
def test_torchvision_mnist_goes_on_to_the_next_mirror_when_the_first_fails(
    server: TestHTTPServer, tmp_path: Path, fault: dict[str, object], first_statuses: list[int]
) -> None:
    files = _idx_files()
    result = _run_mnist(server, tmp_path, files, **fault)  # the first mirror misbehaves every time
    for name in files:
        assert [r.status for r in server.requests(f"/first/{name}")] == first_statuses
    # The guide's claim: a mirror given up after retries costs at least their backoff (1 + 2 + 4 s) per file.
    backoff = sum(2.0**attempt for attempt in range(len(first_statuses) - 1))
    assert isinstance(result["elapsed"], float) and result["elapsed"] >= len(files) * backoff
    # What is retried and why, once per file, at the level a user sees with no logging configured (stderr).
    retried = [line for line in str(result["stderr"]).splitlines() if "retrying it" in line]
    if len(first_statuses) > 1:
        assert len(retried) == len(files), result["stderr"]
        for name in files:
            [line] = [line for line in retried if f"/first/{name}: " in line]
            assert "HTTP 500" in line and f"retrying it {len(first_statuses) - 1} more time(s)" in line, line
    else:
        assert retried == [], result["stderr"]  # nothing is retried: nothing said about it
