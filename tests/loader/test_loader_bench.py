"""`dlo bench loader` end to end on a small checkpoint (moto here; the benchmark uses ministack)."""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import pytest
from dlo_bench import loader as bench
from dlo_bench.loader_runs import write_checkpoint
from dlo_bench.s3server import S3Server
from dlo_contract.safetensors_header import read_header

pytestmark = pytest.mark.usefixtures("aws_env")


def test_synthetic_checkpoint_is_valid_safetensors(tmp_path: Path) -> None:
    digests = write_checkpoint(tmp_path, 3 << 20, 3)
    assert sorted(digests) == [f"model-0000{i}-of-00003.safetensors" for i in range(3)]
    for name in digests:
        header = read_header(tmp_path / name, name)
        end = header.data_start + header.tensors[0].end
        assert end == (tmp_path / name).stat().st_size == 1 << 20
        assert header.data_start % 8 == 0


def test_report_checks_correctness_and_names_the_ratio(s3: S3Server, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--size-mib", "2", "--files", "2", "--chunk-bytes", "262144",
                              "--readers", "4", "--repeats", "1"])
    report = bench.measure(args, s3, tmp_path)
    assert report["correct"] is True
    assert report["store_checksums"] == "all"  # the fill did the check it does for users
    assert report["parameters"] == {"bytes": 2 << 20, "files": 2, "chunk_bytes": 262144,
                                    "readers": 4, "repeats": 1, "server": "moto",
                                    "server_python": platform.python_version(),
                                    "world_size": 1}
    assert report["fill_to_ceiling_ratio"] == pytest.approx(
        report["fill_bytes_per_s"] / report["ceiling_bytes_per_s"], rel=1e-3)
    assert len(report["fill_seconds"]) == len(report["ceiling_seconds"]) == 1
    bound = min(report["ceiling_bytes_per_s"], report["disk_write_bytes_per_s"])
    assert report["fill_to_bound_ratio"] == pytest.approx(
        report["fill_bytes_per_s"] / bound, rel=1e-3)
    assert {"commit", "machine", "disk_write_bytes_per_s"} <= set(report)
    cpu = report["cpu_seconds_per_gib"]
    assert set(cpu) == {"ceiling", "disk", "fill"}
    # Both processes work to move the bytes; the disk probe asks nothing of the server.
    for kind in ("ceiling", "fill"):
        assert cpu[kind]["client"] > 0 and cpu[kind]["server"] > 0, cpu
    assert cpu["disk"]["client"] > 0 and cpu["disk"]["server"] < cpu["fill"]["server"], cpu
    host = report["host_cpu"]
    assert set(host) == {"ceiling", "disk", "fill"}
    for shares in host.values():  # each run's shares of the machine's CPU time, where a run
        if shares is not None:  # lasted a clock tick (this tiny disk probe may not)
            assert set(shares) == {"busy", "idle", "steal"}
            assert sum(shares.values()) == pytest.approx(1, abs=0.01)
    assert host["fill"]["busy"] > 0  # a fill works for far longer than a tick


def test_a_fill_that_publishes_wrong_bytes_is_reported_as_incorrect(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_fill = bench.fill

    def corrupting_fill(request: object) -> object:
        """The real fill, then one byte of the first published file flipped."""
        result = real_fill(request)
        victim = sorted(Path(result.path).glob("*.safetensors"))[0]
        victim.chmod(0o644)
        with victim.open("r+b") as handle:
            handle.seek(-1, 2)
            last = handle.read(1)
            handle.seek(-1, 2)
            handle.write(bytes([last[0] ^ 1]))
        return result

    monkeypatch.setattr(bench, "fill", corrupting_fill)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--size-mib", "1", "--files", "1", "--chunk-bytes", "262144",
                              "--readers", "2", "--repeats", "1"])
    assert bench.measure(args, s3, tmp_path)["correct"] is False
