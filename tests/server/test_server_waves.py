"""Waves over a real 2-rank group (two `dlo serve` processes over gloo on loopback): ten
concurrent requests of mixed step counts (the last for two images) each get the images the direct
diffusers pipeline makes for them in one process, bit for bit, in AllGather mode (waves; idle
ranks run dropped forwards) and in rank-local mode (each rank takes the next image when free)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.scrape import scrape, value
from support.server_helpers import RunningServer, pod_files, png_of, references, start_server

pytestmark = pytest.mark.slow

SIZES = ("16x16", "32x16", "16x32", "32x32")


def jobs(count: int) -> list[dict]:
    """Steps 2, 3, 4 in turn, a prompt, size and seed each: no two jobs alike."""
    out = []
    for index in range(count):
        width, height = (int(side) for side in SIZES[index % len(SIZES)].split("x"))
        out.append({"prompt": f"prompt {index % 3}", "width": width, "height": height,
                    "steps": 2 + index % 3, "guidance_scale": 3.5, "seed": 100 + index})
    return out


def serve_concurrently(server: RunningServer, wanted: list[dict]) -> list[bytes]:
    """One request per job, all at once; the images in job order."""
    def one(job: dict) -> list[bytes]:
        return png_of(server.generate({
            "prompt": job["prompt"], "size": f"{job['width']}x{job['height']}",
            "num_inference_steps": job["steps"], "seed": job["seed"], "n": job["n"]}))

    with ThreadPoolExecutor(len(wanted)) as pool:
        return [png for pngs in pool.map(one, wanted) for png in pngs]


def wanted_jobs() -> list[dict]:
    """Ten jobs; the tenth asks for two images."""
    wanted = [{**job, "n": 1} for job in jobs(10)]
    wanted[-1]["n"] = 2
    return wanted


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    """The direct pipeline's images of `wanted_jobs()`, made once: both modes serve the same
    seeded model folder (`pod_files` builds it alike every time)."""
    directory = tmp_path_factory.mktemp("reference")
    files = pod_files(directory, ranks=1, publish=False)
    return [png for pngs in references(files, wanted_jobs(), directory / "jobs.json")
            for png in pngs]


@pytest.mark.parametrize("allgather", [True, False], ids=["allgather", "rank-local"])
def test_concurrent_requests_of_mixed_steps_equal_their_resident_reference(
        tmp_path: Path, servers: list[RunningServer], expected: list[bytes],
        allgather: bool) -> None:
    files = pod_files(tmp_path, ranks=2, allgather=allgather)
    server = start_server(files, tmp_path / "server.log")
    servers.append(server)
    server.wait_ready()
    assert server.get("/health/ready").json()["detail"] == (
        f"2 rank(s), {'allgather' if allgather else 'rank-local'} mode")
    wanted = wanted_jobs()
    served = serve_concurrently(server, wanted)
    mismatched = [index for index, (got, want) in enumerate(zip(served, expected)) if got != want]
    assert mismatched == [], server.log_tail()
    assert len(set(served)) == len(served)
    samples = scrape(server.port)
    assert value(samples, "dlo_server_images_total") == len(served) == len(wanted) + 1
    waves = value(samples, "dlo_server_waves_total")
    if allgather:  # every wave has both ranks: the images and the dropped forwards
        assert value(samples, "dlo_server_idle_slots_total") == 2 * waves - len(wanted)
    else:  # each rank takes the next image when free: no waves, nothing dropped
        assert waves == value(samples, "dlo_server_idle_slots_total") == 0
    gathered = value(samples, "dlo_runtime_gathered_bytes_total", component="transformer")
    assert (gathered > 0) is allgather
    assert server.stop() == 0, server.log_tail()
