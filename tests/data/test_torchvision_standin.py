"""download_url stands in for torchvision's: patched into torchvision, download_and_extract_archive works as before.

torchvision does not load beside the CPU build of torch 2.13.0 the project uses, so this runs in the peers'
environment (``scripts/peers_env.sh``: torch 2.14.1, torchvision 0.29.1), with this checkout on its path; the
download helpers need nothing of the project's dependencies.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
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
