"""A lean loader start: the fill path imports neither boto3's transfer manager nor torch, and
imports the transfer's own modules (on a thread, `cli.preload_transfer_modules`) while it lists, and `dlo cache fill` as a command ends at once after its summary, with everything
it wrote flushed (the summary line and the termination-message file)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from dlo_bench.s3server import S3Server, free_port
from support.loader_fleet import LOADER_SETTINGS, Checkpoint

from dlo_contract.fill_proof import summary_proof
from dlo_contract.names import FILL_SECRET_ENV, LOADER_PROOF_HEADER, LOADER_SUMMARY_PATH

SECRET = b"fill secret of the DOD flux, 32B"


def test_the_fill_path_imports_only_what_one_node_needs() -> None:
    probe = ("import sys, dlo_cli.main, dlo_loader.cli, dlo_loader.fill, dlo_loader.source; "
             "print(sorted(m for m in ('boto3', 's3transfer', 'torch', 'numpy', "
             "*dlo_loader.fill.TRANSFER_MODULES) if m in sys.modules)); "
             "dlo_loader.cli.preload_transfer_modules().join(); "
             "print(all(m in sys.modules for m in dlo_loader.fill.TRANSFER_MODULES))")
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           check=True, timeout=120)
    assert found.stdout.split() == ["[]", "True"]


def fill_command(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dlo_cli.main", "cache", "fill", *argv],
                          capture_output=True, text=True, timeout=120)


def test_a_failing_fill_exits_with_its_summary_written(tmp_path: Path) -> None:
    summary_file = tmp_path / "termination-log"
    done = fill_command("--source", "ftp://x/y", "--summary-file", str(summary_file),
                        "--entry-file", str(tmp_path / "entry.json"))
    assert done.returncode == 1
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["status"] == "error" and line == json.loads(summary_file.read_text())
    assert "loader.source='ftp://x/y'" in done.stderr  # the log line, flushed too


@pytest.mark.usefixtures("aws_env")
def test_a_fill_exits_with_its_entry_and_summary_written(
        s3: S3Server, checkpoint: Checkpoint, tmp_path: Path) -> None:
    config = tmp_path / "settings.json"
    config.write_text(json.dumps({"loader": LOADER_SETTINGS}))
    entry_file = tmp_path / "entry.json"
    done = fill_command("--config", str(config), "--source", checkpoint.source,
                        "--endpoint-url", s3.endpoint_url, "--cache-root", str(tmp_path / "c"),
                        "--entry-file", str(entry_file),
                        "--summary-file", str(tmp_path / "termination-log"))
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["status"] == "ok"
    assert json.loads(entry_file.read_text())["entry_id"] == summary["entry_id"]
    assert " plan: " in done.stderr  # the line the cold-start benchmark times the first GET by


@pytest.mark.usefixtures("aws_env")
def test_a_sidecar_fill_stays_up_serving_its_summary_until_sigterm(
        s3: S3Server, checkpoint: Checkpoint, tmp_path: Path) -> None:
    """`--keep-running --yield-cpu` (the pod's native sidecar): it runs at nice +10, and after
    publishing, the process stays up, so the kubelet does not restart it; its endpoint serves the summary the termination message
    would have carried; SIGTERM (the pod's end) ends it with status 0."""
    config = tmp_path / "settings.json"
    config.write_text(json.dumps({"loader": {**LOADER_SETTINGS, "metrics_port": free_port()}}))
    port = json.loads(config.read_text())["loader"]["metrics_port"]
    entry_file = tmp_path / "entry.json"
    secret_file = tmp_path / "fill-secret"
    secret_file.write_bytes(SECRET)  # the DOD's: the summary goes to a reader that proves it
    process = subprocess.Popen(
        [sys.executable, "-m", "dlo_cli.main", "cache", "fill", "--config", str(config),
         "--source", checkpoint.source, "--endpoint-url", s3.endpoint_url,
         "--cache-root", str(tmp_path / "c"), "--entry-file", str(entry_file),
         "--summary-file", str(tmp_path / "termination-log"), "--keep-running", "--yield-cpu"],
        env={**os.environ, FILL_SECRET_ENV: str(secret_file)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not entry_file.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert entry_file.exists(), process.communicate(timeout=10)
        time.sleep(0.5)
        assert process.poll() is None  # still up after publishing
        assert os.getpriority(os.PRIO_PROCESS, process.pid) == min(
            os.getpriority(os.PRIO_PROCESS, 0) + 10, 19)  # `--yield-cpu`: the server first
        asked = urllib.request.Request(f"http://127.0.0.1:{port}{LOADER_SUMMARY_PATH}",
                                       headers={LOADER_PROOF_HEADER: summary_proof(SECRET)})
        with urllib.request.urlopen(asked, timeout=10) as reply:
            served = json.loads(reply.read())
        assert served["status"] == "ok"
        assert served["entry_id"] == json.loads(entry_file.read_text())["entry_id"]
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == served
    assert "staying up as the pod's sidecar" in err
