"""One fetch per job: ``download_for_job`` against every host fetching for itself, and one host alone, in one run.

Gloo ranks on this machine, each with a directory of its own (a host's disk), fetch a file from a loopback HTTP
server whose bodies are paced together at ``R`` bytes per second (the origin's egress, shared by every request);
the ranks' own links are loopback, far faster. Per round, in a rotating order, on new files each time:

* **alone**: rank 0 fetches while the others wait (``download_url``): what one host needs;
* **each host**: every rank fetches into its own directory (``download_url``, as ``one_rank_first(local=True)``
  on ``H`` hosts does);
* **relayed**: ``download_for_job`` on every rank: one fetch from the origin, the copies relayed.

Each variant's time is from a barrier to the last rank's verified copy; its ratio to *alone* is the median over
rounds of the ratio in the same round. The origin's bytes per variant come from the server's own count.

The 64-host figure comes from :func:`simulate`: the chain, chunk by chunk, with the origin's rate, the links'
rate and a per-hop delay, beside the formulas of the other ways (every host from the origin; one fetch then a
binomial tree of whole-file copies, as a broadcast over Gloo).
"""

from __future__ import annotations

import math
import os
import platform
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._report import print_result
from benchmarks.http_server import TestHTTPServer

NAME = "relay"
VARIANTS = ("alone", "each host", "relayed")
#: (file MiB, origin MiB/s, rounds) for the full run and ``quick=True``.
SIZES = {"full": (32, 8.0, 5), "quick": (4, 4.0, 2)}
HOSTS = 3
_MiB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(local_rank: int, base: str, plan: list[tuple[str, str]]) -> None:
    import ignite.distributed as ignite_idist

    from ignite_ext.data import download_for_job, download_url

    rank = ignite_idist.get_rank()
    out: list[tuple[str, float]] = []
    for i, (variant, url) in enumerate(plan):
        root = Path(base, f"host{rank}", str(i))
        ignite_idist.barrier()
        start = time.monotonic()
        if variant == "relayed":
            download_for_job(url, root, progress=False)
        elif variant == "each host" or rank == 0:
            download_url(url, root, progress=False)
        took = time.monotonic() - start
        slowest = ignite_idist.all_reduce(took, op="MAX")
        out.append((variant, float(slowest)))
    if rank == 0:
        Path(base, "times.txt").write_text("\n".join(f"{v}\t{t}" for v, t in out))


def measure(size: int, rate: float, rounds: int, hosts: int = HOSTS) -> dict[str, Any]:
    """Each variant's times per round and the origin's bytes per variant."""
    import ignite_ext.distributed as idist

    data = random.Random(0).randbytes(size)
    with TestHTTPServer(throttle_bps=rate) as server, tempfile.TemporaryDirectory() as base:
        plan: list[tuple[str, str]] = []
        for r in range(rounds):
            order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]  # rotating, so that no variant always goes first
            plan += [(v, server.add(f"/{r}/{v.replace(' ', '_')}.bin", data)) for v in order]
        env = {"OMP_NUM_THREADS": "1", "IGNITE_EXT_HEARTBEAT_TIMEOUT": "10"}
        os.environ.update(env)
        with idist.Parallel(
            backend="gloo", nproc_per_node=hosts, master_addr="127.0.0.1", master_port=_free_port()
        ) as parallel:
            parallel.run(_worker, base, plan)
        lines = Path(base, "times.txt").read_text().splitlines()
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for line in lines:
            variant, took = line.split("\t")
            times[variant].append(float(took))
        origin = {v: 0 for v in VARIANTS}
        for variant, url in plan:
            origin[variant] += server.bytes_served(url.removeprefix(server.base))
    return {"times": times, "origin": {v: origin[v] / rounds for v in VARIANTS}}


def simulate(hosts: int, size: float, origin_rate: float, link_rate: float, chunk: float, hop_s: float) -> float:
    """Seconds until the last of ``hosts`` holders of a relay chain has the file, chunk by chunk.

    Holder 1 gets chunk ``j`` from the origin at ``R``; holder ``k`` forwards each chunk once it has it, over its
    link (``link_rate``), ``hop_s`` later; a chunk cannot overtake the one before it.

    Examples:
        >>> from benchmarks.bench_relay import simulate
        >>> round(simulate(1, 100.0, 10.0, 100.0, 1.0, 0.0), 6)  # one host: the origin's time
        10.0
        >>> simulate(3, 100.0, 10.0, 100.0, 1.0, 0.0) - simulate(1, 100.0, 10.0, 100.0, 1.0, 0.0) < 0.1
        True
    """
    chunks = math.ceil(size / chunk)
    arrived = [(j + 1) * chunk / origin_rate for j in range(chunks)]  # at holder 1
    for _ in range(hosts - 1):
        nxt: list[float] = []
        for j, t in enumerate(arrived):
            ready = max(t + hop_s, nxt[j - 1] if j else 0.0)
            nxt.append(ready + chunk / link_rate)
        arrived = nxt
    return arrived[-1]


def _figures_64() -> dict[str, Any]:
    size, origin, link = 100e9, 1e9 / 8, 10e9 / 8  # 100 GB, a 1 Gb/s origin, 10 Gb/s between hosts
    chunk, hop = 1 << 20, 0.5e-3
    hosts = 64
    chain = size / origin + (hosts - 1) * (chunk / link + hop)  # each hop lags by one chunk and its delay
    simulated = simulate(hosts, size, origin, link, chunk, hop)
    return {
        "every host from the origin (s)": round(hosts * size / origin),
        "one fetch, then a binomial tree (s)": round(size / origin + math.ceil(math.log2(hosts)) * size / link),
        "relay chain, formula (s)": round(chain),
        "relay chain, simulated (s)": round(simulated),
        "one host alone (s)": round(size / origin),
    }


def run(quick: bool = False) -> dict[str, Any]:
    """Measure the three variants on :data:`HOSTS` ranks and give the 64-host figures."""
    mib, rate_mib, rounds = SIZES["quick" if quick else "full"]
    size, rate = mib * _MiB, rate_mib * _MiB
    measured = measure(size, rate, rounds)
    times = measured["times"]
    rows: list[dict[str, Any]] = []
    for v in VARIANTS:
        ratios = [t / a for t, a in zip(times[v], times["alone"], strict=True)]
        rows.append(
            {
                "label": f"{HOSTS} hosts, {v}",
                "variant": v,
                "last copy (s)": round(statistics.median(times[v]), 2),
                "vs alone": round(statistics.median(ratios), 3),
                "origin bytes / file": round(measured["origin"][v] / size, 3),
            }
        )
    figures = _figures_64()
    rows += [{"label": f"64 hosts, {k}", "variant": k, "last copy (s)": v} for k, v in figures.items()]
    relayed, each = rows[2], rows[1]
    summary = (
        f"{mib} MiB from an origin paced at {rate_mib:g} MiB/s, {HOSTS} hosts (gloo ranks, a directory each), "
        f"{rounds} rounds: the last relayed copy {relayed['vs alone']}x the time one host alone needs (goal <= "
        f"1.25x), every host fetching for itself {each['vs alone']}x; the origin sent {relayed['origin bytes / file']}"
        f"x the file relayed, {each['origin bytes / file']}x otherwise. 100 GB on 64 hosts (1 Gb/s origin, 10 Gb/s "
        f"links, 1 MiB chunks, 0.5 ms a hop): relayed {figures['relay chain, formula (s)']} s by the formula and "
        f"{figures['relay chain, simulated (s)']} s simulated, one host alone "
        f"{figures['one host alone (s)']} s, every host from the origin {figures['every host from the origin (s)']} s, "
        f"one fetch then a tree {figures['one fetch, then a binomial tree (s)']} s."
    )
    return {
        "title": "One fetch per job: relayed copies vs every host fetching",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "rows": rows,
        "summary": summary,
    }


if __name__ == "__main__":
    print_result(run(quick="--quick" in sys.argv[1:]))
