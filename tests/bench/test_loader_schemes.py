"""`dlo bench loader --schemes`: the same checkpoint through each scheme's local server in one
run, each fill checked against the source's digests and set against its own server's ceiling."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from dlo_bench import loader_schemes
from dlo_bench.emulators import AZURITE_BLOB
from dlo_bench.loader_runs import write_checkpoint
from dlo_cli import main as cli

pytestmark = pytest.mark.slow
SCHEMES = ["s3", "file", "https", "hf", "gs"] + (["az"] if AZURITE_BLOB.exists() else [])


@pytest.fixture(scope="module")
def report(ministack: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """`dlo bench loader --schemes ... --json` as the command runs it; its report."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["bench", "loader", "--schemes", ",".join(SCHEMES), "--size-mib", "2",
                         "--files", "2", "--chunk-bytes", "262144", "--readers", "4",
                         "--repeats", "2", "--ministack", str(ministack), "--work-dir",
                         str(tmp_path_factory.mktemp("bench")), "--json"])
    assert code == 0, out.getvalue()[-3000:]
    return json.loads(out.getvalue().strip().splitlines()[-1])


def test_every_scheme_fills_the_same_bytes_correctly(report: dict) -> None:
    assert report["correct"] is True
    assert [row["scheme"] for row in report["schemes"]] == SCHEMES
    assert report["parameters"] == {"bytes": 2 << 20, "files": 2, "chunk_bytes": 262144,
                                    "readers": 4, "repeats": 2, "world_size": 1}
    assert {"commit", "machine", "same_entry_id", "disk_write_bytes_per_s"} <= set(report)


def test_each_row_sets_its_fill_against_its_own_server_s_ceiling(report: dict) -> None:
    for row in report["schemes"]:
        assert len(row["fill_seconds"]) == len(row["ceiling_seconds"]) == 2, row["scheme"]
        assert row["fill_to_ceiling_ratio"] == pytest.approx(
            row["fill_bytes_per_s"] / row["ceiling_bytes_per_s"], rel=1e-3), row["scheme"]


def test_stores_with_checksums_are_checked_and_a_share_has_none(report: dict) -> None:
    checked = {row["scheme"]: row["store_checksums"] for row in report["schemes"]}
    assert checked == {scheme: "none" if scheme == "file" else "all" for scheme in SCHEMES}


def test_the_https_server_serves_a_copy_with_its_listing_and_leaves_the_source_alone(
        tmp_path: Path) -> None:
    source = tmp_path / "source"
    write_checkpoint(source, 1 << 20, 1)
    before = sorted(p.name for p in source.iterdir())
    with loader_schemes._child_server("https", source) as urls:
        assert urls["url"].startswith("http://127.0.0.1:")
    assert sorted(p.name for p in source.iterdir()) == before
    assert (tmp_path / "www" / "dlo-listing.json").is_file()


def test_each_row_is_also_set_against_the_disk(report: dict) -> None:
    for row in report["schemes"]:
        bound = min(row["ceiling_bytes_per_s"], report["disk_write_bytes_per_s"])
        assert row["fill_to_bound_ratio"] == pytest.approx(row["fill_bytes_per_s"] / bound,
                                                           rel=1e-3), row["scheme"]
