"""Progress of one fill: byte counters and a progress line every few seconds.

Owns the loader's counters (bytes from the object store, from peers, to peers, written) and the
line a person watching `kubectl logs` reads: `[rank r/w] 1.2 GiB of 4.0 GiB (30%), 410.5 MiB/s,
ETA 7 s` (`stalled (...)` instead of the ETA while a read gets no bytes past the stall timeout,
`no bytes written for N s` while nothing is written for `QUIET_S`, and the ETA as
`units.human_eta` spells it, bounded). A daemon thread
emits the line through a callable the CLI provides (stdout), so a stalled fill keeps reporting; `repeating` does the same for a wait (the rendezvous). Also owns
the `[rank r/w]` prefix for the loader's log records. Called by `fill`, `exchange` and `cli`.
Must not decide anything about the fill.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

from dlo_contract.units import human_bytes, human_eta

DEFAULT_INTERVAL_S = 5.0
QUIET_S = 15.0
"""Seconds without a byte written after which the line shows how long instead of an ETA."""
STAGES = ("get", "digest", "write", "exchange")
"""Where a fill's time goes: ranged GETs (summed over reader threads), chunk digests, local
writes (summed over the threads that write) and the peer exchange (the main thread's
collectives)."""


def rank_prefix(rank: int, world_size: int) -> str:
    return f"[rank {rank}/{world_size}]"


class Progress:
    """Thread-safe counters; `start()` begins periodic lines, `stop()` ends them."""

    def __init__(
        self, *, total_bytes: int, prefix: str, emit: Callable[[str], None] | None = None,
        interval_s: float = DEFAULT_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total_bytes = total_bytes
        self.prefix = prefix
        self.emit = emit
        self.interval_s = interval_s
        self.clock = clock
        self.started = clock()
        self.bytes_written = 0
        self.bytes_from_store = 0
        self.bytes_from_peers = 0
        self.bytes_to_peers = 0
        self.stage_seconds: dict[str, float] = {stage: 0.0 for stage in STAGES}
        """Thread-seconds spent per stage (see `STAGES`): where the time of a fill goes."""
        self.stalled: str | None = None
        """What a read is stalled on, until the next bytes arrive."""
        self.stalls = 0
        """Times the fill became stalled (the metrics endpoint counts them)."""
        self.phase = "listing"
        self._written_at = self.started
        """When bytes were last written (the start until the first)."""
        """Where the fill is, for the metrics endpoint: one of `dlo_loader.metrics.PHASES`."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, *, written: int = 0, from_store: int = 0, from_peers: int = 0,
            to_peers: int = 0) -> None:
        with self._lock:
            if written:
                self._written_at = self.clock()
            self.bytes_written += written
            self.bytes_from_store += from_store
            self.bytes_from_peers += from_peers
            self.bytes_to_peers += to_peers
            if written or from_store or from_peers:
                self.stalled = None

    def timed(self, stage: str, seconds: float) -> None:
        """Add `seconds` to `stage` (one of `STAGES`)."""
        with self._lock:
            self.stage_seconds[stage] += seconds

    def stall(self, what: str) -> None:
        """A read got no bytes for the stall timeout: the line says so until bytes arrive."""
        with self._lock:
            if self.stalled is None:
                self.stalls += 1
            self.stalled = what

    def line(self) -> str:
        """The progress line for now."""
        with self._lock:
            done, stalled, written_at = self.bytes_written, self.stalled, self._written_at
        now = self.clock()
        rate = done / max(now - self.started, 1e-9)
        share = 100.0 * done / self.total_bytes if self.total_bytes else 100.0
        if stalled is not None:
            tail = f"stalled ({stalled})"
        elif now - written_at >= QUIET_S and done < self.total_bytes:
            tail = f"no bytes written for {now - written_at:.0f} s, ETA unknown"
        elif rate > 0:
            tail = f"ETA {human_eta((self.total_bytes - done) / rate)}"
        else:
            tail = "ETA unknown"
        return (f"{self.prefix} {human_bytes(done)} of {human_bytes(self.total_bytes)} "
                f"({share:.0f}%), {human_bytes(rate)}/s, {tail}")

    def start(self) -> None:
        if self.emit is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="dlo-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the periodic lines with a last one, so the log shows where the fill ended."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            assert self.emit is not None
            self.emit(self.line())

    def _run(self) -> None:
        assert self.emit is not None
        while not self._stop.wait(self.interval_s):
            self.emit(self.line())


@contextlib.contextmanager
def repeating(emit: Callable[[str], None], line: Callable[[float], str], *,
              interval_s: float = DEFAULT_INTERVAL_S, at_once: bool = True,
              clock: Callable[[], float] = time.monotonic) -> Iterator[None]:
    """Emit `line(seconds waited)` now (unless not `at_once`) and every `interval_s` until the
    block ends, so a wait that blocks its thread (the rendezvous, another loader's publication)
    still says what it waits for."""
    started = clock()
    done = threading.Event()
    if at_once:
        emit(line(0.0))

    def run() -> None:
        while not done.wait(interval_s):
            emit(line(clock() - started))

    thread = threading.Thread(target=run, name="dlo-waiting", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


class RankPrefixFilter(logging.Filter):
    """Prepends `[rank r/w]` to every record the loader's modules log (install on handlers)."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__()
        self.prefix = rank_prefix(rank, world_size)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("dlo_") and not getattr(record, "_dlo_prefixed", False):
            record.msg = f"{self.prefix} {record.msg}"
            record._dlo_prefixed = True
        return True
