"""What runs on the simulated hosts of a :class:`~tests._hosts.HostBed`: torchrun jobs, and an HTTP server.

:func:`torchrun` starts one torchrun agent per host (``--master_addr`` = host 0's address, so the store is served
by host 0's agent), each running ``tests.hosts._rank`` on its ranks; the :class:`Job` reads what every rank
returned or raised, and the marks ranks leave on the way, from a directory of the shared directory. :func:`serve`
starts the standard library's HTTP server on a host's address, whose log names the client of every request.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests._hosts import Host, HostBed

__all__ = ["OUT_ENV", "PG_TIMEOUT_ENV", "Job", "Origin", "Server", "origin", "serve", "torchrun"]

OUT_ENV = "IGNITE_EXT_HOSTS_OUT"  # where a rank writes its record and marks, as its host sees it
PG_TIMEOUT_ENV = "IGNITE_EXT_HOSTS_PG_TIMEOUT"  # the process group's timeout, in seconds
_START_TIMEOUT = 30.0
_REQUEST_RE = re.compile(r'^(\S+) - - \[[^\]]*\] "(\w+) (\S+) [^"]*" (\d{3})', re.M)


@dataclass
class Server:
    """The standard library's HTTP server in a host: its log names the client address of every request."""

    url: str
    log: Path
    proc: subprocess.Popen[bytes]

    def requests(self) -> list[tuple[str, str, str, int]]:
        """``(client address, method, path, status)`` of every request so far."""
        return [(ip, m, path, int(status)) for ip, m, path, status in _REQUEST_RE.findall(self.log.read_text())]


def serve(bed: HostBed, host: Host, directory: Path, port: int = 8000) -> Server:
    """Serve ``directory`` (as ``host`` sees it) over HTTP on ``host``'s address, until the bed closes."""
    log = f"http.{host.index}.{port}.log"
    argv = [sys.executable, "-m", "http.server", "--bind", host.ip, "--directory", str(directory), str(port)]
    server = Server(f"http://{host.ip}:{port}", bed.logs / log, bed.start(host, argv, bed.env(), log))
    end = time.monotonic() + _START_TIMEOUT
    while "Serving HTTP" not in server.log.read_text():
        if server.proc.poll() is not None or time.monotonic() > end:
            raise RuntimeError(f"the HTTP server on {host.name} did not start: {server.log.read_text()}")
        time.sleep(0.05)
    return server


@dataclass
class Origin:
    """``tests.hosts._origin`` on a host: the fault-injecting server, its URL, and what it has sent."""

    url: str
    out: Path  # as this namespace sees it
    proc: subprocess.Popen[bytes]

    def record(self) -> dict[str, Any]:
        """``{"bytes": body bytes sent, "requests": [[range, status, sent], ...]}``, as of 0.1 s ago at most."""
        time.sleep(0.25)  # the server writes its record every 0.1 s
        return dict(json.loads((self.out / "origin.json").read_text()))


def origin(bed: HostBed, host: Host, data: bytes, rate_bps: int | None = None) -> Origin:
    """Serve ``data`` from ``host`` at ``/data.bin``; with ``rate_bps``, its link's egress is shaped to that rate.

    The shaping is the host's own ``tc`` token bucket on its ``eth0``: the origin's link is the bottleneck, not
    the server's pacing, as for an origin behind a slow uplink.
    """
    out = bed.shared / f"origin{host.index}"
    out.mkdir()
    (out / "data.bin").write_bytes(data)
    if rate_bps is not None:
        rate = f"{rate_bps * 8 // 1000}kbit"
        host.run(["tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate, "burst", "32kb", "latency", "1s"])
    argv = [
        sys.executable,
        "-m",
        "tests.hosts._origin",
        host.ip,
        str(host.sees(out / "data.bin", bed)),
        str(host.sees(out, bed)),
    ]
    proc = bed.start(host, argv, bed.env(), f"origin{host.index}.log")
    end = time.monotonic() + _START_TIMEOUT
    while not (out / "origin.url").exists():
        if proc.poll() is not None or time.monotonic() > end:
            raise RuntimeError(
                f"the origin on {host.name} did not start: {(bed.logs / f'origin{host.index}.log').read_text()}"
            )
        time.sleep(0.05)
    return Origin((out / "origin.url").read_text(), out, proc)


@dataclass
class Job:
    """A body running on every rank of a :func:`torchrun`; records and marks appear in ``out``."""

    bed: HostBed
    out: Path  # as this namespace sees it
    procs: list[subprocess.Popen[bytes]]
    logs: list[Path]
    world_size: int
    seen: dict[int, dict[str, Any]] = field(default_factory=dict)

    def results(self) -> dict[int, dict[str, Any]]:
        """The record of every rank that has finished so far: ``{"ok": True, "value": ...}`` or the error."""
        for path in self.out.glob("rank*.json"):
            self.seen.setdefault(int(path.stem[4:]), json.loads(path.read_text()))
        return dict(self.seen)

    def marks(self, name: str) -> dict[int, float]:
        """When each rank wrote mark ``name`` (``tests.hosts._rank.mark``), by the machine's monotonic clock."""
        return {int(p.suffix[1:]): float(p.read_text()) for p in self.out.glob(f"{name}.*")}

    def output(self, chars: int = 4000) -> str:
        """The tail of every launcher's output, for failure messages."""
        return "\n".join(f"--- {log.name}:\n{log.read_text(errors='replace')[-chars:]}" for log in self.logs)

    def dump_stacks(self) -> int:
        """Ask every rank still running for its Python stacks (into the logs); return how many were asked."""
        asked = 0
        for host in self.bed.hosts:
            for pid in host.pids():
                with contextlib.suppress(OSError):
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                    # torchrun's agent has the same command line but no LOCAL_RANK: only ranks handle SIGUSR1.
                    if (
                        b"tests.hosts._rank" in cmdline
                        and b"\0LOCAL_RANK=" in Path(f"/proc/{pid}/environ").read_bytes()
                    ):
                        os.kill(pid, signal.SIGUSR1)
                        asked += 1
        return asked

    def _until(self, done: Callable[[], bool], what: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        while not done():
            if time.monotonic() > end:
                if self.dump_stacks():
                    time.sleep(0.5)
                raise AssertionError(f"{what} not within {timeout:.0f} s\n{self.output()}")
            if all(p.poll() is not None for p in self.procs) and not done():
                raise AssertionError(f"every launcher ended before {what}\n{self.output()}")
            time.sleep(0.05)

    def wait_marks(self, name: str, ranks: Sequence[int], timeout: float = 90.0) -> dict[int, float]:
        """Wait until ``ranks`` wrote mark ``name``; return when each did."""
        self._until(lambda: set(ranks) <= set(self.marks(name)), f"mark {name!r} of ranks {list(ranks)}", timeout)
        return self.marks(name)

    def wait(self, ranks: Sequence[int] | None = None, timeout: float = 90.0) -> dict[int, dict[str, Any]]:
        """Wait for the records of ``ranks`` (all by default); fail at the deadline, naming the missing ones."""
        wanted = set(range(self.world_size) if ranks is None else ranks)
        self._until(lambda: wanted <= set(self.results()), f"the records of ranks {sorted(wanted)}", timeout)
        return {r: self.seen[r] for r in sorted(wanted)}

    def values(self, timeout: float = 90.0) -> list[Any]:
        """Every rank's value, or fail with every failing rank's error and the launchers' output."""
        records = self.wait(timeout=timeout)
        bad = [
            f"rank {r}: {x['exc_type']}: {x['message']}\n{x['traceback']}" for r, x in records.items() if not x["ok"]
        ]
        if bad:
            raise AssertionError("some ranks failed:\n" + "\n".join(bad) + "\n" + self.output())
        return [records[r]["value"] for r in range(self.world_size)]


def torchrun(
    bed: HostBed,
    target: str,
    *args: Any,
    nproc_per_node: int = 2,
    env: dict[str, str] | None = None,
    pg_timeout: float = 60.0,
    hosts: Sequence[int] | None = None,
) -> Job:
    """Run ``target`` (``"module:function"``) with the JSON-able ``args`` on every rank, one torchrun per host.

    ``hosts``: the indices of the bed's hosts that run the job (all by default); the first serves its store.
    """
    members = [bed.hosts[k] for k in (range(len(bed.hosts)) if hosts is None else hosts)]
    out = bed.shared / f"job{bed.jobs}"
    out.mkdir()
    port = str(29500 + bed.jobs)  # every host's network is its own: no port of this machine can be taken
    bed.jobs += 1
    procs, logs = [], []
    for node, host in enumerate(members):
        argv = [
            *(sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(members)}", f"--node_rank={node}"),
            *(f"--nproc_per_node={nproc_per_node}", f"--master_addr={members[0].ip}", f"--master_port={port}"),
            *("-m", "tests.hosts._rank", target, json.dumps(list(args))),
        ]
        host_env = bed.env(**{OUT_ENV: str(host.sees(out, bed)), PG_TIMEOUT_ENV: str(pg_timeout), **(env or {})})
        logs.append(bed.logs / f"{out.name}.host{host.index}.log")
        procs.append(bed.start(host, argv, host_env, logs[-1].name))
    return Job(bed, out, procs, logs, len(members) * nproc_per_node)
