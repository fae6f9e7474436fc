"""Waves with the whole key: in AllGather mode a wave holds only jobs that make the same sequence
of DiT calls. Without a server, jobs that differ in any part of the key (steps, size, frames, `n`,
guidance and its scales, a negative prompt given or not) never share a wave, and jobs that differ
only in prompt, seed or the negative prompt's text do. Over a real 2-rank AllGather server (Flux,
whose true CFG doubles the DiT calls of a job), requests differing in each part at once are all
answered, each with the direct diffusers pipeline's images: no wave mixed calls and none hung."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
from dlo_bench.serve_model import Family
from support.scrape import scrape, value
from support.server_helpers import RunningServer, pod_files, png_of, references, start_server

from dlo_server.requests import Job
from dlo_server.waves import WaveQueue, wave_key

BASE = Job(prompt="a fox", width=16, height=16, steps=2, guidance_scale=3.5, seed=1)
KEY_PARTS = {
    "steps": {"steps": 3}, "width": {"width": 32}, "height": {"height": 8}, "n": {"n": 2},
    "frames": {"frames": 9}, "guidance_scale": {"guidance_scale": 1.0},
    "true_cfg_scale": {"true_cfg_scale": 2.0}, "negative_prompt": {"negative_prompt": "blur"},
}
SHARED = {"prompt": {"prompt": "a cat"}, "seed": {"seed": 7},
          "negative_prompt_text": {"negative_prompt": "blur"}}


@pytest.mark.parametrize("change", KEY_PARTS.values(), ids=KEY_PARTS)
def test_jobs_differing_in_a_part_of_the_key_never_share_a_wave(change: dict) -> None:
    queue = WaveQueue(capacity=8, ranks=2)
    other = replace(BASE, **change)
    assert wave_key(other) != wave_key(BASE)
    queue.submit([BASE])
    queue.submit([other])
    assert [item.job for item in queue.take_wave(0)] == [BASE]
    assert [item.job for item in queue.take_wave(0)] == [other]


@pytest.mark.parametrize("change", SHARED.values(), ids=SHARED)
def test_jobs_differing_only_in_prompt_seed_or_negative_text_share_a_wave(change: dict) -> None:
    first = replace(BASE, negative_prompt="noise") if "negative_prompt" in change else BASE
    other = replace(first, **change)
    queue = WaveQueue(capacity=8, ranks=2)
    queue.submit([first])
    queue.submit([other])
    assert [item.job for item in queue.take_wave(0)] == [first, other]


def test_the_queue_counts_images_not_requests() -> None:
    queue = WaveQueue(capacity=3, ranks=2)
    queue.submit([replace(BASE, n=2)])
    assert queue.depth == 2
    queue.submit([BASE])
    with pytest.raises(Exception, match="the queue is full"):
        queue.submit([BASE])


@pytest.mark.slow
def test_requests_differing_in_every_part_of_the_key_are_all_served_in_step(
        tmp_path: Path, servers: list[RunningServer]) -> None:
    base = {"prompt": "a red fox", "width": 8, "height": 8, "steps": 2, "guidance_scale": 3.5,
            "seed": 1, "n": 1}
    wanted = [base, {**base, "prompt": "a blue cat", "seed": 2}, {**base, "steps": 3},
              {**base, "width": 16}, {**base, "n": 2}, {**base, "guidance_scale": 1.0},
              {**base, "negative_prompt": "blur", "true_cfg_scale": 2.0},
              {**base, "negative_prompt": "noise", "true_cfg_scale": 2.0, "seed": 3}]
    expected = references(pod_files(tmp_path / "reference", ranks=1, family=Family.FLUX,
                                    publish=False), wanted, tmp_path / "jobs.json")
    files = pod_files(tmp_path / "pod", ranks=2, family=Family.FLUX)
    server = start_server(files, tmp_path / "server.log")
    servers.append(server)
    server.wait_ready()

    def one(job: dict) -> list[bytes]:
        body = {"prompt": job["prompt"], "size": f"{job['width']}x{job['height']}",
                "num_inference_steps": job["steps"], "guidance_scale": job["guidance_scale"],
                "seed": job["seed"], "n": job["n"]}
        extra = {name: job[name] for name in ("negative_prompt", "true_cfg_scale") if name in job}
        return png_of(server.generate({**body, **extra}))

    with ThreadPoolExecutor(len(wanted)) as pool:
        served = list(pool.map(one, wanted))
    assert served == expected, server.log_tail()
    samples = scrape(server.port)
    assert value(samples, "dlo_server_waves_total") >= len(wanted) - 2  # two pairs may share
    assert server.stop() == 0, server.log_tail()
