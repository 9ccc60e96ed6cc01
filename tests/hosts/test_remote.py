"""SharedPath's census and concurrent downloads on a network filesystem with attribute caching (sshfs).

Every host, host 0 included, sees the share only through its own caching mount (``tests.hosts._remote``): what
one host created may stay invisible to another for the cache's 3 s, and no host's lock reaches the others.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import pytest

from tests.hosts._jobs import serve, torchrun
from tests.hosts._remote import mount_remote, remote_unavailable
from tests.hosts.conftest import make_bed

pytestmark = [pytest.mark.distributed, pytest.mark.multinode, pytest.mark.timeout(180)]

HOSTS, PER_HOST, REMOTE = 2, 2, "/tmp/remote"


@pytest.fixture(scope="module")
def remote(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    reason = remote_unavailable()
    if reason:
        pytest.skip(reason)
    bed = make_bed(request, tmp_path_factory.mktemp("remote"), HOSTS)
    export, served = bed.shared / "export", bed.shared / "served"
    export.mkdir()
    served.mkdir()
    payload = os.urandom(3 << 20)
    (served / "r.bin").write_bytes(payload)
    server = serve(bed, bed.hosts[0], served)
    mount_remote(bed, export, REMOTE)
    sha256 = hashlib.sha256(payload).hexdigest()
    job = torchrun(bed, "tests.hosts._bodies:over_remote", REMOTE, f"{server.url}/r.bin", sha256)
    return {"bed": bed, "export": export, "server": server, "sha256": sha256, "seen": job.values(timeout=120)}


def test_every_host_mounts_the_share_with_attribute_caching(remote: dict[str, Any]) -> None:
    for host in remote["bed"].hosts:
        mount = [line for line in host.run(["cat", "/proc/mounts"]).splitlines() if f" {REMOTE} " in line]
        assert len(mount) == 1 and " fuse.sshfs " in mount[0], (host.name, mount)


def test_the_census_on_the_network_filesystem_elects_one_leader(remote: dict[str, Any]) -> None:
    census = [s["census"] for s in remote["seen"]]
    assert [c["first"] for c in census] == [r == 0 for r in range(HOSTS * PER_HOST)]
    assert all(c["group"] == list(range(HOSTS * PER_HOST)) for c in census)
    assert [c["probe"] for c in census] == ["0"] * (HOSTS * PER_HOST)
    assert [p.name for p in (remote["export"] / "data").iterdir()] == ["probe"], "no marker is left behind"


def test_concurrent_downloads_on_the_network_filesystem_give_every_rank_the_verified_file(
    remote: dict[str, Any],
) -> None:
    # The download lock (flock) is kept by each host's kernel on a FUSE mount: every host may fetch (at most one
    # fetch per host, as where flock does not cross hosts on NFS), but every rank gets the verified bytes, and one
    # file is published, with no temp or parked file left beside it.
    assert [s["download"] for s in remote["seen"]] == [remote["sha256"]] * (HOSTS * PER_HOST)
    fetched = sorted(
        ip for ip, method, path, status in remote["server"].requests() if method == "GET" and status == 200
    )
    assert 1 <= len(fetched) <= HOSTS and len(set(fetched)) == len(fetched), fetched
    dl = remote["export"] / "dl"
    assert hashlib.sha256((dl / "r.bin").read_bytes()).hexdigest() == remote["sha256"]
    names = [p.name for p in dl.iterdir()]
    assert "r.bin" in names and [n for n in names if n.endswith((".tmp", ".part"))] == [], names
