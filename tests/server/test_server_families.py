"""Each served family's output equals, bit for bit, what the same diffusers pipeline returns when
called directly with a resident transformer and `generator=torch.Generator("cpu").manual_seed(seed)`
(`support.server_reference`): Flux (CLIP + T5), SD3 (two CLIPs + T5), Z-Image (Qwen3) and Wan
text-to-video (UMT5), tiny random-weight pipelines with their real text encoders and tokenizers,
served by `dlo serve` over 2 gloo ranks in AllGather mode and in rank-local mode. Three requests
at once; the last asks for two outputs (`n`: one generator for both, as diffusers draws them).
For video the frames are compared before encoding, and the MP4 decodes to the frame count and
size asked for."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dlo_bench.serve_model import Family
from support.server_helpers import RunningServer, pod_files, png_of, references, start_server

pytestmark = pytest.mark.slow

PROMPTS = ("a red fox in the snow", "a blue cat", "a lighthouse on a cliff at dusk")
EXPECTED: dict[Family, list[list[Any]]] = {}
"""The direct pipeline's outputs per family, made once: both modes serve the same seeded folder."""


def jobs(family: Family) -> list[dict[str, Any]]:
    side = 16 if family is Family.WAN else 8
    video = {"frames": 5} if family is Family.WAN else {}
    return [{"prompt": prompt, "width": side, "height": side * (1 + index % 2), "steps": 2,
             "guidance_scale": 3.5, "seed": 10 + index, "n": 2 if index == 2 else 1, **video}
            for index, prompt in enumerate(PROMPTS)]


def body(job: dict[str, Any]) -> dict[str, Any]:
    fields = {"prompt": job["prompt"], "size": f"{job['width']}x{job['height']}",
              "num_inference_steps": job["steps"], "guidance_scale": job["guidance_scale"],
              "seed": job["seed"]}
    if "frames" in job:
        return {**fields, "num_frames": job["frames"]}
    return {**fields, "n": job["n"]}


def serve(server: RunningServer, job: dict[str, Any]) -> list[Any]:
    """The served outputs of `job`: its PNGs, or its video's frames (after checking its MP4)."""
    if "frames" not in job:
        return png_of(server.generate(body(job)))
    frames, mp4 = server.video(body(job))
    assert decoded_shape(mp4) == (job["frames"], job["height"], job["width"])
    return [frames]


def decoded_shape(mp4: bytes) -> tuple[int, int, int]:
    import av

    with av.open(io.BytesIO(mp4)) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    return (len(frames), *frames[0].shape[:2])


def expected(family: Family, tmp_path: Path) -> list[list[Any]]:
    if family not in EXPECTED:
        files = pod_files(tmp_path / "reference", ranks=1, family=family, publish=False)
        wanted = jobs(family)
        if family is Family.WAN:  # one video per request: the third asks for n=1 too
            wanted[2]["n"] = 1
        EXPECTED[family] = references(files, wanted, tmp_path / "jobs.json")
    return EXPECTED[family]


@pytest.mark.parametrize("allgather", [True, False], ids=["allgather", "rank-local"])
@pytest.mark.parametrize("family", list(Family), ids=[family.name.lower() for family in Family])
def test_served_outputs_equal_the_direct_diffusers_pipelines(
        tmp_path: Path, servers: list[RunningServer], family: Family, allgather: bool) -> None:
    want = expected(family, tmp_path)
    files = pod_files(tmp_path / "pod", ranks=2, allgather=allgather, family=family)
    server = start_server(files, tmp_path / "server.log")
    servers.append(server)
    server.wait_ready()
    wanted = jobs(family)
    if family is Family.WAN:
        wanted[2]["n"] = 1
    with ThreadPoolExecutor(len(wanted)) as pool:
        served = list(pool.map(lambda job: serve(server, job), wanted))
    for index, (got, reference) in enumerate(zip(served, want)):
        assert len(got) == len(reference), index
        for output, one in zip(got, reference):
            same = (np.array_equal(output, np.asarray(one, dtype=np.uint8))
                    if family is Family.WAN else output == one)
            assert same, f"job {index} differs from the direct pipeline\n{server.log_tail()}"
    assert len({bytes(np.asarray(out)) for outs in served for out in outs}) == \
        sum(len(outs) for outs in served)  # each output its own: not a constant image
    assert server.stop() == 0, server.log_tail()
