"""The cache-peers benchmark keeps its contract on a tiny run: every variant, both rank counts, the checks it makes.

It runs in the cache peers' environment (``scripts/cache_peers_env.sh``, created by ``scripts/test.sh``'s cache
peers step); this test never creates it (no download during the tests) and skips, naming why, when it is missing.
"""

from __future__ import annotations

import os

import pytest

from benchmarks import bench_cache_peers


@pytest.fixture(scope="module")
def peers_python() -> str:
    failed = os.environ.get("IGNITE_EXT_CACHE_PEERS_FAILED")
    if failed:
        pytest.skip(f"the cache peers' environment could not be made: {failed}")
    python, why_not = bench_cache_peers.peers_python(create=False)
    if python is None:
        pytest.skip(f"NO CACHE PEERS ENVIRONMENT, the LitData/Mosaic benchmark is not checked: {why_not}")
    return python


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_benchmark_contract_on_a_tiny_run(peers_python: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(bench_cache_peers.SIZES, "quick", ((64 << 10, 32),))
    monkeypatch.setitem(bench_cache_peers.EPOCHS, "quick", 2)
    monkeypatch.setattr(bench_cache_peers, "RAM_EPOCHS", 1)
    result = bench_cache_peers.run(quick=True, python=peers_python)  # raises if an epoch missed a sample
    assert bench_cache_peers.NAME == "cache_peers"
    assert {"title", "machine", "rows", "summary", "plot"} <= set(result)
    rows = {(r["ranks"], r["variant"]): r for r in result["rows"]}
    assert set(rows) == {(k, v) for k in (1, 2) for v in bench_cache_peers.VARIANTS}
    assert {result["plot"]["x"], *result["plot"]["y"]} <= set(result["rows"][0])
    for ranks in (1, 2):
        base = rows[ranks, "in-memory"]
        assert base["vs_in_memory"] == 1.0 and base["RAM_vs_in_memory"] == 1.0 and base["peak_PSS_vs_in_memory"] == 1.0
        assert base["peak_ranks_vs_in_memory"] == 1.0
        # The baseline is a user's plain in-memory dataset: nothing of the package froze its heap.
        assert base["rank_frozen_objects"] == 0
        # A rank that made a CachedDataset froze its heap at its workers' fork (ignite_ext.data.fork_memory).
        assert rows[ranks, "CachedDataset"]["rank_frozen_objects"] > 0
        for variant in bench_cache_peers.VARIANTS:
            row = rows[ranks, variant]
            assert row["samples_per_s"] > 0 and row["first_epoch_s"] > 0
            assert row["RAM_MiB"] >= row["PSS_MiB"] > row["workers_MiB"] > 0
            # Sampled during the epoch (a tiny one may end before its workers are seen): the ranks at least.
            assert row["peak_PSS_MiB"] > row["peak_workers_MiB"] >= 0 and row["peak_PSS_MiB"] > 0
            # The total at the peak is the ranks' part plus the workers' (each rounded to a MiB).
            assert abs(row["peak_PSS_MiB"] - row["peak_ranks_MiB"] - row["peak_workers_MiB"]) <= 1
            assert row["peak_ranks_MiB"] > 0 and row["peak_ranks_vs_in_memory"] > 0
            assert 0 < row["ranks_PSS_MiB"] < row["PSS_MiB"]
            # Counted in nanoseconds: an epoch of 32 in-memory samples can cost less than one 10 ms clock tick.
            assert row["cpu_us_per_sample"] > 0 and row["cpu_vs_in_memory"] > 0
    # The data of the in-memory baseline is the sample itself; the cache's reads are copies or private views.
    assert rows[1, "in-memory"]["in_place_write"] == "later reads see the write"
    assert rows[1, "CachedDataset"]["in_place_write"] == "later reads unchanged"
    # Mosaic's and LitData's files are read through the page cache, the cache's shared memory is mapped.
    assert rows[1, "CachedDataset"]["page_cache_MiB"] <= 1
    assert "Goals, on one rank and on two" in result["summary"] and "the ranks alone" in result["summary"]
