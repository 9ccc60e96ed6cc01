"""The end-to-end demo over two simulated hosts: each host fetches the archive once, from a server on host 0."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from ignite_ext.demo._train import DemoConfig
from ignite_ext.demo.data import make_archive, sha256_of
from tests._hosts import HostBed
from tests.hosts._demo_node import PER_HOST
from tests.hosts._jobs import serve

pytestmark = [pytest.mark.distributed, pytest.mark.multinode, pytest.mark.slow, pytest.mark.timeout(240)]

SAMPLES, EPOCHS, DEADLINE = 160, 2, 180.0
NODE_ROOT = "/tmp/ignite_ext_demo/data"  # one path, a directory of each host's own


def test_the_demo_fetches_once_per_job_and_reads_each_sample_once_per_host(bed2: HostBed) -> None:
    bed = bed2
    archive = make_archive(bed.shared / "served", train=SAMPLES, val=40)
    server = serve(bed, bed.hosts[0], archive.parent)
    out = bed.shared / "result.json"
    cfg = DemoConfig(f"{server.url}/{archive.name}", sha256_of(archive), (NODE_ROOT,), str(out), EPOCHS, progress=False)
    config = bed.shared / "config.json"
    config.write_text(json.dumps(asdict(cfg)))
    nodes = []
    for host in bed.hosts:
        argv = [sys.executable, "-m", "tests.hosts._demo_node", str(host.sees(config, bed)), str(len(bed.hosts))]
        argv += [str(host.index), bed.hosts[0].ip, "29400"]
        nodes.append(bed.start(host, argv, bed.env(), f"demo.host{host.index}.log"))
    end = time.monotonic() + DEADLINE
    codes = []
    for proc in nodes:
        while proc.poll() is None and time.monotonic() < end:
            time.sleep(0.1)
        codes.append(proc.poll())
    logs = "\n".join((bed.logs / f"demo.host{h.index}.log").read_text()[-3000:] for h in bed.hosts)
    assert codes == [0] * len(bed.hosts), f"exit codes {codes} (None: still running at {DEADLINE:.0f} s)\n{logs}"

    result = json.loads(out.read_text())
    assert (result["world_size"], result["nnodes"], result["train_samples"]) == (PER_HOST * 2, 2, SAMPLES)
    fetched = [ip for ip, method, path, status in server.requests() if method == "GET" and status == 200]
    assert len(fetched) == 1 and fetched[0] in [h.ip for h in bed.hosts], server.requests()  # once for the job
    history = result["history"]
    assert [h["hit_rate"] for h in history] == [0.0, 1.0]
    assert [int(h["storage_reads"]) for h in history] == [SAMPLES, 0], "each host read its shard once"
    for host in bed.hosts:  # each host extracted its own copy, in its own /tmp
        assert "shapes" in host.run(["ls", NODE_ROOT]).split()
    assert not Path(NODE_ROOT).exists()
