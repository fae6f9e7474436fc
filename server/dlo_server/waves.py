"""The bounded queue of images waiting to be made, and how waves are drawn from it.

Owns the wave rule of an AllGather group: every rank runs the same blocks in the same order, so a
wave holds up to G jobs (one per rank) that make the same sequence of DiT calls, those with one
wave key (`wave_key`: everything of a job but its prompt and seed); the oldest job always leads
the next wave (no job waits behind younger ones of another key for more than the waves before
it). In rank-local mode each rank takes the oldest job alone (`size=1`). The capacity counts
images (a job of `n` images takes `n`). Pure threading, no torch.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field, fields, replace

from dlo_server.requests import Job


WaveKey = tuple
"""A job's fields that set the number or shape of its DiT calls (`wave_key`)."""
SHARED = ("prompt", "seed")
"""What jobs of one wave may differ in: their text and noise, not their calls."""


def wave_key(job: Job) -> WaveKey:
    """Everything of `job` that may change the number or shape of its DiT calls: steps, size,
    frames, `n` (the batch), guidance (on or off, and its scales: CFG and true CFG), and whether a
    negative prompt is given (with a scale it turns true CFG on); not its prompt, seed or the
    negative prompt's text."""
    shared = replace(job, **{name: None for name in SHARED},
                     negative_prompt=None if job.negative_prompt is None else "")
    return tuple(getattr(shared, item.name) for item in fields(shared))


@dataclass
class Pending:
    """A job and the future its PNG bytes (or its error) resolve."""

    job: Job
    future: Future[bytes] = field(default_factory=Future)


class QueueFull(Exception):
    """No room for the request's images; `retry_after_s` estimates when there will be."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"the queue is full; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


class QueueClosed(Exception):
    """The server is shutting down and takes no new requests."""


class WaveQueue:
    """At most `capacity` images waiting; waves of at most `ranks` jobs."""

    def __init__(self, capacity: int, ranks: int) -> None:
        self.capacity = capacity
        self.ranks = ranks
        self.wave_s = 1.0
        """Seconds the last wave took (the engine sets it): the Retry-After estimate."""
        self._pending: list[Pending] = []
        self._closed = False
        self._changed = threading.Condition()

    @property
    def depth(self) -> int:
        """Images waiting, those of requests whose client went away left out."""
        with self._changed:
            self._drop_cancelled()
            return self._images()

    def _images(self) -> int:
        return sum(item.job.n for item in self._pending)

    def submit(self, jobs: list[Job]) -> list[Future[bytes]]:
        """Queue all of `jobs` or none: `QueueFull` when they do not fit, `QueueClosed` after
        `close()`."""
        with self._changed:
            if self._closed:
                raise QueueClosed("the server is shutting down")
            self._drop_cancelled()  # an abandoned request's jobs hold no slot
            queued = self._images() + sum(job.n for job in jobs)
            if queued > self.capacity:
                waves_ahead = math.ceil(queued / self.ranks)
                raise QueueFull(max(1, math.ceil(waves_ahead * self.wave_s)))
            added = [Pending(job) for job in jobs]
            self._pending.extend(added)
            self._changed.notify_all()
        return [item.future for item in added]

    def take_wave(self, timeout_s: float, size: int | None = None) -> list[Pending] | None:
        """The next wave (at most `size` jobs, default `ranks`); None when nothing came within
        `timeout_s`; [] once closed and empty."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._pending or self._closed, timeout_s):
                return None
            if not self._pending:
                return []
            self._drop_cancelled()
            if not self._pending:
                return None if not self._closed else []
            key = wave_key(self._pending[0].job)
            wave = [item for item in self._pending
                    if wave_key(item.job) == key][:size or self.ranks]
            taken = {id(item) for item in wave}
            self._pending = [item for item in self._pending if id(item) not in taken]
        wave = [item for item in wave if item.future.set_running_or_notify_cancel()]
        return wave or None  # all cancelled since: as if nothing had come

    def _drop_cancelled(self) -> None:
        """A request whose client went away cancelled its futures: its queued jobs are dropped
        (the ones taken into a wave are running and can no longer be cancelled). Called with
        the lock held."""
        self._pending = [item for item in self._pending if not item.future.cancelled()]

    def close(self) -> None:
        """Take no new jobs; the ones queued still run."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def fail_all(self, error: BaseException) -> None:
        """Close and fail every queued job with `error` (the group broke)."""
        with self._changed:
            self._closed = True
            pending, self._pending = self._pending, []
            self._changed.notify_all()
        for item in pending:
            try:
                item.future.set_exception(error)
            except InvalidStateError:  # cancelled: its client went away
                pass
