"""The download benchmark keeps its contract and shows one fetch for ours, one per process for the peers."""

from __future__ import annotations

import pytest

from benchmarks import bench_download


@pytest.mark.distributed
def test_benchmark_contract_and_bytes_served(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(bench_download.SIZES_MB, "quick", (2, 20))
    monkeypatch.setattr(bench_download, "REPEATS", 1)
    monkeypatch.setattr(bench_download, "PROCS", 3)
    result = bench_download.run(quick=True)
    assert bench_download.NAME == "download"
    assert {"title", "machine", "rows", "summary", "plot"} <= set(result)
    rows = result["rows"]
    assert {result["plot"]["x"], *result["plot"]["y"]} <= set(rows[0])
    ours, *peers = rows
    assert ours["method"] == "ignite_ext download_url"
    assert ours["bytes_served_x"] == 1.0 and ours["failed_processes"] == 0 and ours["final_file_ok"]
    assert [p["bytes_served_x"] for p in peers] == [3.0, 3.0]
