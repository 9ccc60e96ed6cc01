"""The failure-cost benchmark's contract on a tiny run, under torchrun and a Slurm requeue on the test's Slurm node.

The package's restarted attempt reads from storage only the samples its cache checks; plain ignite's reads every
sample again where its group re-forms (torch's own gloo re-forming may fail under torchrun: then no batch).
"""

from __future__ import annotations

import pytest

from benchmarks.bench_failure_cost import SAMPLES, run
from tests._slurm import SlurmBed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_the_failure_cost_benchmark_measures_each_launcher(slurm: SlurmBed) -> None:
    result = run(quick=True, env=slurm.job_env())
    rows = {row["label"]: row for row in result["rows"]}
    n = SAMPLES["quick"]
    launchers, variants = ("torchrun", "slurm requeue"), ("package", "plain ignite")
    assert sorted(rows) == sorted(f"{launcher}, {variant}" for launcher in launchers for variant in variants)
    for launcher in launchers:
        package = rows[f"{launcher}, package"]
        assert package["restarted"] == "1 of 1" and package["seconds to the restarted first batch"] > 0, package
        assert package["storage reads, restarted epoch"] < n // 10, package  # the cache's checks only
    plain = rows["slurm requeue, plain ignite"]
    assert plain["restarted"] == "1 of 1" and plain["storage reads, restarted epoch"] == n, plain
    assert result["summary"].count("read again") == 4
