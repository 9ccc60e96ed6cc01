"""download_url(connections=k): concurrent range requests into the private temp file, with the same guarantees."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks.http_server import TestHTTPServer
from ignite_ext.data import download_url
from ignite_ext.data.download._parallel import MIN_SEGMENT

DATA = random.Random(4).randbytes(6 * MIN_SEGMENT + 12_345)
SHA = hashlib.sha256(DATA).hexdigest()


def test_a_large_file_comes_over_k_ranges_and_is_verified(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA)
    out = download_url(url, tmp_path, sha256=SHA, connections=4, progress=False)
    assert out.read_bytes() == DATA
    requests = server.requests("/a.bin")
    assert requests[0].range is None and requests[0].status == 200  # the first stream is segment 0
    assert len(requests) == 4 and all(r.status == 206 and r.if_range and r.range for r in requests[1:])
    bounds = sorted(tuple(map(int, str(r.range).removeprefix("bytes=").split("-"))) for r in requests[1:])
    assert bounds[-1][1] == len(DATA) - 1 and all(a[1] + 1 == b[0] for a, b in itertools.pairwise(bounds))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [
        ".a.bin.lock",
        ".a.bin.verified.json",
    ]


@pytest.mark.parametrize(
    ("setup", "requests"),
    [
        ({"validators": False}, 1),  # no validator: segments could be of several versions
        ({"small": True}, 1),  # too small to be worth splitting
    ],
    ids=["no-validator", "small"],
)
def test_one_stream_where_ranges_cannot_be_trusted_or_do_not_pay(
    setup: dict[str, bool], requests: int, server: TestHTTPServer, tmp_path: Path
) -> None:
    data = DATA[: MIN_SEGMENT + 10] if setup.get("small") else DATA
    url = server.add("/a.bin", data, validators=setup.get("validators", True))
    assert download_url(url, tmp_path, connections=8, progress=False).read_bytes() == data
    assert [r.range for r in server.requests("/a.bin")] == [None] * requests


def test_segments_answered_with_another_version_fall_back_to_one_stream(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA)
    server.fault("/a.bin", range_etag='"another-version"')
    assert download_url(url, tmp_path, connections=4, progress=False).read_bytes() == DATA
    assert server.requests("/a.bin")[-1].range is None  # the last attempt was one whole stream


def test_a_dropped_first_stream_resumes_from_the_held_prefix(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA)
    server.fault("/a.bin", drop_after=1_000_000, times=1)
    assert download_url(url, tmp_path, sha256=SHA, connections=4, progress=False).read_bytes() == DATA
    resumed = [r for r in server.requests("/a.bin")[1:] if r.range and r.range.endswith("-")]
    assert resumed and resumed[0].range == "bytes=1000000-"


_KILLED = textwrap.dedent(
    """
    import sys
    from ignite_ext.data import download_url
    download_url(sys.argv[1], sys.argv[2], connections=4, progress=False)
    """
)


@pytest.mark.distributed
def test_sigkill_in_the_middle_leaves_only_the_proven_prefix_to_resume(tmp_path: Path) -> None:
    # Each connection at 2 MiB/s: the fetch takes ~3 s; it is killed after ~1.6 s, with every segment part-way
    # and the record of how far they got written at least once since they started.
    with TestHTTPServer(conn_bps=2 << 20) as server:
        url = server.add("/a.bin", DATA)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        proc = subprocess.Popen([sys.executable, "-c", _KILLED, url, str(tmp_path)], env=env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            records = list(tmp_path.glob(".a.bin.*.tmp.json"))
            if records and json.loads(records[0].read_text()).get("segments"):
                break
            time.sleep(0.05)
        time.sleep(1.6)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        assert not (tmp_path / "a.bin").exists()
        (temp,) = tmp_path.glob(".a.bin.*.tmp")
        assert temp.stat().st_size > 0
        before = len(server.requests("/a.bin"))
        server.set_throttle(None)
        server.state.conn_bps = None
        out = download_url(url, tmp_path, progress=False)  # no checksum: the prefix rule alone must be right
        assert out.read_bytes() == DATA
        first = server.requests("/a.bin")[before]
        assert first.range is not None and first.range.startswith("bytes=") and first.status == 206
        assert int(first.range.removeprefix("bytes=").split("-")[0]) > 0  # resumed, not started over


def test_connections_must_be_a_small_positive_int(server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA[:10])
    for bad in (0, 65, 2.0, True):
        with pytest.raises(ValueError, match="connections"):
            download_url(url, tmp_path, connections=bad, progress=False)  # type: ignore[arg-type]
