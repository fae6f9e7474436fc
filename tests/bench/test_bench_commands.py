"""Every `dlo bench` command, in each of its modes, run once through the `dlo` command table on
a small model: a command that crashes fails here, not on the next person who runs it. Each run
is checked as the benchmark checks itself (outputs equal, entries byte-identical to the source:
its exit status) and by the figures its report must hold; no timing is asserted (the figures
live in bench/results). The runs of `dlo bench loader --schemes`, `dlo demo`, `dlo bench
cluster --kill-at` and the default `dlo bench runtime` are `test_loader_schemes`', `test_demo`'s,
`test_cluster_bench`'s and `test_runtime_bench`'s."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from dlo_cli import main as cli

pytestmark = pytest.mark.slow
MIB = 1 << 20
CLUSTER = ("--peer-ratios", "10", "--head-dim", "64", "--chunk-bytes", str(MIB))
"""The smallest cluster runs: one link ratio, a Flux of head width 64 in 1 MiB chunks."""


def dlo_bench(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    """`dlo bench ARGV --json` as the command runs it: exit status 0, and its report (the last
    line)."""
    code = cli.main(["bench", *argv, "--json"])
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_cluster_group_fills(namespaces: None, ministack: Path, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    report = dlo_bench(capsys, "cluster", "--nodes", "2", "--modes", "multi-reader", *CLUSTER,
                       "--ministack", str(ministack), "--out", str(tmp_path))
    (row,) = report["by_peer_ratio"]["10"]["results"]
    assert row["nodes"] == 2 and row["multi_reader_s"] > 0 and row["bound_s"] > 0
    assert json.loads((tmp_path / "cluster.json").read_text()) == report
    assert (tmp_path / "cluster.png").read_bytes()[:4] == b"\x89PNG"


def test_cluster_refill_from_holders(namespaces: None, ministack: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    report = dlo_bench(capsys, "cluster", "--refill-from", "1", "--refill-runs", "1", *CLUSTER,
                       "--ministack", str(ministack))
    assert report["benchmark"] == "cluster_refill"
    figures = report["by_peer_ratio"]["10"]
    (run,) = figures["runs"]
    assert figures["holders"] == 1 and figures["bytes_from_store"] == 0
    assert run["bytes_from_peers"] > 0 and run["fill_s"] > 0


def test_loader_against_its_get_ceiling(ministack: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    report = dlo_bench(capsys, "loader", "--size-mib", "2", "--files", "2", "--chunk-bytes",
                       str(MIB // 4), "--readers", "4", "--repeats", "1", "--ministack",
                       str(ministack))
    assert report["correct"] is True and report["store_checksums"] == "all"
    assert report["parameters"]["bytes"] == 2 * MIB
    assert report["fill_to_ceiling_ratio"] > 0


def test_runtime_host_memory(capsys: pytest.CaptureFixture[str]) -> None:
    report = dlo_bench(capsys, "runtime", "--host-memory", "--processes", "2", "--layers", "2",
                       "--head-dim", "16", "--repeats", "1")
    assert report["params"] == {"processes": 2, "layers": 2, "head_dim": 16, "repeats": 1}
    assert report["model_bytes"] > 0


def test_runtime_compiled(capsys: pytest.CaptureFixture[str]) -> None:
    report = dlo_bench(capsys, "runtime", "--compiled", "--layers", "2", "--head-dim", "16",
                       "--side", "4", "--batch", "1", "--warmup", "0", "--steps", "1",
                       "--rounds", "1", "--no-allgather", "--no-mapped")
    checks = {key: value for key, value in report["figures"].items() if key.endswith("_equal")}
    assert "cpu_dlo_equal" in checks and len(checks) > 1  # the compiled variants' too
    assert all(value is True for value in checks.values()), checks


def test_serve_against_a_resident_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    report = dlo_bench(capsys, "serve", "--ranks", "2", "--requests", "2", "--concurrency", "1",
                       "--steps", "1", "--size", "16", "--layers", "2", "--head-dim", "16")
    assert report


def test_coldstart_against_plain_and_runai(ministack: Path, coldstart_python: Path,
                                           tmp_path: Path) -> None:
    """From `.venv-coldstart`, where runai-model-streamer is: every configuration once."""
    done = subprocess.run(
        [str(coldstart_python), "-m", "dlo_cli.main", "bench", "coldstart", "--small",
         "--rounds", "1", "--ministack", str(ministack), "--model-cache", str(tmp_path / "models"),
         "--work-dir", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["outputs_equal"] is True and report["model"]["name"] == "flux-w64-3blocks-bf16"
    assert set(report["median_total_s"]) == {"dlo", "plain", "runai", "dlo_late", "dlo_warm"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, make gpu-check runs it whole")
def test_gpu_check_without_cuda_says_so(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "gpu-check", "--out", str(tmp_path)]) == 0
    assert "skipped: no CUDA device here" in capsys.readouterr().out
