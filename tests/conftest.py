"""The one multi-process harness of the test suite: the ``world`` fixture, and the ``distributed`` mark it implies.

``world`` is a 4-rank gloo world on one node unless a test parametrises it (indirectly) with other worlds:
``tests._world.BACKENDS`` (serial, gloo-4, gloo-2x2, horovod-4, xla-1, nccl) or ``tests._world.CHANNELS``
(serial, store, collective). ``world(fn, *args, **options)`` returns every rank's value, ``world.results(...)``
every rank's :class:`~tests._world.RankResult`; see :class:`~tests._world.World` for the options.

Every test that uses a world other than the serial one is marked ``distributed`` at collection, so
``pytest -m "not distributed"`` starts no world. Tests that start processes by other means carry the mark
themselves; a test without it that starts a process through :mod:`multiprocessing` (a world, DataLoader workers,
helper processes) fails.
"""

from __future__ import annotations

import json
import multiprocessing.process
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._lanes import (  # noqa: F401 (hooks, found here by pytest)
    pytest_addoption,
    pytest_configure,
    pytest_report_collectionfinish,
    pytest_runtest_logreport,
    pytest_sessionfinish,
    select,
)
from tests._world import DEFAULT_WORLD, LaunchedWorld, World, make_world

WORLD_REPORT_ENV = "IGNITE_EXT_WORLD_REPORT"  # tests/test_harness.py: where to write what was selected

# torch's store client looks up the name of the address it connects to (a reverse DNS query for 127.0.0.1), and a
# resolver that loses UDP queries when many are sent at once (as this test machine's does) stalls that connect for
# glibc's 5 s timeout, once or twice: longer than the tests' heartbeat timeouts of 2-3 s (the default, 10 s, is
# what users run). The suite's processes ask over TCP instead (glibc's RES_OPTIONS, inherited by every process the
# suite starts), unless the environment says otherwise: this machine's resolver does not answer over TCP, so a
# lookup that /etc/hosts cannot answer fails at once, which the tests' loopback and namespace addresses never need
# (a test that installs from the package index drops it). docs/testing.rst explains it.
os.environ.setdefault("RES_OPTIONS", "use-vc")


def world_of(item: pytest.Item) -> str | None:
    """The world a collected test runs in: None without the ``world`` fixture, else its param."""
    if "world" not in getattr(item, "fixturenames", ()):
        return None
    callspec = getattr(item, "callspec", None)
    return str(callspec.params["world"]) if callspec is not None and "world" in callspec.params else DEFAULT_WORLD


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects: the mark added here counts
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if world_of(item) not in (None, "serial"):
            item.add_marker(pytest.mark.distributed)
    select(config, items)


_deselected: list[pytest.Item] = []


def pytest_deselected(items: list[pytest.Item]) -> None:
    _deselected.extend(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    report = os.environ.get(WORLD_REPORT_ENV)
    if report:
        collected = [(item, True) for item in session.items] + [(item, False) for item in _deselected]
        Path(report).write_text(
            json.dumps(
                [
                    {
                        "nodeid": item.nodeid,
                        "selected": selected,
                        "world": world_of(item),
                        "distributed": item.get_closest_marker("distributed") is not None,
                    }
                    for item, selected in collected
                ]
            )
        )


@pytest.fixture(autouse=True)
def _quiet_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    # Several worlds of 4 ranks share 2 cores: one intra-op thread each keeps them from thrashing.
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))


class ProcessOutsideDistributedTest(RuntimeError):
    """A test without the ``distributed`` mark tried to start a process."""


@pytest.fixture(autouse=True)
def _one_process_unless_distributed(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("distributed") is not None:
        return

    def refuse(process: Any) -> None:
        raise ProcessOutsideDistributedTest(
            f"{request.node.nodeid} starts a process ({process!r}) but is not marked distributed: "
            'under pytest -m "not distributed" every test runs in the pytest process alone. Use the world '
            "fixture, or mark the test @pytest.mark.distributed."
        )

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


@pytest.fixture(scope="module")
def _launched_worlds() -> Iterator[dict[str, LaunchedWorld]]:
    # Per module, not per session: an idle Horovod world spins (its background threads poll), and kept until the
    # session's end it took a core from every later test. A module that needs one again starts it again.
    worlds: dict[str, LaunchedWorld] = {}
    yield worlds
    for w in worlds.values():
        w.close()


@pytest.fixture
def world(request: pytest.FixtureRequest, _launched_worlds: dict[str, LaunchedWorld]) -> World:
    """Run module-level functions on every rank of a world: 4 gloo ranks on one node unless parametrised."""
    return make_world(str(getattr(request, "param", DEFAULT_WORLD)), _launched_worlds)
