"""The test lanes: the full suite (CI, before a release), and a fast lane that answers in minutes while one works.

``--lane=fast`` (or ``IGNITE_EXT_LANE=fast``) leaves out, by rule:

* the multi-host bed (``tests/hosts``: namespaces, torchrun per host, ``tc``-shaped links);
* the Slurm bed (``tests/slurm``: Slurm's daemons, jobs of seconds each, a requeue, a node cut off);
* the fault sweep's sample (``tests/distributed/test_fault_sweep.py``: real ranks killed at every moment);
* the benchmarks' tests (``test_*benchmark*.py``: the peers' environments, measured runs);
* every other test that took more than :data:`FAST_BUDGET_S` in the last full run recorded in
  ``tests/durations.json`` (a test not recorded there runs: new tests are in the fast lane until measured).

``--record-durations=PATH`` writes each test's time (setup, call and teardown) as JSON, sorted by node id;
``python -m tests._lanes tests/durations.json`` prints the table the testing page shows (``docs/testing.rst``).

Everything stays in the full lane, which the README's test command runs and CI runs on every change.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DURATIONS = ROOT / "tests" / "durations.json"
#: A test recorded slower than this leaves the fast lane (seconds, measured in a full run on two busy cores).
FAST_BUDGET_S = 5.0


def left_out_by_rule(nodeid: str) -> str | None:
    """Why the fast lane leaves ``nodeid`` out whatever its time, or None.

    >>> left_out_by_rule("tests/hosts/test_relay.py::test_x"), left_out_by_rule("tests/test_errors.py::test_y")
    ('the multi-host bed', None)
    """
    path = nodeid.split("::", 1)[0]
    if path.startswith("tests/hosts/"):
        return "the multi-host bed"
    if path.startswith("tests/slurm/"):
        return "the Slurm bed"
    if path == "tests/distributed/test_fault_sweep.py":
        return "the fault sweep"
    if "benchmark" in Path(path).name:
        return "a benchmark"
    return None


def lane_of(nodeid: str, durations: dict[str, float]) -> str:
    """``"fast"`` or why the fast lane leaves it out."""
    why = left_out_by_rule(nodeid)
    if why is not None:
        return why
    if durations.get(nodeid, 0.0) > FAST_BUDGET_S:
        return f"over {FAST_BUDGET_S:.0f} s"
    return "fast"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ignite_ext lanes")
    group.addoption("--lane", choices=["full", "fast"], default=os.environ.get("IGNITE_EXT_LANE", "full"))
    group.addoption("--record-durations", default=None, metavar="PATH")


def select(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the fast lane's items when ``--lane=fast`` (called by ``tests/conftest.py``'s collection hook)."""
    if config.getoption("--lane") != "fast":
        return
    durations = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    kept, left = [], []
    counts: dict[str, int] = defaultdict(int)
    for item in items:
        lane = lane_of(item.nodeid, durations)
        (kept if lane == "fast" else left).append(item)
        counts[lane] += 1
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept
    summary = ", ".join(f"{n} {why}" for why, n in sorted(counts.items()) if why != "fast")
    config.stash[_SUMMARY] = f"fast lane: {len(kept)} tests; left for the full lane: {summary or 'none'}"


_SUMMARY = pytest.StashKey[str]()
_TIMES = pytest.StashKey[dict[str, float]]()


def pytest_report_collectionfinish(config: pytest.Config) -> str | None:
    return config.stash.get(_SUMMARY, None)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    config = _CONFIG.get("config")
    if config is None or config.getoption("--record-durations") is None:
        return
    times = config.stash.setdefault(_TIMES, {})
    times[report.nodeid] = times.get(report.nodeid, 0.0) + report.duration


_CONFIG: dict[str, pytest.Config] = {}


def pytest_configure(config: pytest.Config) -> None:
    _CONFIG["config"] = config


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--record-durations")
    if path is None:
        return
    times = session.config.stash.get(_TIMES, {})
    Path(path).write_text(json.dumps({k: round(v, 2) for k, v in sorted(times.items())}, indent=0) + "\n")


def table(durations: dict[str, float]) -> str:
    """The durations per test module and lane, as the rows of an RST list-table."""
    by_module: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0, 0])
    for nodeid, seconds in durations.items():
        module = nodeid.split("::", 1)[0]
        row = by_module[module]
        fast = lane_of(nodeid, durations) == "fast"
        row[0 if fast else 1] += seconds
        row[2 if fast else 3] += 1
    lines = []
    for module, (fast_s, full_s, fast_n, full_n) in sorted(by_module.items(), key=lambda kv: -(kv[1][0] + kv[1][1])):
        lines += [
            f"   * - ``{module}``",
            f"     - {int(fast_n)} / {fast_s:.0f} s",
            f"     - {int(full_n)} / {full_s:.0f} s",
        ]
    fast_total = sum(r[0] for r in by_module.values())
    full_total = sum(r[1] for r in by_module.values())
    lines += ["   * - all", f"     - {fast_total:.0f} s", f"     - {full_total:.0f} s more"]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(json.loads(Path(sys.argv[1] if len(sys.argv) > 1 else DURATIONS).read_text())))
