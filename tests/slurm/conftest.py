"""Fixtures of the Slurm tests: one Slurm node for the session (``tests._slurm``), skipped with the reason where
it cannot be made; every test's jobs are cancelled when it ends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests._slurm import SlurmBed, unavailable


@pytest.fixture(scope="session")
def slurm_bed() -> Iterator[SlurmBed]:
    """A Slurm node on this machine (munged, slurmctld, slurmd), stopped and removed when the session ends."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with SlurmBed() as bed:
        yield bed


@pytest.fixture
def slurm(slurm_bed: SlurmBed) -> Iterator[SlurmBed]:
    """The session's Slurm node; the test's jobs are cancelled when it ends, whatever happened."""
    yield slurm_bed
    slurm_bed.cancel()
