"""The scale model: its floors, and the table it writes from measured results."""

from __future__ import annotations

import json
from pathlib import Path

from dlo_bench import scale_model

MEASURED = {"store_link_efficiency": 1.0, "peer_link_efficiency": 1.0, "fixed_seconds": 2.0,
            "fixed_seconds_at_nodes": 8, "local_bytes_per_s": 10e9}


def test_all_gather_exchange_is_flat_in_n_and_the_broadcast_grows_with_it() -> None:
    a = scale_model.ASSUMPTIONS
    gather = [scale_model.terms(n, "all_gather", a, MEASURED)["exchange"] for n in (16, 256)]
    broadcast = [scale_model.terms(n, "broadcast", a, MEASURED)["exchange"] for n in (16, 256)]
    assert gather[1] < 1.07 * gather[0]  # (N-1)/N of the model at any N
    assert broadcast[1] / broadcast[0] == 255 / 15  # (N-1) copies on the busiest link


def test_independent_mode_hits_the_request_rate_at_256_nodes() -> None:
    row = scale_model.row(256, scale_model.ASSUMPTIONS, MEASURED)
    assert row["independent_bound_by"] == "requests"
    assert row["all_gather_bound_by"] == "nic" and row["broadcast_bound_by"] == "exchange"


def test_table_is_written_from_the_benchmarks_results(tmp_path: Path) -> None:
    cluster = {"link_probe": {"store_link_efficiency": 0.9, "peer_link_efficiency": 0.8},
               "results": [{"nodes": 8, "multi_reader_s": 4.0, "bound_s": 3.0}]}
    (tmp_path / "cluster.json").write_text(json.dumps({"by_peer_ratio": {"10": cluster}}))
    (tmp_path / "loader.json").write_text(json.dumps({
        "parameters": {"bytes": 4e9}, "disk_write_bytes_per_s": 3e9,
        "stage_seconds": [{"digest": 2.0}, {"digest": 1.0}]}))
    assert scale_model.main(["--results", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "scale.json").read_text())
    assert report["measured"]["fixed_seconds"] == 1.0
    assert report["measured"]["local_bytes_per_s"] == 3e9  # the disk: digests ran at 4 GB/s
    assert [r["nodes"] for r in report["rows"]] == list(scale_model.NODES)
    assert (tmp_path / "scale.md").read_text().startswith("| nodes | broadcast exchange |")
