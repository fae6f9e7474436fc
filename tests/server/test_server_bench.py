"""`dlo bench serve` end to end, reduced: both server modes answer every request with the
direct resident pipeline's image, exit 0 on SIGTERM, and the JSON carries the figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_serve_reports_rates_and_latencies_of_identical_images() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dlo_cli.main", "bench", "serve", "--requests", "3",
         "--concurrency", "2", "--steps", "2,3", "--layers", "2", "--head-dim", "16", "--json"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["identical"] is True
    for mode in ("direct_resident", "resident", "offloaded"):
        figures = result[mode]
        assert figures["requests_per_s"] > 0 and 0 < figures["p50_s"] <= figures["p99_s"]
    assert result["resident"]["exit_status"] == result["offloaded"]["exit_status"] == 0
    assert result["idle_rank"]["idle_to_job_step_ratio"] > 0
    assert "images equal to the direct resident pipeline's: yes (offloaded server)" in done.stdout
