"""`dlo bench runtime` reports a wrong offloaded output as wrong: its exit status and message
come from the `_equal` figures, so a backend that corrupts a block fails the benchmark; the
host-memory benchmark fails when any serving process computes a different output."""

from __future__ import annotations

import argparse

import pytest
import torch

from dlo_bench import runtime as bench
from dlo_runtime.transfer import ShardStore

SMALL = ["--layers", "2", "--head-dim", "16", "--side", "4", "--batch", "1", "--warmup", "0",
         "--steps", "1", "--no-allgather"]


def _args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args([*SMALL, *extra])


def test_an_exact_backend_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.run(_args()) == 0
    out = capsys.readouterr().out
    assert "cpu_dlo_equal                                True" in out


def test_a_backend_that_corrupts_a_block_fails_the_benchmark(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    load = ShardStore.load

    def corrupting_load(self: ShardStore, index: int, slot: object) -> None:
        load(self, index, slot)
        flat = next(iter(slot.flats.values()))  # type: ignore[attr-defined]
        flat[0] += torch.ones((), dtype=flat.dtype)

    monkeypatch.setattr(ShardStore, "load", corrupting_load)
    assert bench.run(_args()) == 1
    captured = capsys.readouterr()
    assert "cpu_dlo_equal                                False" in captured.out
    assert captured.err == (
        "bench runtime: outputs differ from the resident model: cpu_dlo_equal\n"
    )


@pytest.mark.slow
def test_the_allgather_check_is_timed_against_a_step_over_two_ranks() -> None:
    """Two gloo ranks: outputs checked exact first, then the lockstep check's figures."""
    from dlo_bench.runtime_lockstep import cpu_lockstep

    figures = cpu_lockstep(_args("--rounds", "1"))
    assert figures["cpu_allgather_equal"] is True
    assert sorted(figures) == [
        "cpu_allgather_check_share_of_step", "cpu_allgather_check_us_per_forward",
        "cpu_allgather_equal", "cpu_allgather_step_ratio_check_on_off", "cpu_allgather_step_us",
    ]


def test_host_memory_fails_when_one_process_computes_another_output() -> None:
    from dlo_bench.host_memory import outputs_agree

    same = {"shared": ["d1", "d1"], "private": ["d1", "d1"]}
    assert outputs_agree(same) is True
    assert outputs_agree({"shared": ["d1", "d1"], "private": ["d1", "d2"]}) is False
    assert outputs_agree({"shared": ["d2", "d1"], "private": []}) is False
    assert outputs_agree({"shared": [], "private": []}) is False
