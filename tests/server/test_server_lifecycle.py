"""`dlo serve`'s life as the kubelet sees it: the probes while the loader is still filling, a
SIGTERM with requests in flight, and a rank that dies."""

from __future__ import annotations

import io
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from PIL import Image
from support.scrape import scrape, value
from support.server_helpers import (
    ENTRY_WAIT_ENV, RunningServer, pod_files, png_of, start_server,
)

pytestmark = pytest.mark.slow


def wait_for(predicate, timeout_s: float = 120) -> None:  # noqa: ANN001
    """Poll `predicate` (a hang guard, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout_s} s")
        time.sleep(0.1)


def probes(server: RunningServer) -> dict[str, tuple[int, str]]:
    answers = {probe: server.get(f"/health/{probe}") for probe in ("startup", "ready", "live")}
    return {probe: (answer.status_code, answer.json()["state"])
            for probe, answer in answers.items()}


def test_probes_say_filling_until_the_loader_publishes(tmp_path: Path,
                                                       servers: list[RunningServer]) -> None:
    files = pod_files(tmp_path, ranks=1, publish=False)
    server = start_server(files, tmp_path / "server.log", **{ENTRY_WAIT_ENV: "300"})
    servers.append(server)
    wait_for(lambda: _state(server) == "filling")
    assert probes(server) == {"startup": (503, "filling"), "ready": (503, "filling"),
                              "live": (200, "filling")}
    refused = server.generate({"prompt": "x", "size": "8x8"})
    assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
    assert "filling" in refused.json()["error"]["message"]
    files.publish()
    server.wait_ready()
    assert probes(server) == {probe: (200, "ready") for probe in ("startup", "ready", "live")}
    png_of(server.generate({"prompt": "x", "size": "8x8", "num_inference_steps": 2}))


def test_sigterm_while_the_loader_fills_exits_0(tmp_path: Path,
                                               servers: list[RunningServer]) -> None:
    files = pod_files(tmp_path, ranks=2, publish=False)
    server = start_server(files, tmp_path / "server.log", **{ENTRY_WAIT_ENV: "300"})
    servers.append(server)
    wait_for(lambda: _state(server) == "filling")
    ranks = psutil.Process(server.process.pid).children()
    assert server.stop() == 0, server.log_tail()
    assert not any(rank.is_running() and rank.status() != psutil.STATUS_ZOMBIE
                   for rank in ranks)


def _state(server: RunningServer) -> str | None:
    try:
        return server.get("/health/live").json()["state"]
    except OSError:
        return None


def test_sigterm_finishes_the_requests_in_flight_and_exits_0(
        tmp_path: Path, servers: list[RunningServer]) -> None:
    files = pod_files(tmp_path, ranks=1)
    server = start_server(files, tmp_path / "server.log", "--stop-timeout", "600")
    servers.append(server)
    server.wait_ready()
    body = {"prompt": "x", "size": "128x128", "num_inference_steps": 20, "n": 2}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(server.generate, body)
        wait_for(lambda: value(scrape(server.port), "dlo_runtime_forwards_total",
                               component="transformer") >= 1)
        assert server.stop() == 0, server.log_tail()
        images = png_of(answer.result())
    assert [Image.open(io.BytesIO(png)).size for png in images] == [(128, 128)] * 2
    assert "dlo: disabled on FluxTransformer2DModel" in server.log_tail()
    assert "stopped cleanly" in server.log_tail()


def test_a_rank_that_dies_breaks_every_probe(tmp_path: Path,
                                             servers: list[RunningServer]) -> None:
    files = pod_files(tmp_path, ranks=2)
    server = start_server(files, tmp_path / "server.log")
    servers.append(server)
    server.wait_ready()
    [rank1] = [child for child in psutil.Process(server.process.pid).children()
               if "--rank" in child.cmdline()]
    rank1.kill()
    wait_for(lambda: _state(server) == "broken")
    assert probes(server) == {probe: (500, "broken") for probe in ("startup", "ready", "live")}
    wait_for(lambda: "rank 1 exited with status" in server.log.read_text(errors="replace"))
    assert server.generate({"prompt": "x", "size": "8x8"}).status_code == 503
    assert server.stop() == 1
