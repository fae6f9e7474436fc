"""`dlo cache fill` as a pod runs it: flags over the settings document, the entry file, the
one-line JSON summary (stdout and termination log), and the progress line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from dlo_bench.s3server import S3Server
from dlo_loader import cli
from dlo_loader.progress import Progress
from dlo_contract.schema import leaves
from dlo_contract.settings import Settings, SettingsError
from support.loader_fleet import LOADER_SETTINGS, Checkpoint, entry_files, included


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_flags_override_the_settings_document(tmp_path: Path) -> None:
    config = tmp_path / "settings.json"
    config.write_text(json.dumps({"loader": {"source": "s3://a/b", "readers": 3,
                                             "include": ["*.bin"]}}))
    settings = cli.load_fill_settings(parse(
        "--config", str(config), "--include", "*.safetensors", "--include", "*.json",
        "--mode", "single-reader", "--path-style", "--chunk-bytes", "1048576",
        "--cache-root", "/cache", "--rendezvous-timeout", "5", "--on-rendezvous-timeout", "fail"))
    loader = settings.loader
    assert (loader.source, loader.readers, loader.include, loader.mode, loader.path_style) == (
        "s3://a/b", 3, ("*.safetensors", "*.json"), "single-reader", True)
    assert (loader.chunk_bytes, loader.rendezvous_timeout_s, loader.on_rendezvous_timeout) == (
        1048576, 5.0, "fail")
    assert settings.cache.root == "/cache"


def test_every_declared_override_is_a_flag_with_the_fields_type_and_choices() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    actions = {action.dest: action for action in parser._actions}
    declared = {leaf.meta.cli: leaf.path for leaf in leaves(Settings) if leaf.meta.cli}
    assert declared == {"--source": "loader.source", "--include": "loader.include",
                        "--endpoint-url": "loader.endpoint_url", "--region": "loader.region",
                        "--path-style": "loader.path_style", "--mode": "loader.mode",
                        "--readers": "loader.readers", "--chunk-bytes": "loader.chunk_bytes",
                        "--rendezvous-timeout": "loader.rendezvous_timeout_s",
                        "--on-rendezvous-timeout": "loader.on_rendezvous_timeout",
                        "--stall-timeout": "loader.stall_timeout_s",
                        "--peer-timeout": "loader.peer_timeout_s",
                        "--metrics-port": "loader.metrics_port", "--cache-root": "cache.root"}
    assert actions["mode"].choices == ("multi-reader", "single-reader", "independent")
    assert actions["on_rendezvous_timeout"].choices == ("independent", "fail")
    assert (actions["readers"].type, actions["rendezvous_timeout"].type) == (int, float)
    assert "loader.chunk_bytes" in actions["chunk_bytes"].help
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "fastest"])


def test_settings_come_from_dlo_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "settings.json"
    config.write_text(json.dumps({"loader": {"source": "s3://from/env"}}))
    monkeypatch.setenv("DLO_CONFIG", str(config))
    assert cli.load_fill_settings(parse()).loader.source == "s3://from/env"


def test_overrides_are_validated() -> None:
    with pytest.raises(SettingsError) as caught:
        cli.load_fill_settings(parse("--chunk-bytes", str(1 << 30)))
    assert str(caught.value) == (
        "invalid settings: loader.memory_limit_bytes=1073741824 must hold two chunks of "
        "loader.chunk_bytes=1073741824 (double buffering)")


def test_failure_is_one_json_line_on_stdout_and_in_the_termination_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    summary_file = tmp_path / "termination-log"
    code = cli.run(parse("--source", "ftp://x/y", "--summary-file", str(summary_file),
                         "--entry-file", str(tmp_path / "entry.json")))
    assert code == 1
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == json.loads(summary_file.read_text())
    assert printed == {"status": "error", "rank": 2, "error": printed["error"]}
    assert "loader.source='ftp://x/y'" in printed["error"]
    assert "s3://bucket/prefix/" in printed["error"]  # the forms a source may take
    assert not (tmp_path / "entry.json").exists()


def test_rank_outside_the_world_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.run(parse("--rank", "3", "--world-size", "3", "--summary-file", str(tmp_path / "s")))
    assert code == 1
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"] == (
        "rank 3 is not within world size 3 (hint: set --rank/--world-size (or RANK/WORLD_SIZE) "
        "consistently)")


@pytest.mark.usefixtures("aws_env")
def test_success_writes_the_entry_file_and_summary(
    s3: S3Server, checkpoint: Checkpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "settings.json"
    config.write_text(json.dumps({"loader": LOADER_SETTINGS}))
    entry_file = tmp_path / "run" / "dlo" / "entry.json"
    code = cli.run(parse(
        "--config", str(config), "--source", checkpoint.source, "--endpoint-url",
        s3.endpoint_url, "--cache-root", str(tmp_path / "cache"), "--entry-file",
        str(entry_file), "--summary-file", str(tmp_path / "termination-log")))
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary == json.loads((tmp_path / "termination-log").read_text())
    assert set(summary) == {"status", "entry_id", "mode", "rank", "world_size", "bytes_from_store",
                            "bytes_from_peers", "bytes_to_peers", "seconds", "cached",
                            "store_checksums", "stage_seconds", "wait_seconds"}
    document = json.loads(entry_file.read_text())
    assert document["entry_id"] == summary["entry_id"]
    assert Path(document["path"]).is_dir()
    assert entry_files(tmp_path / "cache") == included(checkpoint.files)


def test_progress_line_reports_bytes_rate_and_eta() -> None:
    now = [100.0]
    progress = Progress(total_bytes=4 << 20, prefix="[rank 1/3]", clock=lambda: now[0])
    progress.add(written=1 << 20, from_store=1 << 20)
    now[0] = 102.0
    assert progress.line() == "[rank 1/3] 1.0 MiB of 4.0 MiB (25%), 512.0 KiB/s, ETA 6 s"
