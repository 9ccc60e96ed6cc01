"""Shared fixtures: a per-test scratch directory that the child processes of a world can use."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _quiet_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    # Several worlds of 4 ranks share 2 cores: one intra-op thread each keeps them from thrashing.
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
