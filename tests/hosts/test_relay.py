"""One fetch per job across simulated hosts: an origin behind a link shaped by ``tc``, three hosts with their own
``/tmp``. The origin sends the file once; a relay host killed or cut off mid-transfer leaves verified copies on
the others, still with the file sent once (the host after it resumes from the one before it); a host whose relay
port a firewall drops costs the one after it one connection time-out and a fetch from the origin, not a hang."""

from __future__ import annotations

import hashlib
import random
import time

import pytest

from tests._hosts import HostBed
from tests.hosts._jobs import Job, Origin, origin, torchrun
from tests.hosts.conftest import make_bed

pytestmark = [pytest.mark.distributed, pytest.mark.multinode, pytest.mark.timeout(300)]

T = 4.0  # IGNITE_EXT_HEARTBEAT_TIMEOUT
DATA = random.Random(3).randbytes(6 << 20)
SHA = hashlib.sha256(DATA).hexdigest()
RATE = 2 << 20  # the origin's link, bytes per second: 3 s for the file, far below the hosts' links
JOB_HOSTS = [1, 2, 3]  # host 0 is the origin's


@pytest.fixture
def bed4(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> HostBed:
    return make_bed(request, tmp_path_factory.mktemp("relay"), 4)


def _job(bed: HostBed, served: Origin, sha256: str | None, stagger: float, **extra: str) -> Job:
    env = {"IGNITE_EXT_HEARTBEAT_TIMEOUT": str(T), **extra}
    body = "tests.hosts._bodies:fetch_for_job"
    return torchrun(bed, body, served.url, sha256, stagger, nproc_per_node=1, env=env, hosts=JOB_HOSTS)


@pytest.mark.parametrize("sha256", [SHA, None], ids=["digest-given", "no-digest"])
def test_three_hosts_get_verified_copies_and_the_origin_sends_the_file_once(bed4: HostBed, sha256: str | None) -> None:
    served = origin(bed4, bed4.hosts[0], DATA, RATE)
    values = _job(bed4, served, sha256, 0.0).values(timeout=120)
    assert [v["ok"] for v in values] == [True] * 3, values
    assert {v["sha"] for v in values} == {SHA}
    record = served.record()
    assert record["bytes"] == len(DATA), record  # 1.00x the file for 3 hosts
    assert len(record["requests"]) == 1, record


@pytest.mark.parametrize("how", ["killed", "cut"])
def test_a_relay_host_lost_mid_transfer_leaves_verified_copies_on_the_others(bed4: HostBed, how: str) -> None:
    # Holders join in host order, 0.5 s apart: host 2 relays from host 1 to host 3, and is struck while it does.
    served = origin(bed4, bed4.hosts[0], DATA, RATE)
    job = _job(bed4, served, None, 0.5)
    job.wait_marks("joined", [2], timeout=120)  # rank 2 (host 3) receives from rank 1 (host 2) from now on
    time.sleep(0.5)
    victim = bed4.hosts[2]
    victim.cut() if how == "cut" else victim.kill()
    struck = time.monotonic()
    records = job.wait([0, 2], timeout=6 * T + 30)
    for rank, rec in records.items():
        assert rec["ok"], (rank, rec)  # the body reports what it raised
        value = rec["value"]
        assert value["sha"] == SHA, (rank, value)  # a verified copy on every surviving host
        if not value["ok"]:  # only because the job lost rank 1, as in any scheduled block
            assert value["type"] == "RankFailedError" and "[1]" in value["message"], (rank, value)
    # Host 3 resumed from host 1 where host 2 stopped: the origin still sent the file once. A silent relay is given
    # up when the detector declares its rank (4/3 T); the rest comes at the origin's rate (3 s for all of it).
    record = served.record()
    assert record["bytes"] == len(DATA), record
    assert records[2]["value"]["done"] - struck <= 4 / 3 * T + 3.0 + T, records[2]["value"]["done"] - struck


#: The relays' port: below the system's ephemeral range (32768-60999), so that no gloo or store socket takes it.
RELAY_PORT = 20000


def test_a_host_whose_relay_port_is_filtered_costs_one_connection_timeout_not_a_hang(bed4: HostBed) -> None:
    # Every host's relay listens on RELAY_PORT (IGNITE_EXT_RELAY_PORTS); host 1's firewall drops it. Holders join in
    # host order: rank 1 (host 2) finds host 1's relay silent, gives up after one connection time-out and fetches
    # from the origin; rank 2 (host 3) relays from host 2 as usual. The kernel alone would retry a silent connect
    # for 127 s (tcp_syn_retries = 6), three tries per holder before; the bound is one time-out, the file twice
    # at the origin's rate (the two fetches share its link), and 4 T for the block's waits on a loaded machine.
    from ignite_ext.data.download._relay_client import CONNECT_TIMEOUT_S

    bed4.hosts[1].filter_port(RELAY_PORT)
    served = origin(bed4, bed4.hosts[0], DATA, RATE)
    job = _job(bed4, served, None, 0.5, IGNITE_EXT_RELAY_PORTS=str(RELAY_PORT))
    values = job.values(timeout=180)
    assert [v["ok"] for v in values] == [True] * 3, values
    assert {v["sha"] for v in values} == {SHA}
    record = served.record()
    assert record["bytes"] == 2 * len(DATA), record  # host 1's fetch and host 2's: host 3 got it from host 2
    assert len(record["requests"]) == 2, record
    took = values[1]["done"] - job.marks("entering")[1]
    # At least the time-out: host 1's relay port was silent, not refused (the filter holds).
    assert CONNECT_TIMEOUT_S <= took <= CONNECT_TIMEOUT_S + 2 * len(DATA) / RATE + 4 * T, took
