"""Body of each rank of the two-process gloo world that `test_server_failing_jobs.py` starts: the
wave engine of `dlo serve` (`engine.lead`/`follow` in AllGather mode, `local.lead_local`/
`follow_local` in rank-local mode) over a published tiny Flux entry, fed jobs straight into its
queue, past the HTTP checks: a job the pipeline cannot run must fail alone.

The world's directory holds `paths.json` (the settings document and the entry file, which each
rank points DLO_CONFIG and DLO_ENTRY_FILE at) and `jobs.json` (the fields of
`dlo_server.requests.Job`, queued in order before the engine starts). Rank 0's outcome: each
job's PNG (base64) or its error, the images and waves counted, and the forwards of each rank.
"""

from __future__ import annotations

import base64
import json
import os
from concurrent.futures import Future
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from support.gloo_world import in_gloo_rank

from dlo_contract.names import CONFIG_ENV, ENTRY_FILE_ENV
from dlo_server.engine import follow, lead, start_model
from dlo_server.local import follow_local, lead_local
from dlo_server.metrics import ServerMetrics
from dlo_server.requests import Job
from dlo_server.status import Status
from dlo_server.waves import WaveQueue

PATHS = "paths.json"
JOBS = "jobs.json"
DISPATCH_TIMEOUT = timedelta(seconds=300)
"""Bound of the waves' broadcasts and gathers: a rank left waiting on a wave that never ends
fails the test instead of waiting out torch's 30 minutes."""


def main(rank: int, world: int, port: int, out_dir: str) -> None:
    paths = json.loads(Path(out_dir, PATHS).read_text())
    os.environ[CONFIG_ENV], os.environ[ENTRY_FILE_ENV] = paths["settings"], paths["entry"]
    in_gloo_rank(rank, world, port, out_dir, partial(_serve, Path(out_dir)))


def _serve(out_dir: Path, world: int, _: dist.ProcessGroup) -> dict[str, Any]:
    rank = dist.get_rank()
    group = dist.new_group(list(range(world)), timeout=DISPATCH_TIMEOUT)
    model = start_model(Status(), torch.device("cpu"))
    try:
        if rank > 0:
            (follow if model.allgather else follow_local)(model, rank, group)
            return {"forwards": model.forwards.ended}
        jobs = [Job(**fields) for fields in json.loads((out_dir / JOBS).read_text())]
        queue, metrics = WaveQueue(len(jobs), world), ServerMetrics()
        futures = [future for job in jobs for future in queue.submit([job])]
        queue.close()  # the engine makes what is queued, then stops every rank
        if model.allgather:
            lead(model, queue, group, metrics)
        else:
            lead_local(model, queue, {1: group}, metrics)
        return {"results": [_result(future) for future in futures],
                "images": _count(metrics, "dlo_server_images_total"),
                "waves": _count(metrics, "dlo_server_waves_total"),
                "forwards": model.forwards.ended}
    finally:
        model.handle.close()


def _count(metrics: ServerMetrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(name)


def _result(future: Future[bytes]) -> str:
    """The PNG as base64, or `error: ` and the job's error."""
    error = future.exception()
    if error is not None:
        return f"error: {error}"
    [png] = future.result()
    return base64.b64encode(png).decode()
