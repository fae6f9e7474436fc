"""The demo's verdict: what counts as identical, which figures fail it, and the exit status that
follows. Pure functions, called directly; no process is started."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest
import torch

from dlo_bench import demo
from dlo_bench.demo_report import (
    build_report, compare_outputs, format_report, loader_problems, runtime_problems,
)
from dlo_cli import main as cli

MODEL_BYTES = 3_000_000


def loader(rank: int, from_store: int, entry: str = "e1") -> dict[str, Any]:
    return {"status": "ok", "entry_id": entry, "mode": "multi-reader", "rank": rank,
            "world_size": 3, "bytes_from_store": from_store, "bytes_from_peers": 0,
            "bytes_to_peers": 0, "seconds": 1.0, "cached": False}


def rank(number: int, *, identical: bool = True, backing: str = "checkpoint") -> dict[str, Any]:
    run = {"pss_start_bytes": 100 << 20, "pss_bytes": 120 << 20, "step_s": [0.01, 0.02]}
    return {"rank": number, "weightless": backing == "checkpoint", "backing": backing,
            "offloaded": {**run, "backing": backing, "weightless": True}, "resident": run,
            "identical": identical, "max_abs_diff": 0.0 if identical else 2.5e-07}


def report(ranks: list[dict[str, Any]], loaders: list[dict[str, Any]] | None = None) -> dict:
    loaders = loaders or [loader(0, 1_000_000), loader(1, 1_000_000), loader(2, 1_000_000)]
    model = {"class": "FluxTransformer2DModel", "layers": 4, "head_dim": 16, "files": 3,
             "bytes": MODEL_BYTES, "source": "s3://dlo-demo/flux-tiny/"}
    served = {"ranks": 2, "image": "dlo-demo.png", "size": [64, 64], "bytes": 9000, "steps": 2,
              "ready_s": 3.0, "latency_s": 0.25}
    return build_report(model=model, loaders=loaders, ranks=ranks, served=served, steps=2,
                        seconds=12.34)


def test_equal_tensors_are_identical() -> None:
    latents = torch.randn(1, 16, 4)
    comparison = compare_outputs(latents, latents.clone())
    assert comparison.identical
    assert comparison.max_abs_diff == 0.0


def test_one_ulp_in_one_element_is_a_difference() -> None:
    resident = torch.ones(1, 16, 4)
    offloaded = resident.clone()
    offloaded[0, 3, 1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    comparison = compare_outputs(resident, offloaded)
    assert not comparison.identical
    assert comparison.max_abs_diff == pytest.approx(2.0 ** -23)


def test_other_shape_or_dtype_is_a_difference() -> None:
    resident = torch.zeros(1, 16, 4)
    assert not compare_outputs(resident, torch.zeros(1, 16, 5)).identical
    assert not compare_outputs(resident, torch.zeros(1, 16, 4, dtype=torch.float64)).identical


def test_a_complete_run_is_ok_and_says_identical() -> None:
    result = report([rank(0), rank(1)])
    assert result["status"] == "ok"
    assert result["problems"] == []
    assert result["bytes_from_store_total"] == MODEL_BYTES
    text = format_report(result)
    assert "outputs: identical (offloaded vs resident, bit for bit, every rank)" in text
    assert "  node1: 1.0 MiB from S3, 0.0 MiB from peers, 0.0 MiB to peers, 1.0 s" in text
    assert ("  rank0 offloaded: PSS 120.0 MiB (+20.0 MiB since start), median step 15.0 ms, "
            "backing checkpoint") in text
    assert ("served: one 64x64 PNG through `dlo serve` (2 ranks, AllGather), POST "
            "/v1/images/generations in 0.25 s, saved to dlo-demo.png") in text
    assert text.endswith("result: ok in 12 s")


def test_one_differing_rank_fails_the_demo() -> None:
    result = report([rank(0), rank(1, identical=False)])
    assert result["status"] == "failed"
    assert result["identical"] is False
    assert result["problems"] == [
        "rank 1: offloaded output differs from the resident output (max abs diff 2.5e-07)"]
    assert "outputs: DIFFERENT" in format_report(result)


def test_a_dit_not_served_from_the_entry_fails_the_demo() -> None:
    assert runtime_problems([rank(0, backing="ordinary")]) == [
        "rank 0: the DiT was not served from the mapped entry "
        "(weightless=False, backing=ordinary)"]


def test_loaders_must_read_the_model_exactly_once_from_the_store() -> None:
    twice = [loader(0, MODEL_BYTES), loader(1, MODEL_BYTES), loader(2, 0)]
    assert loader_problems(twice, MODEL_BYTES) == [
        f"loaders read {2 * MODEL_BYTES} bytes from S3 in all; the model has {MODEL_BYTES} "
        "bytes and multi-reader mode reads each byte once"]


def test_loaders_must_agree_on_the_entry() -> None:
    split = [loader(0, MODEL_BYTES), loader(1, 0, entry="e2"), loader(2, 0)]
    assert loader_problems(split, MODEL_BYTES) == ["loaders filled different entries: e1, e2"]


def test_a_failed_loader_is_reported_with_its_error() -> None:
    failed = {"status": "error", "rank": 2, "error": "rendezvous timed out"}
    assert loader_problems([loader(0, MODEL_BYTES), loader(1, 0), failed], MODEL_BYTES) == [
        "loader 2: rendezvous timed out"]


def test_run_exits_non_zero_on_a_mismatch(monkeypatch: pytest.MonkeyPatch, capsys,
                                          tmp_path) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    monkeypatch.setattr(demo, "_demo", lambda *args: report([rank(0, identical=False), rank(1)]))
    args = argparse.Namespace(steps=1, keep=False, json=True)
    assert demo.run(args) == 1
    out = capsys.readouterr().out.splitlines()
    assert "outputs: DIFFERENT (offloaded vs resident, bit for bit, every rank)" in out
    assert json.loads(out[-1])["status"] == "failed"
    assert list(tmp_path.iterdir()) == []  # the work directory is gone


def test_steps_must_be_positive(capsys) -> None:
    assert cli.main(["demo", "--steps", "0"]) == 1
    assert capsys.readouterr().err == "dlo: error: --steps=0 must be 1 or more\n"
