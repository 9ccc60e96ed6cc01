"""The scheduler, downloads, sampler and cache over three simulated hosts: node-local means host-local here.

One torchrun job (three hosts, two ranks each) runs every scenario once (``tests.hosts._bodies.census``); each
test checks one of them. Host 2 sees the shared directory at another path than hosts 0 and 1, as a cluster
whose nodes mount a share in different places.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import pytest

from ignite_ext.data.cache.identity import fingerprint_indices
from tests.hosts._jobs import Server, serve, torchrun
from tests.hosts.conftest import make_bed

pytestmark = [pytest.mark.distributed, pytest.mark.multinode, pytest.mark.timeout(240)]

HOSTS, PER_HOST, SAMPLES = 3, 2, 96


def host_of(rank: int) -> int:
    return rank // PER_HOST


@pytest.fixture(scope="module")
def census(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    bed = make_bed(request, tmp_path_factory.mktemp("census"), HOSTS, shared_at=(None, None, "/tmp/elsewhere/share"))
    payload = os.urandom(3 << 20)
    served = bed.shared / "served"
    served.mkdir()
    for name in ("local.bin", "shared.bin"):
        (served / name).write_bytes(payload)
    server = serve(bed, bed.hosts[0], served)
    sha256 = hashlib.sha256(payload).hexdigest()
    job = torchrun(
        bed, "tests.hosts._bodies:census", f"{server.url}/local.bin", f"{server.url}/shared.bin", sha256, SAMPLES
    )
    return {"bed": bed, "server": server, "sha256": sha256, "seen": job.values(timeout=150)}


def by_scenario(census: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [s[name] for s in census["seen"]]


def test_each_host_has_its_own_name_tmp_and_shm(census: dict[str, Any]) -> None:
    seen, bed = census["seen"], census["bed"]
    assert [(s["rank"], s["node_rank"], s["nnodes"]) for s in seen] == [
        (r, host_of(r), HOSTS) for r in range(len(seen))
    ]
    assert [s["hostname"] for s in seen] == [bed.hosts[host_of(r)].name for r in range(HOSTS * PER_HOST)]
    for key in ("tmp_dev", "shm_dev"):
        per_host = [{s[key] for s in seen if s["node_rank"] == h} for h in range(HOSTS)]
        assert all(len(devs) == 1 for devs in per_host), (key, per_host)  # one filesystem per host ...
        assert len(set().union(*per_host)) == HOSTS, (key, per_host)  # ... and another one on each host
    assert os.stat("/tmp").st_dev not in {s["tmp_dev"] for s in seen}


def test_one_rank_first_local_runs_each_hosts_leader_first_and_the_hosts_in_parallel(census: dict[str, Any]) -> None:
    m = by_scenario(census, "master_local")
    assert [x["first"] for x in m] == [r % PER_HOST == 0 for r in range(len(m))]
    for leader in range(0, len(m), PER_HOST):
        assert m[leader + 1]["start"] >= m[leader]["end"], "the host's other rank waits for its leader"
    leaders = [m[r] for r in range(0, len(m), PER_HOST)]
    assert max(x["start"] for x in leaders) < min(x["end"] for x in leaders), "the hosts' leaders overlap"


def test_ordered_local_runs_one_rank_at_a_time_on_each_host(census: dict[str, Any]) -> None:
    o = by_scenario(census, "ordered_local")
    for h in range(HOSTS):
        a, b = o[h * PER_HOST], o[h * PER_HOST + 1]
        assert b["start"] >= a["end"], (h, a, b)
    firsts = [o[r] for r in range(0, len(o), PER_HOST)]
    assert max(x["start"] for x in firsts) < min(x["end"] for x in firsts), "the hosts run side by side"


def test_shared_path_on_a_host_local_path_elects_one_leader_per_host(census: dict[str, Any]) -> None:
    # The same path string on every host, but a directory of each host's own /tmp.
    n = by_scenario(census, "shared_local")
    assert [x["first"] for x in n] == [r % PER_HOST == 0 for r in range(len(n))]
    assert [x["group"] for x in n] == [[host_of(r) * PER_HOST + i for i in range(PER_HOST)] for r in range(len(n))]
    assert [x["probe"] for x in n] == [str(host_of(r) * PER_HOST) for r in range(len(n))]


def test_shared_path_on_the_shared_directory_elects_one_leader(census: dict[str, Any]) -> None:
    # Host 2 passes /tmp/elsewhere/share/data, the others the path of the share on this machine: one directory.
    c = by_scenario(census, "shared_all")
    assert [x["first"] for x in c] == [r == 0 for r in range(len(c))]
    assert all(x["group"] == list(range(len(c))) for x in c)
    assert [x["probe"] for x in c] == ["0"] * len(c)
    assert [p.name for p in (census["bed"].shared / "data").iterdir()] == ["probe"], "no marker is left behind"


def fetches(server: Server, path: str) -> list[str]:
    return sorted(ip for ip, method, p, status in server.requests() if method == "GET" and p == path and status == 200)


def test_download_url_fetches_once_per_host_local_directory(census: dict[str, Any]) -> None:
    # Six ranks call download_url into /tmp/ignite_ext_bed/dl at once: one directory per host, so one fetch each.
    assert by_scenario(census, "download_local") == [census["sha256"]] * (HOSTS * PER_HOST)
    assert fetches(census["server"], "/local.bin") == [h.ip for h in census["bed"].hosts]


def test_download_url_into_the_shared_directory_fetches_once(census: dict[str, Any]) -> None:
    assert by_scenario(census, "download_shared") == [census["sha256"]] * (HOSTS * PER_HOST)
    assert len(fetches(census["server"], "/shared.bin")) == 1
    published = census["bed"].shared / "dl" / "shared.bin"
    assert hashlib.sha256(published.read_bytes()).hexdigest() == census["sha256"]


def test_node_sharding_and_the_node_cache_load_each_hosts_shard_once_into_one_arena_per_host(
    census: dict[str, Any],
) -> None:
    cache = by_scenario(census, "cache")
    shards = []
    for h in range(HOSTS):
        mine = cache[h * PER_HOST : (h + 1) * PER_HOST]
        shard = sorted(set().union(*(c["read"][0] for c in mine)))
        assert all(set(c["read"][1]) <= set(shard) for c in mine), "epoch 1 reads the same shard"
        loads = mine[0]["loads"]  # the host's own log: both ranks read the same file
        assert all(c["loads"] == loads for c in mine)
        assert sorted(loads) == shard, f"host {h} loaded {sorted(loads)}, its shard is {shard}"
        # Besides, constructing the node cache read each rank's first, middle and last sample to fingerprint them.
        assert sorted(mine[0]["fingerprint_loads"]) == sorted(list(fingerprint_indices(SAMPLES)) * PER_HOST)
        assert len({c["segment"] for c in mine}) == 1, "the host's ranks share one arena"
        assert all(len(c["arenas"]) == 1 for c in mine), [c["arenas"] for c in mine]
        hits, misses, entries = mine[0]["node_stats"]
        assert (misses, entries, hits) == (len(shard), len(shard), sum(len(c["read"][1]) for c in mine))
        shards.append(set(shard))
    assert sum(len(s) for s in shards) == SAMPLES and set().union(*shards) == set(range(SAMPLES))
