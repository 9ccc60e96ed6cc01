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


@pytest.mark.distributed
@pytest.mark.timeout(1800)
def test_ranges_benchmark_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import bench_ranges

    monkeypatch.setitem(bench_ranges.SIZES_MB, "quick", 10)
    monkeypatch.setattr(bench_ranges, "REPEATS", 1)
    monkeypatch.setattr(bench_ranges, "CONN_MBPS", 40)
    result = bench_ranges.run(quick=True)
    assert bench_ranges.NAME == "ranges"
    assert {"title", "machine", "rows", "summary", "plot"} <= set(result)
    rows = {r["method"]: r for r in result["rows"]}
    assert {result["plot"]["x"], *result["plot"]["y"]} <= set(result["rows"][0])
    assert rows["ignite_ext x1"]["speed-up vs 1 connection"] == 1.0
    assert "torch.hub" in rows  # every peer verified what it fetched (the run asserts it)


@pytest.mark.distributed
def test_relay_benchmark_contract_and_origin_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import bench_relay

    monkeypatch.setitem(bench_relay.SIZES, "quick", (2, 4.0, 1))
    result = bench_relay.run(quick=True)
    assert bench_relay.NAME == "relay"
    assert {"title", "machine", "rows", "summary"} <= set(result)
    rows = {r["label"]: r for r in result["rows"]}
    # The origin's own count: once per job relayed, once per host otherwise (the timing is the benchmark's).
    assert rows["3 hosts, relayed"]["origin bytes / file"] == 1.0
    assert rows["3 hosts, each host"]["origin bytes / file"] == 3.0
    assert rows["3 hosts, alone"]["origin bytes / file"] == 1.0
    assert (
        rows["64 hosts, relay chain, simulated (s)"]["last copy (s)"]
        == rows["64 hosts, relay chain, formula (s)"]["last copy (s)"]
    )
