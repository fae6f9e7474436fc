"""The cold-start benchmark's bookkeeping: the loader's first-GET time from its log, phases as
seconds since each process was spawned, medians, ratios and goals from interleaved rounds."""

from __future__ import annotations

import argparse
from datetime import datetime
from pathlib import Path

from dlo_bench import coldstart


def test_the_transfer_starts_at_the_plan_line() -> None:
    log = ("2026-12-01 05:20:23,081 INFO dlo_loader.fill: [rank 0/1] s3://m/f/: 6 objects\n"
           "2026-12-01 05:20:23,583 INFO dlo_loader.fill: [rank 0/1] plan: multi-reader over 1\n")
    expected = datetime(2026, 12, 1, 5, 20, 23, 583000).timestamp()
    assert coldstart._log_time(log, coldstart._TRANSFER_MARK) == expected
    assert coldstart._log_time("no such line\n", coldstart._TRANSFER_MARK) is None


def test_phases_count_from_the_spawn() -> None:
    spawn = 1.8e9
    marks = {"main": spawn + 0.5, "imported": spawn + 3.0, "forward_start": spawn + 4.0,
             "forward": spawn + 4.25, "weightless": 1.0, "resident_bytes_at_forward": 7}
    assert coldstart._phases(spawn, marks) == {
        "main": 0.5, "imported": 3.0, "forward_start": 4.0, "forward": 4.25, "forward_s": 0.25,
        "weightless": 1.0, "resident_bytes_at_forward": 7}


def run_of(total: float, fill: bool = False) -> dict:
    run = {"total_s": total, "server": {"forward_s": total / 10}}
    if fill:
        run["fill"] = {"wall_s": 2.0, "fill_s": 1.5, "start_to_transfer_s": 0.25,
                       "peak_rss_mib": 300.0}
    return run


def test_ratios_and_goals_come_from_medians_of_the_same_run(tmp_path: Path) -> None:
    bench = object.__new__(coldstart._Bench)
    bench.args = argparse.Namespace(cold="files", rounds=3, torch_threads=1,
                                    runai_concurrency=2, runai_chunk_mib=32, small=False)
    bench.checkpoint = tmp_path
    runs = {"dlo": [run_of(5.0, True), run_of(4.0, True), run_of(9.0, True)],
            "plain": [run_of(6.0), run_of(5.0), run_of(5.5)],
            "runai": [run_of(4.5), run_of(4.4), run_of(4.6)],
            "dlo_late": [run_of(5.5, True)] * 3,
            "dlo_warm": [run_of(3.0, True)] * 3}
    report = bench._report(runs, equal=True)
    assert report["median_total_s"]["dlo"] == 5.0
    assert report["ratios"] == {"dlo/plain": 0.909, "dlo/runai": 1.111, "dlo_warm/plain": 0.545,
                                "dlo_late/plain": 1.0}
    assert {k: g["met"] for k, g in report["goals"].items()} == {
        "dlo/plain": False, "dlo/runai": False, "dlo_warm/plain": True}
    assert report["loader"] == {"start_to_first_get_s_median": 0.25,
                                "process_minus_fill_s_median": 0.5, "peak_rss_mib_max": 300.0}
