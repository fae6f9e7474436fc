"""One rank of `dlo serve`: build the model with the pod API, then run waves until told to stop.

Owns the start of a rank (the entry, `pod.build_dit`, `pod.enable`, the sampler) and the wave
loop. Rank 0 leads: it draws each wave from the queue (`waves.WaveQueue`), broadcasts it to the
other ranks over the gloo dispatch group (`broadcast_object_list`), makes its own job's image,
and gathers the others' PNGs (`gather_object`). Every rank makes the job with its index; in
AllGather mode a rank without one runs the wave's forwards on the smallest latent and drops
them, so every gather of the wave has all G ranks (`FluxSampler.idle`). A job that fails is that
job's result (its request's 500), not the wave's: in AllGather mode its rank first runs, as an idle
rank would, the forwards the job did not reach (`ForwardCount`), so every rank still runs the
wave's forwards and the group stays in step; a failure inside a forward, which leaves the block
gathers at an unknown point, breaks the group at once instead. While no request comes,
rank 0 broadcasts a tick every `HEARTBEAT_S`, so the others' waits never reach the group's
timeout and a rank that died is seen. The stop order: rank 0 broadcasts STOP once its queue is
closed and empty, then every rank closes its handle; the caller destroys the process groups.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dlo_server.metrics import ServerMetrics
from dlo_server.requests import Job
from dlo_server.sampler import FluxSampler
from dlo_server.status import State, Status
from dlo_server.waves import Pending, WaveQueue

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
SAMPLER_PARTS = ("transformer", "vae", "scheduler")
"""Folders of the entry the server loads (diffusers layout)."""
TICK = "tick"
STOP = "stop"


@dataclass(frozen=True)
class Wave:
    """Jobs by rank (None: that rank has none) and the step count they share (AllGather)."""

    steps: int
    jobs: tuple[Job | None, ...]


class ForwardCount:
    """Forwards of the DiT begun and ended on this rank (hooks on its root module): how far a
    failed job got."""

    def __init__(self, dit: torch.nn.Module) -> None:
        self.begun = self.ended = 0
        dit.register_forward_pre_hook(self._begin)
        dit.register_forward_hook(self._end)

    def _begin(self, *_: Any) -> None:
        self.begun += 1

    def _end(self, *_: Any) -> None:
        self.ended += 1


@dataclass
class Model:
    """What a started rank serves with."""

    sampler: FluxSampler
    handle: Any
    allgather: bool
    forwards: ForwardCount


class WaveFailed(RuntimeError):
    """A rank could not make its job's image; the message is that rank's error."""


def start_model(status: Status, device: torch.device) -> Model:
    """Wait for the loader's entry, build the DiT weightless when the entry backs it, enable DLO,
    and load the VAE and scheduler from the entry."""
    from diffusers import FluxTransformer2DModel

    from dlo_runtime import pod

    status.set(State.FILLING, "waiting for the loader to publish the entry")
    entry = pod.wait_for_entry_file()
    if entry is None:
        raise pod.PodError(f"no entry file at {pod.entry_file_path()}",
                           hint="run the loader (`dlo cache fill`) first")
    status.set(State.LOADING, f"building the model of entry {entry.entry_id}")
    check_model_folder(entry.path)
    dit = pod.build_dit(FluxTransformer2DModel)
    handle = pod.enable(dit, device=device)
    try:
        sampler = FluxSampler(dit, entry.path, handle.device)
        allgather = handle.stats().mode == "allgather"
    except BaseException:
        handle.close()
        raise
    log.info("serving entry %s on %s, %s mode, host backing %s", entry.entry_id, handle.device,
             "allgather" if allgather else "rank-local", handle.backing().value)
    return Model(sampler, handle, allgather, ForwardCount(dit))


def check_model_folder(path: Path) -> None:
    """The entry must hold what the sampler runs: a Flux transformer, a VAE and a scheduler."""
    from dlo_runtime.pod import PodError

    missing = [part for part in SAMPLER_PARTS if not (path / part / "config.json").is_file()
               and not (path / part / "scheduler_config.json").is_file()]
    if missing:
        raise PodError(f"the entry has no {', '.join(f'{part}/' for part in missing)}: dlo serve "
                       "needs the transformer, the VAE and the scheduler",
                       hint="include them in the model's files (model.include: "
                            + ", ".join(f'"{part}/*"' for part in SAMPLER_PARTS) + ")")
    kind = json.loads((path / "transformer" / "config.json").read_text()).get("_class_name")
    if kind != "FluxTransformer2DModel":
        raise PodError(f"the entry's transformer is {kind}; dlo serve runs "
                       "FluxTransformer2DModel only")


def lead(model: Model, queue: WaveQueue, group: Any, metrics: ServerMetrics) -> None:
    """Rank 0's loop: waves until the queue is closed and empty, then STOP to the others."""
    while True:
        metrics.queue_depth.set(queue.depth)
        pending = queue.take_wave(HEARTBEAT_S)
        if pending is None:
            broadcast(TICK, group)
            continue
        if not pending:
            broadcast(STOP, group)
            return
        started = time.monotonic()
        with failing_on_error(pending):
            _run_wave(model, pending, queue.ranks, group, metrics)
        queue.wave_s = time.monotonic() - started
        metrics.wave_seconds.observe(queue.wave_s)


def follow(model: Model, rank: int, group: Any) -> None:
    """The other ranks' loop: each wave rank 0 broadcasts, until STOP."""
    while True:
        order = broadcast(None, group)
        if order == STOP:
            return
        if order == TICK:
            continue
        _gather(_own_part(model, order, rank), group)


def _run_wave(model: Model, pending: list[Pending], ranks: int, group: Any,
              metrics: ServerMetrics) -> None:
    jobs = tuple(item.job for item in pending) + (None,) * (ranks - len(pending))
    wave = Wave(steps=pending[0].job.steps, jobs=jobs)
    broadcast(wave, group)
    results = _gather(_own_part(model, wave, 0), group)
    metrics.waves.inc()
    metrics.idle_slots.inc(ranks - len(pending))
    for item, result in zip(pending, results):
        resolve(item, result, metrics)


def _own_part(model: Model, wave: Wave, rank: int) -> bytes | str | None:
    """This rank's image of `wave` (or its error as text); an idle rank's dropped forwards in
    AllGather mode."""
    job = wave.jobs[rank]
    if job is None:
        model.sampler.idle(wave.steps)
        return None
    ended = model.forwards.ended
    result = make_image(model, job, rank)
    if isinstance(result, str) and model.allgather:
        _keep_in_step(model, wave.steps - (model.forwards.ended - ended), result)
    return result


def _keep_in_step(model: Model, missing: int, error: str) -> None:
    """After this rank's job of an AllGather wave failed: run the `missing` forwards the job did
    not reach, as an idle rank would, so that the other ranks' block gathers are answered and the
    wave ends for all. A forward left unfinished broke the gathers mid-forward: the group cannot
    go on (`WaveFailed`, the server breaks) rather than hang until the group's timeout."""
    if model.forwards.begun != model.forwards.ended:
        raise WaveFailed(f"{error} (inside a forward of the DiT; the group cannot go on)")
    if missing > 0:
        model.sampler.idle(missing)


def make_image(model: Model, job: Job, rank: int) -> bytes | str:
    """The PNG of `job`, or the error that stopped it as text (that request's 500; the server
    goes on)."""
    try:
        return model.sampler.generate(job)
    except Exception as exc:
        log.exception("rank %d: the job failed", rank)
        return f"rank {rank}: {type(exc).__name__}: {exc}"


def resolve(item: Pending, result: bytes | str, metrics: ServerMetrics) -> None:
    if isinstance(result, bytes):
        metrics.images.inc()
        item.future.set_result(result)
    else:
        item.future.set_exception(WaveFailed(result))


@contextmanager
def failing_on_error(pending: list[Pending]) -> Iterator[None]:
    """A wave that raises (a rank gone) fails its requests before the error goes on."""
    try:
        yield
    except BaseException as exc:
        for item in pending:
            if not item.future.done():
                item.future.set_exception(WaveFailed(f"{type(exc).__name__}: {exc}"))
        raise


def broadcast(message: Any, group: Any, src: int = 0) -> Any:
    """`message` from rank `src` to every rank of `group` (the same object back on `src`)."""
    if group is None:
        return message
    box = [message]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _gather(result: Any, group: Any) -> list[Any]:
    if group is None:
        return [result]
    rank = dist.get_rank(group)
    out = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(result, out, dst=0, group=group)
    return out or []
