"""Fixtures of the multi-host tests: simulated hosts (``tests._hosts``), skipped with the reason where impossible."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from tests._hosts import HostBed, unavailable


def make_bed(request: pytest.FixtureRequest, where: Path, n: int, shared_at: Sequence[str | None] = ()) -> HostBed:
    """A bed of ``n`` hosts sharing ``where/shared``, closed when ``request``'s scope ends, whatever happened.

    Skips the test, with the reason, where hosts cannot be simulated.
    """
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    (where / "shared").mkdir()
    bed = HostBed(n, where / "shared", where / "logs", shared_at=shared_at)
    request.addfinalizer(bed.close)
    return bed


@pytest.fixture
def bed2(request: pytest.FixtureRequest, tmp_path: Path) -> HostBed:
    """Two simulated hosts."""
    return make_bed(request, tmp_path, 2)


@pytest.fixture
def bed3(request: pytest.FixtureRequest, tmp_path: Path) -> HostBed:
    """Three simulated hosts."""
    return make_bed(request, tmp_path, 3)
