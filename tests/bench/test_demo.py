"""`dlo demo` as a user runs it (reduced: a smaller DiT, one step), and its cleanup on success,
on failure and on Ctrl-C: no child process and no temporary directory may outlive it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from PIL import Image
from torch import nn

from dlo_bench.models import tiny_model
from dlo_bench.serve_model import Family, components

LAYERS = 8
HEAD_DIM = 32
DEMO_TIMEOUT_S = 240


def demo_command(*extra: str) -> list[str]:
    return [sys.executable, "-m", "dlo_cli.main", "demo", "--layers", str(LAYERS),
            "--head-dim", str(HEAD_DIM), "--json", *extra]


def demo_env(tmpdir: Path) -> dict[str, str]:
    """Every temporary directory of the demo (and of its S3 server) lands in `tmpdir`, and every
    process it starts inherits this `TMPDIR`: that is how leftovers are found."""
    tmpdir.mkdir()
    return {**os.environ, "TMPDIR": str(tmpdir)}


def started_by(tmpdir: Path) -> list[psutil.Process]:
    """Live processes whose environment carries this test's `TMPDIR`."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("TMPDIR") == str(tmpdir) and \
                    process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.Error:
            continue
    return found


def loader_running(tmpdir: Path) -> bool:
    for process in started_by(tmpdir):
        try:
            if "fill" in process.cmdline():
                return True
        except psutil.Error:
            continue
    return False


def wait_for(predicate, timeout_s: float) -> None:  # noqa: ANN001
    """Poll `predicate` (a hang guard, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout_s} s")
        time.sleep(0.2)


def assert_nothing_left(tmpdir: Path) -> None:
    assert started_by(tmpdir) == []
    assert list(tmpdir.iterdir()) == []


@pytest.mark.slow
def test_demo_fills_three_caches_and_serves_identical_outputs(tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    image = tmp_path / "out" / "demo.png"
    done = subprocess.run(demo_command("--steps", "1", "--image", str(image)),
                          env=demo_env(tmpdir), capture_output=True, text=True,
                          timeout=DEMO_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "outputs: identical (offloaded vs resident, bit for bit, every rank)" in done.stdout
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["status"] == "ok"
    parts = components(Family.FLUX, dit=tiny_model("flux", num_layers=LAYERS, head_dim=HEAD_DIM))
    tensor_bytes = sum(t.nbytes for module in parts.values() if isinstance(module, nn.Module)
                       for t in module.state_dict().values())
    # the model folder is the whole pipeline's tensors (DiT, VAE, CLIP and T5) plus safetensors
    # headers and small documents (configs, the scheduler's, the model index, the tokenizers)
    assert tensor_bytes < report["model"]["bytes"] < tensor_bytes + (128 << 10)
    with Image.open(image) as png:  # served over HTTP by `dlo serve`
        assert (png.format, png.size) == ("PNG", tuple(report["served"]["size"]))
    assert report["served"]["image"] == str(image)
    from_store = [summary["bytes_from_store"] for summary in report["loaders"]]
    assert sum(from_store) == report["model"]["bytes"]
    assert all(share > 0 for share in from_store)  # every node read a part
    assert [r["backing"] for r in report["ranks"]] == ["checkpoint", "checkpoint"]
    assert_nothing_left(tmpdir)


@pytest.mark.slow
def test_a_failed_step_stops_every_process_and_exits_non_zero(tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    done = subprocess.run(demo_command("--timeout", "0.5"), env=demo_env(tmpdir),
                          capture_output=True, text=True, timeout=DEMO_TIMEOUT_S)
    assert done.returncode == 1
    message = "cache fill: loader0, loader1, loader2 still running after 0.5 s"
    assert done.stderr.splitlines()[-1] == (
        f"dlo: error: {message} (hint: rerun with --keep and read the logs)")
    assert json.loads(done.stdout.splitlines()[-1]) == {"status": "error", "error": message}
    assert_nothing_left(tmpdir)


@pytest.mark.slow
def test_ctrl_c_stops_every_process(tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    # a session of its own stands for the terminal: Ctrl-C signals the whole foreground group
    log = tmp_path / "demo.err"  # what the demo said, for a run that ends otherwise
    with log.open("wb") as err:
        # Ctrl-C's default action, as a terminal's foreground job has it: a suite started in
        # the background by a shell without job control inherits SIGINT ignored, and so would
        # the demo, while its S3 server (which sets its own handler) still died of it.
        demo = subprocess.Popen(demo_command(), env=demo_env(tmpdir), start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=err,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for(lambda: loader_running(tmpdir), 120)
        os.killpg(demo.pid, signal.SIGINT)
        assert demo.wait(timeout=60) == 130, log.read_text(errors="replace")[-3000:]
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert_nothing_left(tmpdir)
