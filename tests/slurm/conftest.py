"""Fixtures of the Slurm tests: one Slurm node, and two on simulated hosts, for the session (``tests._slurm``),
skipped with the reason where they cannot be made; every test's jobs are cancelled when it ends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import _hosts
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


@pytest.fixture(scope="session")
def slurm_two_nodes_bed() -> Iterator[SlurmBed]:
    """Two Slurm nodes, each a simulated host (``tests._hosts``), stopped and removed when the session ends."""
    reason = unavailable() or _hosts.unavailable()
    if reason:
        pytest.skip(reason)
    with SlurmBed(hosts=2) as bed:
        yield bed


@pytest.fixture
def slurm_two_nodes(slurm_two_nodes_bed: SlurmBed) -> Iterator[SlurmBed]:
    """The session's two Slurm nodes; the test's jobs are cancelled when it ends, whatever happened."""
    yield slurm_two_nodes_bed
    slurm_two_nodes_bed.cancel()
