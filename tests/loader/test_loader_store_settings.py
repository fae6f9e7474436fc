"""What `dlo cache fill` hands the object store, seen from outside the store: the settings
document's stall timeout decides when a silent body is asked for again, and every retry is
counted in `dlo_loader_store_retries_total` under its reason (the operator's live progress and
the README's metrics read them)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from dlo_bench.faultproxy import STALL, FaultPlan, FaultProxy
from dlo_bench.s3server import S3Server
from dlo_loader import cli, metrics
from support.loader_fleet import LOADER_SETTINGS, Checkpoint, entry_files, included

pytestmark = pytest.mark.usefixtures("aws_env")
RETRIES = "dlo_loader_store_retries_total"


def retries() -> dict[str, float]:
    """The retry counter by reason (the process's registry: one fill per process)."""
    return {reason: metrics.REGISTRY.get_sample_value(RETRIES, {"reason": reason}) or 0.0
            for reason in metrics.RETRY_REASONS}


def fill_through(proxy: FaultProxy, checkpoint: Checkpoint, tmp_path: Path,
                 **settings: object) -> int:
    """`dlo cache fill` of `checkpoint` through `proxy`, its settings in the document."""
    config = tmp_path / "settings.json"
    config.write_text(json.dumps({"loader": {**LOADER_SETTINGS, "metrics_port": 0, **settings}}))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.run(parser.parse_args([
        "--config", str(config), "--source", checkpoint.source, "--endpoint-url", proxy.url,
        "--cache-root", str(tmp_path / "cache"), "--entry-file", str(tmp_path / "entry.json"),
        "--summary-file", str(tmp_path / "termination-log")]))


def test_the_documents_stall_timeout_reaches_the_store(
        s3: S3Server, checkpoint: Checkpoint, tmp_path: Path) -> None:
    """The body goes silent for 20 s after half its bytes; with `stall_timeout_s` 0.5 the read is
    abandoned and asked again, counted as one stalled retry. The default (30 s) would wait the
    silence out and count nothing."""
    before = retries()
    with FaultProxy(s3.endpoint_url, FaultPlan(kinds=(STALL,), limit=1, stall_s=20.0)) as proxy:
        code = fill_through(proxy, checkpoint, tmp_path, stall_timeout_s=0.5)
    assert code == 0
    assert proxy.faults[STALL] == 1
    after = retries()
    assert {r: after[r] - before[r] for r in after if after[r] != before[r]} == {"stalled": 1}
    assert entry_files(tmp_path / "cache") == included(checkpoint.files)


def test_every_retry_is_counted_under_its_reason(
        s3: S3Server, checkpoint: Checkpoint, tmp_path: Path) -> None:
    """A 503 SlowDown, a 500 InternalError and a truncated body, one read each: three retries,
    one per reason, and the fill completes."""
    before = retries()
    plan = FaultPlan(kinds=("slowdown", "internal", "truncate"), limit=3)
    with FaultProxy(s3.endpoint_url, plan) as proxy:
        code = fill_through(proxy, checkpoint, tmp_path)
    assert code == 0
    assert sum(proxy.faults.values()) == 3
    after = retries()
    assert {r: after[r] - before[r] for r in after if after[r] != before[r]} == {
        "throttled": 1, "server_error": 1, "short_body": 1}
    assert entry_files(tmp_path / "cache") == included(checkpoint.files)
