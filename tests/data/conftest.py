"""Fixtures of the data tests: a fault-injecting loopback HTTP server, and a short retry backoff."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from benchmarks.http_server import TestHTTPServer
from ignite_ext.data.download._http import BACKOFF_ENV


@pytest.fixture
def server() -> Iterator[TestHTTPServer]:
    with TestHTTPServer() as s:
        yield s


@pytest.fixture(autouse=True)
def _fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKOFF_ENV, "0.01")
