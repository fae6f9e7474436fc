"""`dlo cache fill --metrics-port`: `/metrics` scraped over HTTP during a moto-backed fill."""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from dlo_bench.s3server import S3Server, free_port
from dlo_loader import cli, metrics
from dlo_loader.progress import Progress
from prometheus_client.parser import text_string_to_metric_families
from support.loader_fleet import LOADER_SETTINGS, Checkpoint
from support.scrape import scrape, value


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.usefixtures("aws_env")
def test_endpoint_serves_the_fill_while_it_runs_and_agrees_with_the_summary(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = free_port()
    scrapes: list[dict] = []

    def print_and_scrape(line: str) -> None:  # the progress lines come while the fill runs
        scrapes.append(scrape(port))

    monkeypatch.setattr(cli, "_print_line", print_and_scrape)
    config = tmp_path / "settings.json"
    config.write_text(json.dumps({"loader": LOADER_SETTINGS}))
    code = cli.run(parse(
        "--config", str(config), "--source", checkpoint.source, "--endpoint-url",
        s3.endpoint_url, "--cache-root", str(tmp_path / "cache"), "--metrics-port", str(port),
        "--entry-file", str(tmp_path / "entry.json"), "--summary-file", str(tmp_path / "log")))
    assert code == 0
    summary = json.loads((tmp_path / "log").read_text())
    assert scrapes, "no scrape happened during the fill"
    last = scrapes[-1]  # the progress line after the exchange: every byte is counted
    assert value(last, "dlo_loader_bytes_from_store_total") == summary["bytes_from_store"] > 0
    assert value(last, "dlo_loader_bytes_from_peers_total") == summary["bytes_from_peers"]
    assert value(last, "dlo_loader_bytes_to_peers_total") == summary["bytes_to_peers"]
    total = value(last, "dlo_loader_bytes_total_bytes")
    assert value(last, "dlo_loader_bytes_done_bytes") == total == summary["bytes_from_store"]
    assert value(last, "dlo_loader_throughput_bytes_per_second") > 0
    assert value(last, "dlo_loader_phase", phase="transferring") == 1
    assert sum(value(last, "dlo_loader_phase", phase=p) for p in metrics.PHASES) == 1
    assert value(last, "dlo_loader_stalled") == 0
    with pytest.raises(urllib.error.URLError):  # served only while the fill runs
        scrape(port)


def test_every_served_metric_is_documented_and_prefixed() -> None:
    families = {name for name, _ in scrape_names() if not name.endswith("_created")}
    assert families == set(metrics.METRICS)
    assert all(name.startswith("dlo_loader_") for name in families)


def scrape_names() -> set[tuple[str, str]]:
    metrics.FILL.attach(Progress(total_bytes=0, prefix=""))
    endpoint = metrics.Endpoint(0, addr="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics") as response:
            text = response.read().decode()
    finally:
        endpoint.close()
    names = set()
    for family in text_string_to_metric_families(text):
        suffix = "_total" if family.type == "counter" else ""
        names.add((family.name + suffix, family.type))
    return names


@pytest.mark.parametrize(("reason", "kind"), [
    ("SlowDown (503)", "throttled"), ("short body: got 3 of 9 bytes", "short_body"),
    ("InternalError (500)", "server_error"), ("ConnectionResetError: reset", "connection"),
    ("something new", "other"),
])
def test_retry_reasons_are_a_few_classes(reason: str, kind: str) -> None:
    assert metrics.retry_reason(reason) == kind


def test_a_stalled_read_is_shown_until_bytes_arrive_and_counted_once() -> None:
    now = [100.0]
    clock = lambda: now[0]  # noqa: E731
    progress = Progress(total_bytes=100, prefix="", clock=clock)
    progress.phase = "transferring"
    collector = metrics.FillCollector(clock=clock)
    collector.attach(progress)

    def sample(name: str) -> float:
        return next(s.value for m in collector.collect() for s in m.samples if s.name == name)

    progress.add(written=10, from_store=10)
    assert sample("dlo_loader_stalled") == 0
    progress.stall("GET model.safetensors bytes 0-9")
    progress.stall("GET model.safetensors bytes 0-9")
    assert (sample("dlo_loader_stalled"), sample("dlo_loader_stalls_total")) == (1, 1)
    now[0] += 5
    progress.add(written=10, from_store=10)
    assert (sample("dlo_loader_stalled"), sample("dlo_loader_stalls_total")) == (0, 1)
    assert sample("dlo_loader_throughput_bytes_per_second") > 0
