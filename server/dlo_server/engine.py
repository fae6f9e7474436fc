"""One rank of `dlo serve`: build the pipeline with the pod API, then run waves until told to stop.

Owns the start of a rank (the entry, the pipeline its `model_index.json` names with the DiT from
`pod.build_dit` offloaded by `pod.enable`, see `dlo_server.pipeline`) and the wave loop. Rank 0
leads: it draws each wave from the queue (`waves.WaveQueue`), broadcasts it to the other ranks
over the gloo dispatch group (`broadcast_object_list`), makes its own job, and gathers the others'
outputs (`gather_object`). Every rank makes the job with its index; in AllGather mode a rank
without one runs the wave's first job again, stopped at the latents and dropped: the wave's jobs
share their wave key (`waves.wave_key`), so it makes the same DiT calls and every gather of the
wave has all G ranks (`Sampler.idle`). A job that fails is that
job's result (its request's 500), not the wave's: in AllGather mode its rank first runs, as an idle
rank would, the forwards the job did not reach (`ForwardCount`), so every rank still runs the
wave's forwards and the group stays in step; a failure inside a forward, which leaves the block
gathers at an unknown point, breaks the group at once instead. While no request comes,
rank 0 broadcasts a tick every `HEARTBEAT_S`, so the others' waits never reach the group's
timeout and a rank that died is seen. The stop order: rank 0 broadcasts STOP once its queue is
closed and empty, then every rank closes its handle; the caller destroys the process groups.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dlo_server.metrics import ServerMetrics
from dlo_server.requests import Job
from dlo_server.pipeline import TextEncoders
from dlo_server.sampler import Result, Sampler
from dlo_server.status import State, Status
from dlo_server.waves import Pending, WaveKey, WaveQueue, wave_key

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
TICK = "tick"
STOP = "stop"


@dataclass(frozen=True)
class Wave:
    """Jobs by rank (None: that rank has none); they share one wave key (AllGather)."""

    jobs: tuple[Job | None, ...]

    @property
    def first(self) -> Job:
        return next(job for job in self.jobs if job is not None)


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

    sampler: Sampler
    handle: Any
    allgather: bool
    forwards: ForwardCount
    known: dict[WaveKey, int] = field(default_factory=dict)
    """DiT forwards a job of each wave key made here, as counted (`_keep_in_step`)."""


class WaveFailed(RuntimeError):
    """A rank could not make its job's image; the message is that rank's error."""


def start_model(status: Status, device: torch.device,
                text_encoders: TextEncoders = TextEncoders.DEVICE) -> Model:
    """Wait for the loader's entry, check the pipeline it holds, build the DiT weightless when the
    entry backs it, load the rest of the pipeline from the entry and enable DLO on its DiT."""
    from dlo_runtime import pod
    from dlo_server import pipeline as pipelines

    status.set(State.FILLING, "waiting for the loader to publish the entry")
    entry = pod.wait_for_entry_file()
    if entry is None:
        raise pod.PodError(f"no entry file at {pod.entry_file_path()}",
                           hint="run the loader (`dlo cache fill`) first")
    status.set(State.LOADING, f"building the model of entry {entry.entry_id}")
    index = pipelines.index_of(entry.path)
    family = pipelines.family_of(index)
    dit = pod.build_dit(pipelines.check_components(entry.path, index))
    pipeline = pipelines.load_pipeline(entry.path, index, dit)
    handle = pod.enable(dit, device=device)
    try:
        pipelines.place(pipeline, handle.device, text_encoders)
        sampler = Sampler(pipeline, family)
        allgather = handle.stats().mode == "allgather"
    except BaseException:
        handle.close()
        raise
    log.info("serving %s of entry %s on %s, %s mode, host backing %s, text encoders %s",
             family.pipeline, entry.entry_id, handle.device,
             "allgather" if allgather else "rank-local", handle.backing().value,
             text_encoders.value)
    return Model(sampler, handle, allgather, ForwardCount(dit))


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
    wave = Wave(jobs=jobs)
    broadcast(wave, group)
    results = _gather(_own_part(model, wave, 0), group)
    metrics.waves.inc()
    metrics.idle_slots.inc(ranks - len(pending))
    for item, result in zip(pending, results):
        resolve(item, result, metrics)


def _own_part(model: Model, wave: Wave, rank: int) -> Result | str | None:
    """This rank's output of `wave` (or its error as text); an idle rank's dropped forwards in
    AllGather mode."""
    job = wave.jobs[rank]
    if job is None:
        model.sampler.idle(wave.first)
        return None
    ended = model.forwards.ended
    result = make_image(model, job, rank)
    done = model.forwards.ended - ended
    if not isinstance(result, str):
        model.known[wave_key(job)] = done
    elif model.allgather:
        _keep_in_step(model, job, done, result)
    return result


def _keep_in_step(model: Model, job: Job, done: int, error: str) -> None:
    """After this rank's `job` of an AllGather wave failed having made `done` DiT forwards: run
    the forwards it did not reach, as an idle rank would, so that the other ranks' block gathers
    are answered and the wave ends for all (a job of the same key makes as many forwards as the
    ones counted before, or, when it failed before its first, as the whole job run idle). A
    forward left unfinished broke the gathers mid-forward, and a count never seen cannot be
    finished: the group cannot go on (`WaveFailed`, the server breaks) rather than hang until
    the group's timeout."""
    if model.forwards.begun != model.forwards.ended:
        raise WaveFailed(f"{error} (inside a forward of the DiT; the group cannot go on)")
    if done == 0:
        model.sampler.idle(job)
        return
    total = model.known.get(wave_key(job))
    if total is None:
        raise WaveFailed(f"{error} (after {done} forwards of the DiT, a count this rank cannot "
                         "complete; the group cannot go on)")
    if total > done:
        model.sampler.idle(job, forwards=total - done)


def make_image(model: Model, job: Job, rank: int) -> Result | str:
    """The output of `job` (its PNGs, or its videos' frames), or the error that stopped it as
    text (that request's 500; the server goes on)."""
    try:
        return model.sampler.generate(job)
    except Exception as exc:
        log.exception("rank %d: the job failed", rank)
        return f"rank {rank}: {type(exc).__name__}: {exc}"


def resolve(item: Pending, result: Result | str, metrics: ServerMetrics) -> None:
    if not isinstance(result, str):
        metrics.images.inc(len(result))
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
