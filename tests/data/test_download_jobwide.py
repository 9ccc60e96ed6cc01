"""download_for_job over real gloo ranks, each rank (or pair of ranks) with a directory of its own as a host's disk:
the origin (a real HTTP server on loopback) serves the file once per job, the holders relay it while it downloads,
a relay SIGKILLed mid-transfer leaves verified copies everywhere else, an origin failure reaches every holder once.
The relay's wire is tested in-process: a stranger without the secret gets no byte, a forged relay is refused."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.http_server import TestHTTPServer
from ignite_ext.data.download._http import BACKOFF_ENV
from ignite_ext.data.download._partial import Partial
from ignite_ext.data.download._relay_client import RelayGone, receive
from ignite_ext.data.download._relay_server import Growing, RelayServer, Version
from ignite_ext.data.download._relay_wire import RelayRefused, client_hello, read_message
from tests._staggered import join_in_order
from tests._world import World

pytestmark = pytest.mark.timeout(240)

DATA = random.Random(2).randbytes(2 << 20)
SHA = hashlib.sha256(DATA).hexdigest()
T = 3.0  # the heartbeat timeout of the worlds here
ENV = {BACKOFF_ENV: "0.01", "IGNITE_EXT_HEARTBEAT_TIMEOUT": str(T)}


@pytest.fixture
def server() -> Iterator[TestHTTPServer]:
    # 2 MiB at 2 MiB/s: the holders after the first join while the origin still sends.
    with TestHTTPServer(throttle_bps=2 << 20) as s:
        yield s


def _file_sha(root: Path, name: str) -> str | None:
    path = root / name
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def body_fetch(url: str, base: str, per_dir: int, sha256: str | None, stagger: float) -> dict[str, Any]:
    import ignite_ext.distributed as idist
    from ignite_ext.data import download_for_job

    rank = idist.get_rank()
    if stagger:  # holders join in rank order, so the test knows who relays to whom
        join_in_order(rank, stagger)
    root = Path(base, f"host{rank // per_dir}")
    start = time.monotonic()
    try:
        path = download_for_job(url, root, sha256=sha256, progress=False)
        return {
            "ok": True,
            "sha": hashlib.sha256(path.read_bytes()).hexdigest(),
            "s": time.monotonic() - start,
            "relays_open": _relays_open(url, sha256),
        }
    except Exception as exc:
        return {
            "ok": False,
            "type": type(exc).__name__,
            "message": str(exc),
            "sha": _file_sha(root, "a.bin"),
            "s": time.monotonic() - start,
        }


def _relays_open(url: str, sha256: str | None) -> int:
    """How many of this rank's relays of the file still accept a connection, now that it has left the block."""
    import ignite_ext.distributed as idist
    from ignite_ext.data.download._chain import Chain, file_id

    chain = Chain(idist.job_store(), file_id(url, "a.bin", {"sha256": sha256} if sha256 else {}))
    joined = int(chain.store.add(f"{chain.prefix}/holders", 0))
    holders = [chain.holder(place, timeout=30.0) for place in range(1, joined + 1)]  # set: the wait returns at once
    open_ = 0
    for holder in holders:
        assert holder is not None
        if holder.rank == idist.get_rank():
            with contextlib.suppress(OSError), socket.create_connection((holder.host, holder.port), timeout=2):
                open_ += 1
    return open_


@pytest.mark.distributed
@pytest.mark.parametrize("sha256", [SHA, None], ids=["digest-given", "no-digest"])
@pytest.mark.parametrize("per_dir", [1, 2], ids=["4-hosts", "2-hosts-of-2"])
def test_the_origin_serves_the_file_once_per_job(
    world: World, server: TestHTTPServer, tmp_path: Path, sha256: str | None, per_dir: int
) -> None:
    url = server.add("/a.bin", DATA)
    results = world(body_fetch, url, str(tmp_path), per_dir, sha256, 0.0, env=ENV)
    assert [r["ok"] for r in results] == [True] * 4, results
    assert {r["sha"] for r in results} == {SHA}
    assert server.bytes_served("/a.bin") == len(DATA)  # 1.00x the file, for 4 / per_dir directories
    assert [r["relays_open"] for r in results] == [0] * 4  # each rank's relay stopped as it left the block
    assert len(server.requests("/a.bin")) == 1
    for d in range(4 // per_dir):
        assert _file_sha(tmp_path / f"host{d}", "a.bin") == SHA
        leftovers = [p.name for p in (tmp_path / f"host{d}").iterdir() if p.name.endswith((".tmp", ".part"))]
        assert not leftovers, leftovers


def body_relay_dies(url: str, base: str, victim: int, how: str) -> dict[str, Any]:
    import ignite_ext.distributed as idist
    from ignite_ext.data.download import _relay_server

    if idist.get_rank() == victim:
        send = _relay_server.RelayServer._send

        def send_then_die(self: Any, conn: Any, offset: int, count: int) -> int:
            sent = send(self, conn, offset, count)
            if self.served_bytes + sent >= len(DATA) // 4:  # struck while it relays, a quarter of the file on
                if how == "stopped":  # silent, as a host cut off: continued 3 T later, declared dead by then
                    subprocess.Popen(["sh", "-c", f"sleep {3 * T}; kill -CONT {os.getpid()}"])
                    os.kill(os.getpid(), signal.SIGSTOP)
                else:
                    os.kill(os.getpid(), signal.SIGKILL)
            return sent

        _relay_server.RelayServer._send = send_then_die  # type: ignore[method-assign]
    result = body_fetch(url, base, 1, None, 0.3)
    if how == "stopped":  # the store (in rank 0) stays until the victim, continued, has learnt its fate
        learnt = Path(base, "victim-learnt")
        if idist.get_rank() == victim:
            learnt.touch()
        else:
            end = time.monotonic() + 20 * T  # a bound only: the victim says when (continued 3 T after its stop)
            while not learnt.exists() and time.monotonic() < end:
                time.sleep(0.05)
    return result


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_relay_lost_mid_transfer_leaves_verified_copies_everywhere_else(
    world: World, server: TestHTTPServer, tmp_path: Path, how: str
) -> None:
    # Holders join in rank order: rank 1 relays from rank 0 to rank 2, and is struck while it does. Killed, its
    # connections close at once; stopped, they fall silent, and rank 2 gives it up when the detector declares
    # rank 1 lost (4/3 T).
    url = server.add("/a.bin", DATA)
    start = time.monotonic()
    results = world.results(body_relay_dies, url, str(tmp_path), 1, how, env=ENV, deadline=120)
    survivors = {r: results[r].value for r in (0, 2, 3)}
    for r, value in survivors.items():
        assert value["sha"] == SHA, (r, value)  # every surviving directory has the verified file
        if not value["ok"]:  # then only because the job lost rank 1, as in any scheduled block
            assert value["type"] == "RankFailedError" and "[1]" in value["message"], value
    # Rank 2 resumed from rank 0 where rank 1 stopped: the origin still sent the file once.
    assert server.bytes_served("/a.bin") == len(DATA)
    if how == "stopped":
        assert results[1].ok and results[1].value["type"] == "RankDiedError", results[1]  # it learnt its fate
        # Detection (4/3 T) and the second half of the transfer (0.5 s at the origin's rate): within 2 T of the
        # stop, 2 T of margin for a loaded machine and the world's start.
        assert max(v["s"] for v in survivors.values()) < 4 * T + 1.0, survivors
    else:
        assert not results[1].ok  # killed: no result
        # Its relayed bytes, which no digest given could check, are not resumed by the next call on its host: it
        # fetches the file whole (with a digest given they would be, the digest checking them at the end).
        from ignite_ext.data import download_url

        before = len(server.requests("/a.bin"))
        path = download_url(url, tmp_path / "host1", progress=False)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == SHA
        again = server.requests("/a.bin")[before:]
        assert [(r.range, r.status, r.sent) for r in again] == [(None, 200, len(DATA))], again
    assert time.monotonic() - start < 60


def body_origin_fails(url: str, base: str) -> dict[str, Any]:
    return body_fetch(url, base, 1, None, 0.0)


@pytest.mark.distributed
def test_an_origin_failure_reaches_every_holder_once(world: World, server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA)
    server.fault("/a.bin", status=404)
    results = world(body_origin_fails, url, str(tmp_path), env=ENV)
    assert all(not r["ok"] for r in results), results
    assert {r["type"] for r in results} == {"DownloadError"}, results
    assert len({r["message"] for r in results}) == 1, results  # the same error, word for word
    assert len(server.requests("/a.bin")) == 1  # a 404 is not retried, and nobody else asked the origin


def body_differing_arguments(url: str, base: str) -> dict[str, Any]:
    import ignite_ext.distributed as idist
    from ignite_ext.data import download_for_job

    rank = idist.get_rank()
    try:
        download_for_job(url, Path(base, f"host{rank}"), retries=rank, progress=False)
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": None}


@pytest.mark.distributed
def test_arguments_that_differ_between_ranks_are_an_error_on_every_rank(
    world: World, server: TestHTTPServer, tmp_path: Path
) -> None:
    url = server.add("/a.bin", DATA)
    results = world(body_differing_arguments, url, str(tmp_path), env=ENV)
    assert all(r["error"] is not None and "different arguments" in r["error"] for r in results), results
    assert server.counts()["/a.bin"] == 0


# ------------------------------------------------------------------------------------------- the wire, in-process


@contextlib.contextmanager
def _serving(data: bytes, secret: bytes) -> Iterator[RelayServer]:
    """A relay serving ``data``, complete, as version ``"v1"`` of file ``file-1``."""
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.flush()
        growing = Growing()
        growing.start(Version(len(data), '"v1"', None), f.fileno(), len(data))
        growing.end()
        server = RelayServer(growing, secret, "file-1", "127.0.0.1", io_timeout=5.0)
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def relay() -> Iterator[tuple[RelayServer, bytes]]:
    secret = os.urandom(32)
    with _serving(DATA, secret) as server:
        yield server, secret


def test_a_client_without_the_secret_gets_no_byte(relay: tuple[RelayServer, bytes]) -> None:
    server, _ = relay
    # The server's proof fails on a wrong secret: the client refuses it.
    with (
        socket.create_connection(server.address, timeout=5) as sock,
        pytest.raises(RelayRefused, match="did not prove"),
    ):
        client_hello(sock, b"not the secret", {"file": "file-1", "offset": 0})
    # A client that skips checking the server and sends a forged proof gets the connection closed, nothing else.
    with socket.create_connection(server.address, timeout=5) as sock:
        sock.sendall(os.urandom(16))
        sock.recv(16 + 32)
        sock.sendall(os.urandom(32) + (2).to_bytes(4, "big") + b"{}")
        assert sock.recv(1 << 16) == b""
    assert server.served_bytes == 0 and server.refused == 1


def test_only_the_one_file_is_served(relay: tuple[RelayServer, bytes]) -> None:
    server, secret = relay
    with socket.create_connection(server.address, timeout=5) as sock:
        client_hello(sock, secret, {"file": "../../etc/passwd", "offset": 0})
        assert read_message(sock) == {"error": "no such file"}
        assert sock.recv(1) == b""
    with socket.create_connection(server.address, timeout=5) as sock:
        client_hello(sock, secret, {"file": "file-1", "offset": 100, "etag": '"v1"', "last_modified": None})
        assert read_message(sock)["offset"] == 100  # the same version: from the byte asked
        received = b""
        while chunk := sock.recv(1 << 16):
            received += chunk
        assert received == DATA[100:]


def _partial(tmp_path: Path) -> Partial:
    path = tmp_path / ".a.bin.tmp"
    path.touch()
    return Partial(path, set(), "a.bin")


def test_a_relay_that_does_not_hold_the_secret_is_refused(relay: tuple[RelayServer, bytes], tmp_path: Path) -> None:
    server, _ = relay
    partial = _partial(tmp_path)
    with pytest.raises(RelayGone, match="did not prove"):
        receive(server.address, b"another job", "file-1", partial, "http://origin/a.bin", alive=lambda: True, slice_s=1)
    assert partial.size == 0


def test_a_relay_of_another_version_starts_the_file_over(relay: tuple[RelayServer, bytes], tmp_path: Path) -> None:
    server, secret = relay
    partial = _partial(tmp_path)
    partial.append(b"x" * 1000)  # bytes of a version this relay does not serve
    from ignite_ext.data.download._http import Validator

    partial.note_source("http://origin/a.bin", Validator(etag='"v0"'), len(DATA))
    receive(server.address, secret, "file-1", partial, "http://origin/a.bin", alive=lambda: True, slice_s=1)
    assert partial.size == len(DATA) and partial.digests()["sha256"] == SHA  # not spliced onto the old bytes


def test_relaying_a_file_never_disturbs_its_writer(tmp_path: Path) -> None:
    # The relay reads the writer's file through a duplicate of its descriptor: anything that moved the shared file
    # offset (a file object's seek) would make the writer's next write land in the middle of the file.
    from ignite_ext.data.download._http import Validator

    source = _partial(tmp_path)
    growing = Growing()
    source.observer = growing
    source.note_source("http://origin/a.bin", Validator(etag='"v1"'), len(DATA))
    secret = os.urandom(32)
    server = RelayServer(growing, secret, "file-1", "127.0.0.1", io_timeout=5.0)
    (tmp_path / "r").mkdir()
    target = _partial(tmp_path / "r")
    try:
        reader = threading.Thread(
            target=receive,
            args=(server.address, secret, "file-1", target, "http://origin/a.bin"),
            kwargs={"alive": lambda: True, "slice_s": 1.0},
        )
        reader.start()
        for i in range(0, len(DATA), 4096):  # as the origin's bytes come, a relay streaming them meanwhile
            source.append(DATA[i : i + 4096])
            if i % (64 << 10) == 0:
                time.sleep(0.001)
        reader.join(30)
        assert not reader.is_alive()
    finally:
        server.stop()
    assert source.path.read_bytes() == DATA  # the writer's file is intact
    assert target.path.read_bytes() == DATA and target.digests()["sha256"] == SHA


def body_archive(url: str, mirror: str, base: str) -> dict[str, Any]:
    import ignite_ext.distributed as idist
    from ignite_ext.data import download_for_job

    root = Path(base, f"host{idist.get_rank()}")
    out = download_for_job(url, root, "big.tar", mirrors=[mirror], connections=4, extract=True, progress=False)
    return {"dir": str(out), "sha": hashlib.sha256((out / "big.bin").read_bytes()).hexdigest()}


@pytest.mark.distributed
def test_mirrors_parallel_ranges_and_extraction_keep_working(world: World, tmp_path: Path) -> None:
    # The first URL is gone (404), the mirror serves a 9 MiB archive: the origin's holder fetches it over parallel
    # ranges (a relay serves the bytes held from the start, as the ranges fill in), every host extracts its copy.
    import io
    import tarfile

    payload = random.Random(4).randbytes(9 << 20)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("big.bin")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    archive = buffer.getvalue()
    with TestHTTPServer(throttle_bps=8 << 20) as server:
        mirror = server.add("/big.tar", archive)
        results = world(body_archive, server.url("/gone/big.tar"), mirror, str(tmp_path), env=ENV)
        assert {r["sha"] for r in results} == {hashlib.sha256(payload).hexdigest()}
        assert len({r["dir"] for r in results}) == 4  # each host's own extraction
        # Once, over several ranges, all asked by the origin's holder: one whole-body request cut where the first
        # range ends (what the server had written into the socket by then counts too: TCP buffers, more on a
        # loaded machine), then disjoint ranges for the rest; nothing asked twice.
        requests = server.requests("/big.tar")
        assert [r.status for r in requests].count(200) == 1 and 2 <= len(requests) <= 4, requests
        starts = sorted(int(r.range.split("=")[1].split("-")[0]) for r in requests if r.range is not None)
        ends = sorted(int(r.range.split("-")[1]) for r in requests if r.range is not None)
        assert all(e < s for e, s in zip(ends, starts[1:], strict=False)) and ends[-1] == len(archive) - 1, requests
        assert len(server.requests("/gone/big.tar")) == 1  # only the origin's holder asked the dead URL


def body_deadline(url: str, base: str) -> dict[str, Any]:
    import ignite_ext.distributed as idist
    from ignite_ext.data import download_for_job

    try:
        download_for_job(url, Path(base, f"host{idist.get_rank()}"), deadline=0.3, progress=False)
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None}


@pytest.mark.distributed
def test_a_deadline_bounds_every_holder(world: World, server: TestHTTPServer, tmp_path: Path) -> None:
    url = server.add("/a.bin", DATA)  # 1 s at the origin's rate: past the deadline for everyone
    results = world(body_deadline, url, str(tmp_path), env=ENV)
    # DeadlinePassed is the DownloadError that download_url raises for a deadline; the other holders raise it too.
    assert all(r["type"] in ("DeadlinePassed", "DownloadError") for r in results), results
    assert all("deadline" in r["message"] for r in results), results


def _listening_ports() -> set[int]:
    """The TCP ports this process listens on (IPv4 and IPv6): the machine's other jobs open ports too."""
    mine = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                mine.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for row in Path(table).read_text().splitlines()[1:]:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in mine:  # LISTEN, on a socket of this process
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def body_local_first(url: str, base: str, relay: str, asked: bool) -> dict[str, Any]:
    import ignite_ext.distributed as idist
    from ignite_ext.data import download_url

    os.environ["IGNITE_EXT_RELAY"] = relay
    root = Path(base, f"node{idist.get_node_rank()}")
    before = _listening_ports()
    opened: set[int] = set()
    with idist.one_rank_first(local=True) as first:  # the usual pattern for node-local disks
        options = {"relay": True} if asked else {}
        path = download_url(url, root, sha256=SHA, progress=False, **options)
        if first:
            opened = _listening_ports() - before  # a relay listens until the block ends
    return {"sha": hashlib.sha256(path.read_bytes()).hexdigest(), "opened": sorted(opened)}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("relay", "asked"), [("1", True), ("0", True), ("1", False)], ids=["asked", "asked-relay-off", "not-asked"]
)
def test_one_rank_first_local_users_fetch_once_per_job_when_they_ask(
    world: World, server: TestHTTPServer, tmp_path: Path, relay: str, asked: bool
) -> None:
    # Two nodes of two ranks (nproc_per_node=2), a directory per node: each node's local rank 0 runs first. Asked
    # (relay=True), the two of them chain up and the second node's holder listens on a port for the block; with
    # IGNITE_EXT_RELAY=0, or unasked, each asks the origin and no port is opened.
    url = server.add("/a.bin", DATA)
    results = world(body_local_first, url, str(tmp_path), relay, asked, nproc_per_node=2, env=ENV)
    assert {r["sha"] for r in results} == {SHA}
    relayed = relay == "1" and asked
    assert server.bytes_served("/a.bin") == len(DATA) * (1 if relayed else 2)
    opened = [port for r in results for port in r["opened"]]
    assert bool(opened) == relayed, results  # every holder's relay listens while it downloads; none unasked


@pytest.mark.parametrize("given", [True, False], ids=["digest-given", "digest-posted"])
def test_a_relay_serving_wrong_bytes_is_caught_by_the_digest(tmp_path: Path, given: bool) -> None:
    # A holder whose copy is wrong (a forged or corrupted relay that holds the secret): the bytes fail the check
    # against the digest given, or the one the origin's holder posted, and are thrown away, never published.
    import torch.distributed as dist

    from ignite_ext.data.download._chain import Chain, Holder
    from ignite_ext.data.download._job import Job
    from ignite_ext.data.download._relaying import Member, from_relays

    wrong = bytearray(DATA)
    wrong[len(wrong) // 2] ^= 0xFF
    chain = Chain(dist.HashStore(), "file-1")
    secret = chain.secret()
    with _serving(bytes(wrong), secret) as server:
        chain.post(Holder(chain.join(), 0, *server.address))
        if not given:
            chain.post_digest(SHA, len(DATA))  # what the origin's holder posts of its own, right, copy
        place = chain.join()
        partial = _partial(tmp_path)
        mine = Growing()
        member = Member(chain, place, secret, mine, server, "http://origin/a.bin", 1)
        job = Job({"sha256": SHA} if given else {}, timeout=5.0, retries=0, progress=False, ends_at=None)
        assert from_relays(member, partial, job) is False  # no holder gave a verified copy: the origin's turn
        assert partial.size == 0  # the wrong bytes are gone


def body_retry_after_failure(url: str, base: str) -> dict[str, Any]:
    import ignite_ext.distributed as idist
    from ignite_ext.data import download_for_job

    root = Path(base, f"host{idist.get_rank()}")
    try:
        download_for_job(url, root, progress=False)
        first = "ok"
    except Exception as exc:
        first = type(exc).__name__
    path = download_for_job(url, root, progress=False)  # a later block: a chain of its own
    return {"first": first, "sha": hashlib.sha256(path.read_bytes()).hexdigest()}


@pytest.mark.distributed
def test_a_retry_after_an_origin_failure_starts_a_chain_of_its_own(
    world: World, server: TestHTTPServer, tmp_path: Path
) -> None:
    url = server.add("/a.bin", DATA)
    server.fault("/a.bin", status=404, times=1)  # the first request only
    results = world(body_retry_after_failure, url, str(tmp_path), env=ENV)
    assert [r["first"] for r in results] == ["DownloadError"] * 4, results
    assert {r["sha"] for r in results} == {SHA}  # the first block's failure is not the second's
    assert server.bytes_served("/a.bin") == len(DATA)


def test_a_client_that_trickles_its_handshake_is_dropped(
    relay: tuple[RelayServer, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ignite_ext.data.download import _relay_server

    server, _ = relay
    monkeypatch.setattr(_relay_server, "HANDSHAKE_TIMEOUT_S", 1.0)
    start = time.monotonic()
    with socket.create_connection(server.address, timeout=5) as sock:
        with contextlib.suppress(OSError):
            for _ in range(20):  # a byte every 0.3 s: every read is short, the whole is not
                sock.sendall(b"x")
                time.sleep(0.3)
        sock.settimeout(5)
        with contextlib.suppress(OSError):
            while sock.recv(1 << 10):
                pass
    assert time.monotonic() - start < 1.0 + 3.0  # dropped at the handshake's deadline, not 20 bytes later
    assert server.served_bytes == 0


def test_no_digest_wait_for_a_holder_that_abandoned(tmp_path: Path) -> None:
    # The holder fetching from the origin stopped for a reason of its own (its disk, its deadline): the others do
    # not wait for a digest that will not come, nor raise its error; their copies go to the origin's check.
    import torch.distributed as dist

    from ignite_ext.data.download._chain import Chain
    from ignite_ext.data.download._job import Job
    from ignite_ext.data.download._relaying import Member, _verified

    chain = Chain(dist.HashStore(), "file-1")
    chain.abandon()
    member = Member(chain, 2, b"", Growing(), None, "http://origin/a.bin", 1)  # type: ignore[arg-type]
    job = Job({}, timeout=5.0, retries=0, progress=False, ends_at=None)
    start = time.monotonic()
    assert _verified(member, _partial(tmp_path), job, before=[0]) is False
    assert chain.failure() is None
    assert time.monotonic() - start < 5.0


def _dropping_port() -> tuple[socket.socket, list[socket.socket]]:
    """A listening socket whose accept queue is full: the kernel drops new connections' SYNs, as a firewall that
    filters the port does (no refusal: the client waits)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    queued = []
    for _ in range(4):
        client = socket.socket()
        client.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            client.connect(listener.getsockname())
        queued.append(client)
    time.sleep(0.2)
    return listener, queued


def test_relays_on_a_filtered_port_send_a_holder_to_the_origin_after_one_connect_timeout(tmp_path: Path) -> None:
    # Holders 1 and 2 published relays that a firewall drops: holder 3 tries holder 2's once, for
    # CONNECT_TIMEOUT_S, and goes to the origin, without retrying it or trying holder 1's (2 x 3 tries of the
    # system's TCP timeout before).
    import torch.distributed as dist

    from ignite_ext.data.download._chain import Chain, Holder
    from ignite_ext.data.download._job import Job
    from ignite_ext.data.download._relay_client import CONNECT_TIMEOUT_S
    from ignite_ext.data.download._relaying import Member, from_relays

    listener, queued = _dropping_port()
    try:
        host, port = listener.getsockname()
        chain = Chain(dist.HashStore(), "file-1")
        for place in (1, 2):
            chain.post(Holder(place, place - 1, host, port))
        member = Member(chain, 3, b"", Growing(), None, "http://origin/a.bin", 2)  # type: ignore[arg-type]
        job = Job({}, timeout=5.0, retries=0, progress=False, ends_at=None)
        start = time.monotonic()
        assert from_relays(member, _partial(tmp_path), job) is False  # the origin it is
        took = time.monotonic() - start
        # One connect timeout, plus the scheduling slack of a loaded machine: under two of them.
        assert CONNECT_TIMEOUT_S <= took < 2 * CONNECT_TIMEOUT_S, took
    finally:
        for sock in [listener, *queued]:
            sock.close()


def _two_free_ports() -> range:
    """Two adjacent ports that nothing listens on at 127.0.0.1 (looked for from a free one)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        with contextlib.suppress(OSError), socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", first))
            b.bind(("127.0.0.1", first + 1))
            return range(first, first + 2)
    pytest.skip("no two adjacent free ports on 127.0.0.1")


def test_a_relay_listens_on_the_first_free_port_of_its_range() -> None:
    ports = _two_free_ports()
    growing = Growing()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports[0]))
        taken.listen()
        server = RelayServer(growing, b"s" * 32, "file-1", "127.0.0.1", io_timeout=5.0, ports=ports)
        try:
            assert server.address == ("127.0.0.1", ports[1])
            with pytest.raises(OSError, match=f"no free port in {ports[0]}-{ports[0]}"):
                RelayServer(growing, b"s" * 32, "file-1", "127.0.0.1", io_timeout=5.0, ports=range(ports[0], ports[1]))
        finally:
            server.stop()
            growing.close()
