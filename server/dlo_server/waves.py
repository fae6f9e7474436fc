"""The bounded queue of images waiting to be made, and how waves are drawn from it.

Owns the wave rule of an AllGather group: every rank runs the same blocks in the same order, so a
wave holds up to G jobs (one per rank) with the same step count; the oldest job always leads the
next wave (no job waits behind younger ones of another step count for more than the waves
before it). In rank-local mode each rank takes the oldest job alone (`size=1`). Pure threading,
no torch.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from dlo_server.requests import Job


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
            return len(self._pending)

    def submit(self, jobs: list[Job]) -> list[Future[bytes]]:
        """Queue all of `jobs` or none: `QueueFull` when they do not fit, `QueueClosed` after
        `close()`."""
        with self._changed:
            if self._closed:
                raise QueueClosed("the server is shutting down")
            self._drop_cancelled()  # an abandoned request's jobs hold no slot
            if len(self._pending) + len(jobs) > self.capacity:
                waves_ahead = math.ceil((len(self._pending) + len(jobs)) / self.ranks)
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
            lead = self._pending[0]
            wave = [item for item in self._pending
                    if item.job.steps == lead.job.steps][:size or self.ranks]
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
