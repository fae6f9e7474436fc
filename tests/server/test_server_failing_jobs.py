"""A job the pipeline cannot run fails alone: the wave engine of `dlo serve` over two real gloo
ranks (`support.server_wave_worker`), fed jobs past the HTTP checks. A prompt with a lone
surrogate (which no text encoder can take) fails before the job's first forward; the job's error
comes back as its own result, the other job of its wave gets the resident pipeline's image, and
the waves after it run: in AllGather mode the failed rank ran the forwards its job did not reach,
so the ranks stay in step (without that, the other rank waits at its first forward until the
group's wait timeout and fails)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from support import server_wave_worker
from support.gloo_world import run_world
from support.server_helpers import pod_files, references

pytestmark = pytest.mark.slow

BAD = "\ud800"


def job(prompt: str, seed: int) -> dict:
    return {"prompt": prompt, "width": 16, "height": 16, "steps": 3, "guidance_scale": 3.5,
            "seed": seed}


@pytest.mark.parametrize("allgather", [True, False], ids=["allgather", "rank-local"])
def test_a_job_that_fails_fails_alone_and_the_group_goes_on(tmp_path: Path,
                                                            allgather: bool) -> None:
    # AllGather waves: [bad on rank 0, good], [good, bad on rank 1], [good, rank 1 idle]
    jobs = [job(BAD, 1), job("a fox", 2), job("a cat", 3), job(BAD, 4), job("an owl", 5)]
    files = pod_files(tmp_path / "pod", ranks=2, allgather=allgather, group_wait_timeout_s=60)
    (tmp_path / server_wave_worker.PATHS).write_text(json.dumps(
        {"settings": str(files.settings), "entry": str(files.entry_file)}))
    (tmp_path / server_wave_worker.JOBS).write_text(json.dumps(jobs))
    rank0, rank1 = run_world(server_wave_worker.main, 2, tmp_path)
    good = [fields for fields in jobs if fields["prompt"] != BAD]
    expected = [base64.b64encode(png).decode()
                for [png] in references(files, good, tmp_path / "reference.json")]
    results = rank0["results"]
    assert [results[index] for index in (1, 2, 4)] == expected
    for index in (0, 3):
        assert results[index].startswith("error: rank ")
    assert rank0["images"] == 3
    if allgather:  # three waves, each of 3 forwards on both ranks, failed jobs' made up
        assert (rank0["waves"], rank0["forwards"], rank1["forwards"]) == (3, 9, 9)
